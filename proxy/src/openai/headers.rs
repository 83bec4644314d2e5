//! Header rewriting between client and engine: hop-by-hop headers are dropped
//! in both directions, `Host` names the backend, and the proxy's own headers
//! are added to responses.

use http::header::{self, HeaderName};
use http::{HeaderMap, HeaderValue, Method, Version};
use kvmesh_h1::fields::{is_100_continue, is_end_to_end, listed_in_connection};
use kvmesh_telemetry::traceparent::{TRACEPARENT, TRACESTATE, is_trace_field};
use pingora_error::Result;
use pingora_http::{RequestHeader, ResponseHeader};

/// `x-request-id`.
pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
/// `x-kvmesh-instance`: which backend answered.
pub(crate) const X_KVMESH_INSTANCE: HeaderName = HeaderName::from_static("x-kvmesh-instance");
/// `x-kvmesh-route`: why `policy: kv` chose that backend.
pub(crate) const X_KVMESH_ROUTE: HeaderName = HeaderName::from_static("x-kvmesh-route");

/// Whether a header is end-to-end (forwarded).
fn is_forwarded(headers: &HeaderMap, name: &HeaderName) -> bool {
    let name = name.as_str().as_bytes();
    is_end_to_end(name, None)
        && headers
            .get_all(header::CONNECTION)
            .iter()
            .all(|value| !listed_in_connection(value.as_bytes(), name))
}

/// The W3C trace context an engine request carries while tracing is on (it replaces the
/// client's).
#[derive(Debug, Clone)]
pub(crate) struct TraceHeaders {
    /// `traceparent`: the proxy's attempt span.
    pub(crate) traceparent: HeaderValue,
    /// `tracestate`, when the trace has one.
    pub(crate) tracestate: Option<HeaderValue>,
}

impl TraceHeaders {
    /// The fields, named.
    pub(crate) fn fields(&self) -> impl Iterator<Item = (&'static str, &HeaderValue)> {
        [
            (TRACEPARENT, Some(&self.traceparent)),
            (TRACESTATE, self.tracestate.as_ref()),
        ]
        .into_iter()
        .filter_map(|(name, value)| Some((name, value?)))
    }
}

/// The header naming the data-parallel rank an engine runs a request on (vLLM's).
pub(crate) const X_DATA_PARALLEL_RANK: &str = "x-data-parallel-rank";

/// `Transfer-Encoding: chunked`, for a streamed body of unknown length.
const CHUNKED: HeaderValue = HeaderValue::from_static("chunked");

/// What the engine request adds to the client's: the engine's `Host`, the body's length,
/// the request id, while tracing the trace context, and the data-parallel rank routing
/// chose.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineTarget<'a> {
    /// `Host` of the engine.
    pub(crate) host: &'a HeaderValue,
    /// Length of the body sent (`None`: not known, a streamed body sent chunked; HTTP/2
    /// frames it without a field).
    pub(crate) body_len: Option<u64>,
    /// `x-request-id`.
    pub(crate) request_id: &'a HeaderValue,
    /// `traceparent` and `tracestate` (`None`: tracing is off, the client's pass through).
    pub(crate) trace: Option<&'a TraceHeaders>,
    /// [`X_DATA_PARALLEL_RANK`] (`None`: the engine chooses; a client's passes through).
    pub(crate) dp_rank: Option<u32>,
}

/// The head of an engine request, as kvmesh owns it (whichever transport then writes it).
#[derive(Debug, Clone)]
pub(crate) struct EngineHead {
    /// The method.
    pub(crate) method: Method,
    /// The path and query.
    pub(crate) path: String,
    /// The fields.
    pub(crate) headers: HeaderMap,
}

/// A client head no engine request can be made of (said).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct InvalidHead(pub(crate) String);

