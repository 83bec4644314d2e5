//! The `ext_proc` messages the endpoint picker reads (headers, body modes, the gateway's
//! metadata) and the ones it answers with (the pick as a header and as dynamic metadata,
//! body echoes, immediate responses).

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ImmediateResponse,
    ProcessingResponse, ProtocolConfiguration, StreamedBodyResponse, TrailersResponse,
    body_mutation, processing_response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value};

/// How the gateway sends one direction's body (`ProcessingMode.*_body_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMode {
    /// No body messages.
    None,
    /// The whole body in one message, after the headers were answered.
    Buffered,
    /// Body chunks as they come, each answered (`STREAMED`, `BUFFERED_PARTIAL`, `GRPC`).
    Streamed,
    /// Body chunks sent without waiting for answers; the answers carry the body back
    /// (`FULL_DUPLEX_STREAMED`, the Gateway API Inference Extension's mode).
    FullDuplex,
}

impl BodyMode {
    fn of(raw: i32) -> Self {
        match BodySendMode::try_from(raw) {
            Ok(BodySendMode::None) => Self::None,
            Ok(BodySendMode::Buffered) => Self::Buffered,
            Ok(BodySendMode::FullDuplexStreamed) | Err(_) => Self::FullDuplex,
            Ok(BodySendMode::Streamed | BodySendMode::BufferedPartial | BodySendMode::Grpc) => {
                Self::Streamed
            }
        }
    }
}

/// The body modes of both directions, from the stream's first message. A gateway that does
/// not say (Envoy before 1.33) is taken to use the Inference Extension's full duplex mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modes {
    /// The request body's.
    pub request: BodyMode,
    /// The response body's.
    pub response: BodyMode,
}

impl Modes {
    /// The modes `config` names.
    pub fn of(config: Option<&ProtocolConfiguration>) -> Self {
        match config {
            Some(config) => Self {
                request: BodyMode::of(config.request_body_mode),
                response: BodyMode::of(config.response_body_mode),
            },
            None => Self {
                request: BodyMode::FullDuplex,
                response: BodyMode::FullDuplex,
            },
        }
    }
}

/// The value of header `name` (lowercase; pseudo-headers like `:path` included) in
/// `headers`, when present and UTF-8. Envoy sends `raw_value`; older ones `value`.
pub fn header<'h>(headers: Option<&'h HeaderMap>, name: &str) -> Option<&'h str> {
    let entry = headers?
        .headers
        .iter()
        .find(|entry| entry.key.eq_ignore_ascii_case(name))?;
    if entry.raw_value.is_empty() {
        Some(entry.value.as_str())
    } else {
        std::str::from_utf8(&entry.raw_value).ok()
    }
}

/// The string list at `namespace` → `key` of `metadata` (strings only; `None`: not set).
pub fn metadata_list(
    metadata: Option<&Metadata>,
    namespace: &str,
    key: &str,
) -> Option<Vec<String>> {
    match metadata_value(metadata, namespace, key)? {
        value::Kind::ListValue(list) => Some(
            list.values
                .iter()
                .filter_map(|value| match &value.kind {
                    Some(value::Kind::StringValue(text)) => Some(text.clone()),
                    _ => None,
                })
                .collect(),
        ),
        value::Kind::StringValue(text) => Some(split_endpoints(text)),
        _ => Some(Vec::new()),
    }
}

/// The string at `namespace` → `key` of `metadata`.
pub fn metadata_string<'m>(
    metadata: Option<&'m Metadata>,
    namespace: &str,
    key: &str,
) -> Option<&'m str> {
    match metadata_value(metadata, namespace, key)? {
        value::Kind::StringValue(text) => Some(text.as_str()),
        _ => None,
    }
}

fn metadata_value<'m>(
    metadata: Option<&'m Metadata>,
    namespace: &str,
    key: &str,
) -> Option<&'m value::Kind> {
    metadata?
        .filter_metadata
        .get(namespace)?
        .fields
        .get(key)?
        .kind
        .as_ref()
}

/// The endpoints of a comma-separated list, trimmed, empty ones left out.
pub fn split_endpoints(text: &str) -> Vec<String> {
    text.split(',')
        .map(str::trim)
        .filter(|endpoint| !endpoint.is_empty())
        .map(str::to_string)
        .collect()
}

/// A header set (replacing any value the client sent).
pub fn set_header(name: &str, value: &[u8]) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_string(),
            value: String::new(),
            raw_value: value.to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

