//! The endpoint picker's exchange as Envoy runs it (full duplex): request headers and body,
//! the pick's answers, then the response's headers (the pick reported as served) and body.
//! `first` is the pick's latency (last body byte sent → the headers answer), `total` the
//! whole exchange.

use anyhow::{Context, bail};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use crate::Args;
use crate::load::{Sample, Worker};

/// The header the pick comes back in.
const DESTINATION: &str = "x-gateway-destination-endpoint";

/// One worker: a client on the shared channel and its request body.
pub(crate) struct EppWorker {
    client: ExternalProcessorClient<Channel>,
    body: Vec<u8>,
}

/// `args.concurrency` workers on one channel, each sending the HTTP lanes' completion.
pub(crate) async fn workers(args: &Args, prompt: &str) -> anyhow::Result<Vec<Worker>> {
    let address = args.epp.context("--epp is required for the epp lane")?;
    let channel = Endpoint::from_shared(format!("http://{address}"))?
        .tcp_nodelay(true)
        .connect()
        .await
        .context("ext_proc connect")?;
    let mut workers = Vec::with_capacity(args.concurrency);
    let body = serde_json::json!({
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
    });
    let body = serde_json::to_vec(&body)?;
    for _ in 0..args.concurrency {
        workers.push(Worker::Epp(EppWorker {
            client: ExternalProcessorClient::new(channel.clone()),
            body: body.clone(),
        }));
    }
    Ok(workers)
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(key, value)| HeaderValue {
                    key: (*key).to_string(),
                    value: String::new(),
                    raw_value: value.as_bytes().to_vec(),
                })
                .collect(),
        }),
        end_of_stream,
        ..HttpHeaders::default()
    }
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..ProcessingRequest::default()
    }
}

fn body(bytes: Vec<u8>) -> HttpBody {
    HttpBody {
        body: bytes,
        end_of_stream: true,
        ..HttpBody::default()
    }
}

impl EppWorker {
    /// Runs one exchange.
    pub(crate) async fn send(&mut self) -> anyhow::Result<Sample> {
        let (tx, rx) = mpsc::channel(4);
        let started = Instant::now();
        let full = BodySendMode::FullDuplexStreamed as i32;
        let mut first = message(Request::RequestHeaders(headers(
            &[(":method", "POST"), (":path", "/v1/completions")],
            false,
        )));
        first.protocol_config = Some(ProtocolConfiguration {
            request_body_mode: full,
            response_body_mode: full,
            send_body_without_waiting_for_header_response: false,
        });
        tx.send(first).await?;
        tx.send(message(Request::RequestBody(body(self.body.clone()))))
            .await?;
        let sent = Instant::now();
        let mut answers = self
            .client
            .process(ReceiverStream::new(rx))
            .await?
            .into_inner();
        let pick = match answers.message().await?.and_then(|a| a.response) {
            Some(Response::RequestHeaders(headers)) => headers
                .response
                .and_then(|common| common.header_mutation)
                .and_then(|mutation| {
                    mutation
                        .set_headers
                        .into_iter()
                        .filter_map(|option| option.header)
                        .find(|header| header.key == DESTINATION)
                })
                .map(|header| String::from_utf8_lossy(&header.raw_value).into_owned())
                .context("no destination header")?,
            other => bail!("expected the pick, got {other:?}"),
        };
        let first_answer = sent.elapsed();
        answers.message().await?.context("no body answer")?;
        let served = pick.split(',').next().unwrap_or_default().to_string();
        let mut response = message(Request::ResponseHeaders(headers(
            &[(":status", "200")],
            false,
        )));
        response.metadata_context = Some(Metadata {
            filter_metadata: [(
                "envoy.lb".to_string(),
                Struct {
                    fields: [(
                        format!("{DESTINATION}-served"),
                        Value {
                            kind: Some(value::Kind::StringValue(served)),
                        },
                    )]
                    .into(),
                },
            )]
            .into(),
            ..Metadata::default()
        });
        tx.send(response).await?;
        answers
            .message()
            .await?
            .context("no response headers answer")?;
        tx.send(message(Request::ResponseBody(body(b"{}".to_vec()))))
            .await?;
        answers
            .message()
            .await?
            .context("no response body answer")?;
        drop(tx);
        if answers.message().await?.is_some() {
            bail!("an answer too many");
        }
        Ok(Sample {
            started,
            first: first_answer,
            total: started.elapsed(),
        })
    }
}