impl std::fmt::Display for InvalidHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The request sent to a backend: the client's method, path and end-to-end
/// headers, `Host` set to the backend, the body's exact length, the
/// request id and, while tracing, the proxy's trace context.
pub(crate) fn upstream_request(client: &RequestHeader, target: &EngineTarget<'_>) -> EngineHead {
    let path = client
        .uri
        .path_and_query()
        .map_or("/", |path| path.as_str());
    let mut headers = HeaderMap::with_capacity(client.headers.len() + 2);
    for (name, value) in &client.headers {
        if *name == header::HOST
            || *name == header::CONTENT_LENGTH
            || *name == X_REQUEST_ID
            || (target.trace.is_some() && is_trace_field(name.as_str().as_bytes()))
            || (target.dp_rank.is_some() && name.as_str() == X_DATA_PARALLEL_RANK)
            || !is_forwarded(&client.headers, name)
        {
            continue;
        }
        headers.append(name.clone(), value.clone());
    }
    headers.insert(header::HOST, target.host.clone());
    match target.body_len {
        Some(length) => headers.insert(header::CONTENT_LENGTH, HeaderValue::from(length)),
        None => headers.insert(header::TRANSFER_ENCODING, CHUNKED),
    };
    headers.insert(X_REQUEST_ID, target.request_id.clone());
    for (name, value) in target.trace.iter().flat_map(|trace| trace.fields()) {
        headers.insert(name, value.clone());
    }
    if let Some(rank) = target.dp_rank {
        headers.insert(X_DATA_PARALLEL_RANK, HeaderValue::from(rank));
    }
    EngineHead {
        method: client.method.clone(),
        path: path.to_string(),
        headers,
    }
}

/// How the response body is framed towards the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClientFraming {
    /// The engine's `Content-Length` is kept (or the status has no body):
    /// nothing can be appended.
    Length,
    /// Chunked (HTTP/1.1), end of stream (h2) or close-delimited (HTTP/1.0):
    /// the proxy can end the body itself, e.g. after an error event.
    Open,
}

/// What the proxy adds to every forwarded response.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProxyHeaders<'a> {
    /// `x-kvmesh-instance`.
    pub(crate) instance: &'a HeaderValue,
    /// `x-request-id`.
    pub(crate) request_id: &'a HeaderValue,
    /// `x-kvmesh-route` (`policy: kv` only).
    pub(crate) route: Option<&'a HeaderValue>,
}

/// The response sent to the client: the engine's status and end-to-end
/// headers plus `x-kvmesh-instance`, `x-request-id` and, under `policy: kv`,
/// `x-kvmesh-route`.
pub(crate) fn downstream_response(
    upstream: &ResponseHeader,
    ours: ProxyHeaders<'_>,
    client_version: Version,
    client_is_h2: bool,
) -> Result<(ResponseHeader, ClientFraming)> {
    let mut response = ResponseHeader::build(upstream.status, Some(upstream.headers.len() + 4))?;
    for (name, value) in &upstream.headers {
        if *name == X_REQUEST_ID
            || *name == X_KVMESH_ROUTE
            || !is_forwarded(&upstream.headers, name)
        {
            continue;
        }
        response.append_header(name.clone(), value.clone())?;
    }
    response.insert_header(X_KVMESH_INSTANCE, ours.instance.clone())?;
    response.insert_header(X_REQUEST_ID, ours.request_id.clone())?;
    if let Some(route) = ours.route {
        response.insert_header(X_KVMESH_ROUTE, route.clone())?;
    }
    let bodiless = matches!(upstream.status.as_u16(), 204 | 304);
    let framing = if bodiless || response.headers.contains_key(header::CONTENT_LENGTH) {
        ClientFraming::Length
    } else {
        if !client_is_h2 && client_version == Version::HTTP_11 {
            response.insert_header(header::TRANSFER_ENCODING, "chunked")?;
        }
        ClientFraming::Open
    };
    Ok((response, framing))
}