/// `{namespace: {key: value}}`, the dynamic metadata naming the pick.
pub fn pick_metadata(namespace: &str, key: &str, value: &str) -> Struct {
    let inner = Struct {
        fields: [(key.to_string(), string_value(value))].into(),
    };
    Struct {
        fields: [(
            namespace.to_string(),
            Value {
                kind: Some(value::Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn string_value(text: &str) -> Value {
    Value {
        kind: Some(value::Kind::StringValue(text.to_string())),
    }
}

/// What a `CommonResponse` changes: headers set, and with full duplex the body carried back.
fn common(set: Vec<HeaderValueOption>, body: Option<(Vec<u8>, bool)>) -> CommonResponse {
    CommonResponse {
        header_mutation: (!set.is_empty()).then(|| HeaderMutation {
            set_headers: set,
            remove_headers: Vec::new(),
        }),
        body_mutation: body.map(|(body, end_of_stream)| BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                    ..StreamedBodyResponse::default()
                },
            )),
        }),
        ..CommonResponse::default()
    }
}

/// Which half of the exchange a message answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    /// The client's request.
    Request,
    /// The engine's response.
    Response,
}

/// The answer to a headers message, setting `set`; `metadata` is the dynamic metadata.
pub fn headers_answer(
    half: Half,
    set: Vec<HeaderValueOption>,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    let headers = HeadersResponse {
        response: Some(common(set, None)),
    };
    ProcessingResponse {
        response: Some(match half {
            Half::Request => processing_response::Response::RequestHeaders(headers),
            Half::Response => processing_response::Response::ResponseHeaders(headers),
        }),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

/// The answer to a body message: with `echo` (full duplex) the body chunk carried back,
/// else the body left as it is; `set` headers (buffered request bodies only) and
/// `metadata` as for headers.
pub fn body_answer(
    half: Half,
    echo: Option<(Vec<u8>, bool)>,
    set: Vec<HeaderValueOption>,
    metadata: Option<Struct>,
) -> ProcessingResponse {
    let body = BodyResponse {
        response: Some(common(set, echo)),
    };
    ProcessingResponse {
        response: Some(match half {
            Half::Request => processing_response::Response::RequestBody(body),
            Half::Response => processing_response::Response::ResponseBody(body),
        }),
        dynamic_metadata: metadata,
        ..ProcessingResponse::default()
    }
}

/// The answer to a trailers message (nothing changed).
pub fn trailers_answer(half: Half) -> ProcessingResponse {
    let trailers = TrailersResponse::default();
    ProcessingResponse {
        response: Some(match half {
            Half::Request => processing_response::Response::RequestTrailers(trailers),
            Half::Response => processing_response::Response::ResponseTrailers(trailers),
        }),
        ..ProcessingResponse::default()
    }
}

/// The gateway answers the client itself with `status`, a JSON `body` and
/// `retry_after_secs` (when set), and sends nothing upstream.
pub fn immediate(status: u16, body: Bytes, retry_after_secs: Option<u64>) -> ProcessingResponse {
    let mut set = vec![set_header("content-type", b"application/json")];
    if let Some(secs) = retry_after_secs {
        set.push(set_header("retry-after", secs.to_string().as_bytes()));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(
            ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(status),
                }),
                headers: Some(HeaderMutation {
                    set_headers: set,
                    remove_headers: Vec::new(),
                }),
                body: body.to_vec(),
                details: format!("kvmesh_epp_{status}"),
                ..ImmediateResponse::default()
            },
        )),
        ..ProcessingResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::google::protobuf::ListValue;

    use super::*;

    fn metadata(namespace: &str, key: &str, kind: value::Kind) -> Metadata {
        Metadata {
            filter_metadata: [(
                namespace.to_string(),
                Struct {
                    fields: [(key.to_string(), Value { kind: Some(kind) })].into(),
                },
            )]
            .into(),
            ..Metadata::default()
        }
    }

    #[test]
    fn modes_default_to_full_duplex_and_read_what_the_gateway_says() {
        let full = Modes::of(None);
        assert_eq!(full.request, BodyMode::FullDuplex);
        assert_eq!(full.response, BodyMode::FullDuplex);
        let said = Modes::of(Some(&ProtocolConfiguration {
            request_body_mode: BodySendMode::Buffered as i32,
            response_body_mode: BodySendMode::None as i32,
            send_body_without_waiting_for_header_response: false,
        }));
        assert_eq!(said.request, BodyMode::Buffered);
        assert_eq!(said.response, BodyMode::None);
        assert_eq!(
            BodyMode::of(BodySendMode::Streamed as i32),
            BodyMode::Streamed
        );
        assert_eq!(
            BodyMode::of(BodySendMode::BufferedPartial as i32),
            BodyMode::Streamed
        );
    }

    #[test]
    fn headers_are_read_from_raw_or_plain_values() {
        let map = HeaderMap {
            headers: vec![
                HeaderValue {
                    key: ":path".to_string(),
                    value: String::new(),
                    raw_value: b"/v1/completions".to_vec(),
                },
                HeaderValue {
                    key: "x-session-id".to_string(),
                    value: "s1".to_string(),
                    raw_value: Vec::new(),
                },
                HeaderValue {
                    key: "x-bad".to_string(),
                    value: String::new(),
                    raw_value: vec![0xff, 0xfe],
                },
            ],
        };
        assert_eq!(header(Some(&map), ":path"), Some("/v1/completions"));
        assert_eq!(header(Some(&map), "X-Session-Id"), Some("s1"));
        assert_eq!(header(Some(&map), "x-bad"), None);
        assert_eq!(header(Some(&map), "x-none"), None);
        assert_eq!(header(None, ":path"), None);
    }

    #[test]
    fn the_subset_hint_is_a_list_of_strings() {
        let list = value::Kind::ListValue(ListValue {
            values: vec![
                string_value("10.0.0.1:8000"),
                Value {
                    kind: Some(value::Kind::NumberValue(1.0)),
                },
                string_value("10.0.0.2:8000"),
            ],
        });
        let hint = metadata("envoy.lb.subset_hint", "x-subset", list);
        assert_eq!(
            metadata_list(Some(&hint), "envoy.lb.subset_hint", "x-subset"),
            Some(vec![
                "10.0.0.1:8000".to_string(),
                "10.0.0.2:8000".to_string()
            ])
        );
        assert_eq!(
            metadata_list(Some(&hint), "envoy.lb.subset_hint", "other"),
            None
        );
        assert_eq!(metadata_list(Some(&hint), "other", "x-subset"), None);
        assert_eq!(
            metadata_list(None, "envoy.lb.subset_hint", "x-subset"),
            None
        );
        let empty = metadata(
            "ns",
            "k",
            value::Kind::ListValue(ListValue { values: Vec::new() }),
        );
        assert_eq!(metadata_list(Some(&empty), "ns", "k"), Some(Vec::new()));
        let text = metadata(
            "ns",
            "k",
            value::Kind::StringValue(" a:1, b:2 ,".to_string()),
        );
        assert_eq!(
            metadata_list(Some(&text), "ns", "k"),
            Some(vec!["a:1".to_string(), "b:2".to_string()])
        );
    }

    #[test]
    fn the_served_endpoint_is_a_string() {
        let served = metadata(
            "envoy.lb",
            "x-served",
            value::Kind::StringValue("a:1".into()),
        );
        assert_eq!(
            metadata_string(Some(&served), "envoy.lb", "x-served"),
            Some("a:1")
        );
        let number = metadata("envoy.lb", "x-served", value::Kind::NumberValue(1.0));
        assert_eq!(metadata_string(Some(&number), "envoy.lb", "x-served"), None);
    }

    #[test]
    fn the_pick_goes_out_as_header_and_metadata_with_one_value() {
        let answer = headers_answer(
            Half::Request,
            vec![set_header("x-pick", b"a:1,b:2")],
            Some(pick_metadata("envoy.lb", "x-pick", "a:1,b:2")),
        );
        let Some(processing_response::Response::RequestHeaders(headers)) = &answer.response else {
            panic!("{answer:?}");
        };
        let set = &headers
            .response
            .as_ref()
            .unwrap()
            .header_mutation
            .as_ref()
            .unwrap()
            .set_headers;
        let header = set[0].header.as_ref().unwrap();
        assert_eq!(
            (header.key.as_str(), header.raw_value.as_slice()),
            ("x-pick", &b"a:1,b:2"[..])
        );
        assert_eq!(
            set[0].append_action,
            HeaderAppendAction::OverwriteIfExistsOrAdd as i32
        );
        let metadata = Metadata {
            filter_metadata: answer
                .dynamic_metadata
                .unwrap()
                .fields
                .into_iter()
                .map(|(k, v)| match v.kind {
                    Some(value::Kind::StructValue(inner)) => (k, inner),
                    other => panic!("{other:?}"),
                })
                .collect(),
            ..Metadata::default()
        };
        assert_eq!(
            metadata_string(Some(&metadata), "envoy.lb", "x-pick"),
            Some("a:1,b:2")
        );
    }

    #[test]
    fn immediate_answers_carry_status_json_and_retry_after() {
        let answer = immediate(429, Bytes::from_static(b"{}"), Some(2));
        let Some(processing_response::Response::ImmediateResponse(immediate)) = answer.response
        else {
            panic!("not immediate");
        };
        assert_eq!(immediate.status.unwrap().code, 429);
        assert_eq!(immediate.body, b"{}");
        let set = immediate.headers.unwrap().set_headers;
        let names: Vec<_> = set
            .iter()
            .map(|h| {
                let h = h.header.as_ref().unwrap();
                (
                    h.key.clone(),
                    String::from_utf8(h.raw_value.clone()).unwrap(),
                )
            })
            .collect();
        assert_eq!(
            names,
            [
                ("content-type".to_string(), "application/json".to_string()),
                ("retry-after".to_string(), "2".to_string())
            ]
        );
    }
}