/// The request's `Content-Length`, when present and numeric.
pub(crate) fn content_length(request: &RequestHeader) -> Option<u64> {
    request
        .headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether the client waits for `100 Continue` before sending its body.
pub(crate) fn expects_continue(request: &RequestHeader) -> bool {
    request
        .headers
        .get(header::EXPECT)
        .is_some_and(|value| is_100_continue(value.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ours<'a>(instance: &'a HeaderValue, request_id: &'a HeaderValue) -> ProxyHeaders<'a> {
        ProxyHeaders {
            instance,
            request_id,
            route: None,
        }
    }

    fn client_request() -> RequestHeader {
        let mut request = RequestHeader::build("POST", b"/v1/chat/completions?x=1", None).unwrap();
        for (name, value) in [
            ("host", "proxy:8080"),
            ("content-type", "application/json"),
            ("content-length", "999"),
            ("connection", "keep-alive, x-private"),
            ("keep-alive", "timeout=5"),
            ("x-private", "secret"),
            ("transfer-encoding", "chunked"),
            ("te", "trailers"),
            ("expect", "100-continue"),
            ("authorization", "Bearer k"),
            ("x-request-id", "client-id"),
            ("x-custom", "a"),
        ] {
            request.append_header(name, value).unwrap();
        }
        request.append_header("x-custom", "b").unwrap();
        request
    }

    #[test]
    fn upstream_request_drops_hop_by_hop_and_sets_host_and_length() {
        let host = HeaderValue::from_static("127.0.0.1:8001");
        let id = HeaderValue::from_static("rid");
        let target = EngineTarget {
            host: &host,
            body_len: Some(42),
            request_id: &id,
            trace: None,
            dp_rank: None,
        };
        let request = upstream_request(&client_request(), &target);
        assert_eq!(request.method, "POST");
        assert_eq!(request.path, "/v1/chat/completions?x=1");
        let headers = &request.headers;
        assert_eq!(headers["host"], "127.0.0.1:8001");
        assert_eq!(headers["content-length"], "42");
        assert_eq!(headers["x-request-id"], "rid");
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(headers["authorization"], "Bearer k");
        let custom: Vec<_> = headers.get_all("x-custom").iter().collect();
        assert_eq!(custom, ["a", "b"]);
        for gone in [
            "connection",
            "keep-alive",
            "x-private",
            "transfer-encoding",
            "te",
            "expect",
        ] {
            assert!(!headers.contains_key(gone), "{gone} forwarded");
        }
        assert_eq!(headers.get_all("host").iter().count(), 1);
        assert_eq!(headers.get_all("x-request-id").iter().count(), 1);
    }

    #[test]
    fn the_trace_context_passes_through_unless_the_proxy_traces() {
        let mut client = client_request();
        let theirs = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        client.append_header("traceparent", theirs).unwrap();
        client.append_header("tracestate", "a=1").unwrap();
        let host = HeaderValue::from_static("127.0.0.1:8001");
        let id = HeaderValue::from_static("rid");
        let mut target = EngineTarget {
            host: &host,
            body_len: Some(1),
            request_id: &id,
            trace: None,
            dp_rank: None,
        };
        let off = upstream_request(&client, &target);
        assert_eq!(off.headers["traceparent"], theirs);
        assert_eq!(off.headers["tracestate"], "a=1");

        let ours = "00-4bf92f3577b34da6a3ce929d0e0e4736-1111111111111111-01";
        let trace = TraceHeaders {
            traceparent: HeaderValue::from_static(ours),
            tracestate: None,
        };
        target.trace = Some(&trace);
        let on = upstream_request(&client, &target);
        let values: Vec<_> = on.headers.get_all("traceparent").iter().collect();
        assert_eq!(values, [ours]);
        assert!(!on.headers.contains_key("tracestate"), "theirs is replaced");
        let with_state = TraceHeaders {
            tracestate: Some(HeaderValue::from_static("b=2")),
            ..trace.clone()
        };
        target.trace = Some(&with_state);
        let on = upstream_request(&client, &target);
        let values: Vec<_> = on.headers.get_all("tracestate").iter().collect();
        assert_eq!(values, ["b=2"]);
    }

    #[test]
    fn the_rank_routing_chose_replaces_the_client_s() {
        let mut client = client_request();
        client.append_header("X-data-parallel-rank", "0").unwrap();
        let host = HeaderValue::from_static("127.0.0.1:8001");
        let id = HeaderValue::from_static("rid");
        let mut target = EngineTarget {
            host: &host,
            body_len: Some(1),
            request_id: &id,
            trace: None,
            dp_rank: None,
        };
        let theirs = upstream_request(&client, &target);
        assert_eq!(theirs.headers[X_DATA_PARALLEL_RANK], "0");
        target.dp_rank = Some(1);
        let ours = upstream_request(&client, &target);
        let values: Vec<_> = ours.headers.get_all(X_DATA_PARALLEL_RANK).iter().collect();
        assert_eq!(values, ["1"]);
    }

    #[test]
    fn downstream_response_adds_proxy_headers_and_chooses_framing() {
        let mut upstream = ResponseHeader::build(200, None).unwrap();
        upstream
            .append_header("content-type", "text/event-stream")
            .unwrap();
        upstream
            .append_header("transfer-encoding", "chunked")
            .unwrap();
        upstream.append_header("connection", "keep-alive").unwrap();
        upstream.append_header("x-engine", "vllm").unwrap();
        let instance = HeaderValue::from_static("http://127.0.0.1:8001");
        let id = HeaderValue::from_static("rid");
        let (response, framing) =
            downstream_response(&upstream, ours(&instance, &id), Version::HTTP_11, false).unwrap();
        assert_eq!(framing, ClientFraming::Open);
        assert_eq!(response.status, 200);
        assert_eq!(
            response.headers["x-kvmesh-instance"],
            "http://127.0.0.1:8001"
        );
        assert_eq!(response.headers["x-request-id"], "rid");
        assert_eq!(response.headers["x-engine"], "vllm");
        assert_eq!(response.headers["transfer-encoding"], "chunked");
        assert!(!response.headers.contains_key("connection"));
        assert_eq!(response.headers["content-type"], "text/event-stream");

        let (h2, _) =
            downstream_response(&upstream, ours(&instance, &id), Version::HTTP_2, true).unwrap();
        assert!(!h2.headers.contains_key("transfer-encoding"));
        let (old, framing) =
            downstream_response(&upstream, ours(&instance, &id), Version::HTTP_10, false).unwrap();
        assert!(!old.headers.contains_key("transfer-encoding"));
        assert_eq!(framing, ClientFraming::Open);

        let mut sized = ResponseHeader::build(400, None).unwrap();
        sized.append_header("content-length", "17").unwrap();
        sized.append_header("x-request-id", "engine-id").unwrap();
        let (response, framing) =
            downstream_response(&sized, ours(&instance, &id), Version::HTTP_11, false).unwrap();
        assert_eq!(framing, ClientFraming::Length);
        assert_eq!(response.status, 400);
        assert_eq!(response.headers["content-length"], "17");
        assert_eq!(response.headers.get_all("x-request-id").iter().count(), 1);
        assert_eq!(response.headers["x-request-id"], "rid");
        assert!(!response.headers.contains_key("transfer-encoding"));
    }

    #[test]
    fn the_route_explanation_is_added_and_never_taken_from_the_engine() {
        let mut upstream = ResponseHeader::build(200, None).unwrap();
        upstream.append_header("x-kvmesh-route", "forged").unwrap();
        let instance = HeaderValue::from_static("http://h:1");
        let id = HeaderValue::from_static("rid");
        let (plain, _) =
            downstream_response(&upstream, ours(&instance, &id), Version::HTTP_11, false).unwrap();
        assert!(!plain.headers.contains_key("x-kvmesh-route"));
        let route = HeaderValue::from_static("instance=http://h:1; overlap_blocks=2");
        let with_route = ProxyHeaders {
            route: Some(&route),
            ..ours(&instance, &id)
        };
        let (routed, _) =
            downstream_response(&upstream, with_route, Version::HTTP_11, false).unwrap();
        let values: Vec<_> = routed.headers.get_all("x-kvmesh-route").iter().collect();
        assert_eq!(values, [&route]);
    }

    #[test]
    fn bodiless_statuses_are_not_chunked() {
        let instance = HeaderValue::from_static("http://h:1");
        let id = HeaderValue::from_static("rid");
        for status in [204, 304] {
            let upstream = ResponseHeader::build(status, None).unwrap();
            let (response, framing) =
                downstream_response(&upstream, ours(&instance, &id), Version::HTTP_11, false)
                    .unwrap();
            assert_eq!(framing, ClientFraming::Length);
            assert!(!response.headers.contains_key("transfer-encoding"));
        }
    }

    #[test]
    fn reads_length_and_expect() {
        let request = client_request();
        assert_eq!(content_length(&request), Some(999));
        assert!(expects_continue(&request));
        let bare = RequestHeader::build("POST", b"/", None).unwrap();
        assert_eq!(content_length(&bare), None);
        assert!(!expects_continue(&bare));
    }
}
