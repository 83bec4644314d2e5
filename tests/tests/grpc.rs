//! The KServe v2 gRPC frontend with a Rust tonic client, against real processes:
//! `kvmesh-engine-sim` engines behind `kvmesh-proxy` with `grpc.address` set.
//!
//! Health, metadata and config; inference with text and with token ids; several requests
//! multiplexed on one stream; every error code; a cancelled stream and a passed deadline
//! releasing the engine's request; KV-aware routing on the gRPC path, seen in the
//! engines' prefix-cache hit counters.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvmesh_e2e::cluster::{MODEL, engine_urls, proxy_config, start_engines, start_proxy};
use kvmesh_e2e::control_plane::assert_migrations;
use kvmesh_e2e::{HttpClient, ScratchDir, Spawned, grpc};
use kvmesh_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use kvmesh_proto::inference::infer_parameter::ParameterChoice;
use kvmesh_proto::inference::model_infer_request::InferInputTensor;
use kvmesh_proto::inference::{
    DataType, InferParameter, InferTensorContents, ModelConfigRequest, ModelInferRequest,
    ModelInferResponse, ModelMetadataRequest, ModelReadyRequest, ModelStatisticsRequest,
    ModelStreamInferResponse, ServerLiveRequest, ServerMetadataRequest, ServerReadyRequest,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Streaming};

/// How long a test waits for an engine to drop a cancelled request.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(10);

/// Engines and a proxy whose gRPC listener is on.
struct Cluster {
    _scratch: ScratchDir,
    sims: Spawned,
    proxy: Spawned,
}

impl Cluster {
    /// `engines` engine-sims (`sim_args` added) behind a proxy; `models` and `extra` are
    /// appended to the model list and to the config.
    fn start(label: &str, engines: usize, sim_args: &[&str], models: &str, policy: &str) -> Self {
        let scratch = ScratchDir::new(label).expect("scratch dir");
        let sims = start_engines(&scratch, engines, sim_args).expect("engine-sim");
        let config = proxy_config(&engine_urls(&sims), models)
            .replace("policy: round_robin", policy)
            + "grpc:\n  address: 127.0.0.1:0\n  max_message_bytes: 65536\n";
        let proxy = start_proxy(&scratch, &config).expect("kvmesh-proxy");
        Self {
            _scratch: scratch,
            sims,
            proxy,
        }
    }

    async fn client(&self) -> GrpcInferenceServiceClient<Channel> {
        GrpcInferenceServiceClient::new(channel(self.proxy.addr("grpc")).await)
    }

    fn engines(&self) -> Vec<String> {
        engine_urls(&self.sims)
    }
}

/// A client on hyper's own HTTP/2 client, without tonic's `Channel`: that one times every call
/// by its `grpc-timeout` itself and so races the server's deadline. This one sends the header
/// and sets no timer: a call it sees end by its deadline was ended by the server.
fn untimed_client(
    addr: SocketAddr,
) -> GrpcInferenceServiceClient<HyperClient<HttpConnector, tonic::body::Body>> {
    let http2 = HyperClient::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let origin = format!("http://{addr}").parse().expect("origin");
    GrpcInferenceServiceClient::with_origin(http2, origin)
}

async fn channel(addr: SocketAddr) -> Channel {
    grpc::connect(Endpoint::from_shared(format!("http://{addr}")).expect("endpoint"))
        .await
        .expect("gRPC connect")
}

fn bytes_input(name: &str, value: &str) -> InferInputTensor {
    InferInputTensor {
        name: name.to_string(),
        datatype: "BYTES".to_string(),
        shape: vec![1],
        parameters: HashMap::new(),
        contents: Some(InferTensorContents {
            bytes_contents: vec![value.as_bytes().to_vec()],
            ..Default::default()
        }),
    }
}

fn streaming_input(on: bool) -> InferInputTensor {
    InferInputTensor {
        name: "streaming".to_string(),
        datatype: "BOOL".to_string(),
        shape: vec![1],
        parameters: HashMap::new(),
        contents: Some(InferTensorContents {
            bool_contents: vec![on],
            ..Default::default()
        }),
    }
}

fn int(value: i64) -> InferParameter {
    InferParameter {
        parameter_choice: Some(ParameterChoice::Int64Param(value)),
    }
}

/// A text request for [`MODEL`].
fn text_request(id: &str, prompt: &str, max_tokens: i64, streaming: bool) -> ModelInferRequest {
    let mut inputs = vec![bytes_input("text_input", prompt)];
    if streaming {
        inputs.push(streaming_input(true));
    }
    ModelInferRequest {
        model_name: MODEL.to_string(),
        id: id.to_string(),
        parameters: HashMap::from([("max_tokens".to_string(), int(max_tokens))]),
        inputs,
        ..Default::default()
    }
}

/// A token-id request for [`MODEL`].
fn ids_request(ids: &[i64], max_tokens: i64) -> ModelInferRequest {
    ModelInferRequest {
        model_name: MODEL.to_string(),
        parameters: HashMap::from([("max_tokens".to_string(), int(max_tokens))]),
        inputs: vec![InferInputTensor {
            name: "input_ids".to_string(),
            datatype: "INT64".to_string(),
            shape: vec![1, ids.len() as i64],
            parameters: HashMap::new(),
            contents: Some(InferTensorContents {
                int64_contents: ids.to_vec(),
                ..Default::default()
            }),
        }],
        ..Default::default()
    }
}

/// The one string of output `name` (raw contents: a 4-byte little-endian length, then
/// the bytes).
fn output(response: &ModelInferResponse, name: &str) -> String {
    let at = response
        .outputs
        .iter()
        .position(|o| o.name == name)
        .unwrap_or_else(|| panic!("no output {name} in {response:?}"));
    let tensor = &response.outputs[at];
    assert_eq!(tensor.datatype, "BYTES");
    assert_eq!(tensor.shape, [1]);
    let raw = &response.raw_output_contents[at];
    let (length, text) = raw.split_at(4);
    let length = u32::from_le_bytes(length.try_into().expect("a length prefix"));
    assert_eq!(length as usize, text.len(), "one element");
    String::from_utf8(text.to_vec()).expect("UTF-8")
}

fn int_param(response: &ModelInferResponse, name: &str) -> Option<i64> {
    match response.parameters.get(name)?.parameter_choice {
        Some(ParameterChoice::Int64Param(n)) => Some(n),
        _ => None,
    }
}

fn is_final(response: &ModelInferResponse) -> bool {
    matches!(
        response
            .parameters
            .get("triton_final_response")
            .and_then(|p| p.parameter_choice.as_ref()),
        Some(ParameterChoice::BoolParam(true))
    )
}

/// Sum of an engine metric over `engines`.
async fn engine_metric(engines: &[String], name: &str) -> Vec<f64> {
    let client = HttpClient::http1();
    let mut values = Vec::new();
    for engine in engines {
        let text = client
            .get(&format!("{engine}/metrics"))
            .await
            .expect("engine metrics");
        let text = String::from_utf8_lossy(&text.body).into_owned();
        values.push(
            text.lines()
                .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
                .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
        );
    }
    values
}

/// Waits until no engine runs a request (the proxy dropped the cancelled ones).
async fn await_engines_idle(engines: &[String]) {
    let deadline = tokio::time::Instant::now() + RELEASE_TIMEOUT;
    loop {
        let running: f64 = engine_metric(engines, "vllm:num_requests_running")
            .await
            .iter()
            .sum();
        if running == 0.0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the engines still run {running} requests after {RELEASE_TIMEOUT:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until some engine runs a request.
async fn await_engine_busy(engines: &[String]) {
    let deadline = tokio::time::Instant::now() + RELEASE_TIMEOUT;
    loop {
        let running: f64 = engine_metric(engines, "vllm:num_requests_running")
            .await
            .iter()
            .sum();
        if running > 0.0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no request reached an engine"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Opens a ModelStreamInfer call; requests go in through the sender.
async fn open_stream(
    client: &mut GrpcInferenceServiceClient<Channel>,
) -> (
    mpsc::Sender<ModelInferRequest>,
    Streaming<ModelStreamInferResponse>,
) {
    let (tx, rx) = mpsc::channel(16);
    let responses = client
        .model_stream_infer(ReceiverStream::new(rx))
        .await
        .expect("ModelStreamInfer")
        .into_inner();
    (tx, responses)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_metadata_config_and_reflection() {
    let cluster = Cluster::start("grpc-meta", 2, &["--no-delay"], "", "policy: round_robin");
    let mut client = cluster.client().await;
    assert!(
        client
            .server_live(ServerLiveRequest {})
            .await
            .unwrap()
            .into_inner()
            .live
    );
    assert!(
        client
            .server_ready(ServerReadyRequest {})
            .await
            .unwrap()
            .into_inner()
            .ready
    );
    let ready = |name: &str, version: &str| ModelReadyRequest {
        name: name.to_string(),
        version: version.to_string(),
    };
    assert!(
        client
            .model_ready(ready(MODEL, ""))
            .await
            .unwrap()
            .into_inner()
            .ready
    );
    assert!(
        client
            .model_ready(ready(MODEL, "1"))
            .await
            .unwrap()
            .into_inner()
            .ready
    );
    assert!(
        !client
            .model_ready(ready(MODEL, "2"))
            .await
            .unwrap()
            .into_inner()
            .ready
    );
    assert!(
        !client
            .model_ready(ready("nope", ""))
            .await
            .unwrap()
            .into_inner()
            .ready
    );

    let server = client
        .server_metadata(ServerMetadataRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(server.name, "kvmesh");
    assert!(
        server
            .extensions
            .contains(&"model_configuration".to_string())
    );

    let metadata = client
        .model_metadata(ModelMetadataRequest {
            name: MODEL.to_string(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(metadata.versions, ["1"]);
    let inputs: BTreeMap<_, _> = metadata
        .inputs
        .iter()
        .map(|t| (t.name.as_str(), (t.datatype.as_str(), t.shape.clone())))
        .collect();
    assert_eq!(inputs["text_input"], ("BYTES", vec![1]));
    assert_eq!(inputs["input_ids"], ("INT64", vec![-1]));
    assert_eq!(inputs["streaming"], ("BOOL", vec![1]));
    let outputs: Vec<_> = metadata.outputs.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(outputs, ["text_output", "finish_reason"]);

    let config = client
        .model_config(ModelConfigRequest {
            name: MODEL.to_string(),
            version: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .config
        .expect("config");
    assert_eq!(config.name, MODEL);
    assert!(config.model_transaction_policy.expect("policy").decoupled);
    let text = config
        .input
        .iter()
        .find(|i| i.name == "text_input")
        .unwrap();
    assert_eq!(text.data_type, DataType::TypeString as i32);
    assert!(text.optional);

    let channel = channel(cluster.proxy.addr("grpc")).await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    for service in ["", "inference.GRPCInferenceService"] {
        let status = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        assert_eq!(
            status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }

    use tonic_reflection::pb::v1::ServerReflectionRequest;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(channel);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(tokio_stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers
        .message()
        .await
        .unwrap()
        .expect("a reflection answer");
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("not a service list: {answer:?}");
    };
    let services: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(
        services.contains(&"inference.GRPCInferenceService"),
        "{services:?}"
    );
    assert!(services.contains(&"grpc.health.v1.Health"), "{services:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infers_with_text_and_with_token_ids() {
    let cluster = Cluster::start("grpc-infer", 2, &["--no-delay"], "", "policy: round_robin");
    let mut client = cluster.client().await;
    let answer = client
        .model_infer(text_request("req-1", "Say hello to the mesh.", 7, false))
        .await
        .expect("ModelInfer");
    let instance = answer
        .metadata()
        .get("x-kvmesh-instance")
        .and_then(|v| v.to_str().ok())
        .expect("x-kvmesh-instance")
        .to_string();
    assert!(cluster.engines().contains(&instance), "{instance}");
    assert_eq!(
        answer
            .metadata()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
        Some("req-1")
    );
    let response = answer.into_inner();
    assert_eq!(response.id, "req-1");
    assert_eq!(response.model_name, MODEL);
    assert_eq!(response.model_version, "1");
    assert!(!output(&response, "text_output").is_empty());
    assert_eq!(output(&response, "finish_reason"), "length");
    assert_eq!(int_param(&response, "completion_tokens"), Some(7));
    assert!(int_param(&response, "prompt_tokens").unwrap() > 0);
    assert!(is_final(&response));

    let ids: Vec<i64> = (100..164).collect();
    let response = client
        .model_infer(ids_request(&ids, 4))
        .await
        .expect("ModelInfer with token ids")
        .into_inner();
    assert_eq!(int_param(&response, "prompt_tokens"), Some(64));
    assert_eq!(int_param(&response, "completion_tokens"), Some(4));
    assert!(!output(&response, "text_output").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stream_carries_several_requests() {
    let cluster = Cluster::start("grpc-stream", 2, &["--no-delay"], "", "policy: round_robin");
    let mut client = cluster.client().await;
    let prompts = [
        ("a", "First prompt"),
        ("b", "Second prompt"),
        ("c", "Third prompt"),
    ];
    let mut expected = HashMap::new();
    for (id, prompt) in prompts {
        let unary = client
            .model_infer(text_request(id, prompt, 6, false))
            .await
            .unwrap()
            .into_inner();
        expected.insert(id.to_string(), output(&unary, "text_output"));
    }
    let (tx, mut responses) = open_stream(&mut client).await;
    for (id, prompt) in prompts {
        tx.send(text_request(id, prompt, 6, true)).await.unwrap();
    }
    tx.send(text_request("folded", "Fourth prompt", 3, false))
        .await
        .unwrap();
    let mut unknown = text_request("lost", "x", 3, true);
    unknown.model_name = "no-such-model".to_string();
    tx.send(unknown).await.unwrap();
    drop(tx);

    let mut texts: HashMap<String, String> = HashMap::new();
    let mut chunks: HashMap<String, usize> = HashMap::new();
    let mut finals: HashMap<String, ModelInferResponse> = HashMap::new();
    let mut errors = Vec::new();
    while let Some(message) = grpc::next_message(&mut responses)
        .await
        .expect("the stream goes on")
    {
        if !message.error_message.is_empty() {
            let bare = message.infer_response.expect("the failed request's id");
            errors.push((bare.id, message.error_message));
            continue;
        }
        let response = message.infer_response.expect("a response");
        assert!(
            !finals.contains_key(&response.id),
            "a response after the last one"
        );
        *chunks.entry(response.id.clone()).or_default() += 1;
        texts
            .entry(response.id.clone())
            .or_default()
            .push_str(&output(&response, "text_output"));
        if is_final(&response) {
            finals.insert(response.id.clone(), response);
        }
    }
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert_eq!(errors[0].0, "lost");
    assert!(
        errors[0].1.starts_with("request \"lost\": NOT_FOUND:"),
        "{}",
        errors[0].1
    );
    for (id, _) in prompts {
        assert_eq!(
            texts[id], expected[id],
            "request {id}: deltas add up to the answer"
        );
        assert!(
            chunks[id] >= 6,
            "request {id} came in {} responses",
            chunks[id]
        );
        assert_eq!(output(&finals[id], "finish_reason"), "length");
        assert_eq!(int_param(&finals[id], "completion_tokens"), Some(6));
    }
    assert_eq!(
        chunks["folded"], 1,
        "a non-streaming request gets one response"
    );
    assert_eq!(int_param(&finals["folded"], "completion_tokens"), Some(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_error_has_its_code() {
    // `broken-model`: an engine that answers every generation request with 500.
    let broken_scratch = ScratchDir::new("grpc-errors-broken").expect("scratch dir");
    let broken = start_engines(&broken_scratch, 1, &["--no-delay", "--fail-status", "500"])
        .expect("engine-sim");
    let models = format!(
        "  - name: dead-model\n    policy: round_robin\n    backends:\n      - url: http://127.0.0.1:1\n\
         \x20 - name: broken-model\n    policy: round_robin\n    backends:\n      - url: {}\n\
         limits:\n  retries: 0\n",
        engine_urls(&broken)[0]
    );
    let cluster = Cluster::start("grpc-errors", 1, &[], &models, "policy: round_robin");
    let mut client = cluster.client().await;
    let code = |result: Result<tonic::Response<ModelInferResponse>, tonic::Status>| {
        let status = result.expect_err("an error");
        (status.code(), status.message().to_string())
    };

    let mut unknown = text_request("", "x", 1, false);
    unknown.model_name = "no-such-model".to_string();
    let (c, message) = code(client.model_infer(unknown).await);
    assert_eq!(c, Code::NotFound);
    assert!(
        message.contains("no-such-model") && message.contains(MODEL),
        "{message}"
    );
    let mut version = text_request("", "x", 1, false);
    version.model_version = "7".to_string();
    assert_eq!(code(client.model_infer(version).await).0, Code::NotFound);

    let mut bad_tensor = text_request("", "x", 1, false);
    bad_tensor.inputs[0].datatype = "INT32".to_string();
    let (c, message) = code(client.model_infer(bad_tensor).await);
    assert_eq!(c, Code::InvalidArgument);
    assert!(
        message.contains("text_input") && message.contains("BYTES"),
        "{message}"
    );
    let mut bad_parameter = text_request("", "x", 1, false);
    bad_parameter.parameters.insert(
        "temperature".to_string(),
        InferParameter {
            parameter_choice: Some(ParameterChoice::StringParam("hot".into())),
        },
    );
    let (c, message) = code(client.model_infer(bad_parameter).await);
    assert_eq!(c, Code::InvalidArgument);
    assert!(message.contains("temperature"), "{message}");
    let (c, message) = code(client.model_infer(text_request("", "x", 1, true)).await);
    assert_eq!(c, Code::InvalidArgument);
    assert!(message.contains("ModelStreamInfer"), "{message}");

    let mut dead = text_request("", "x", 1, false);
    dead.model_name = "dead-model".to_string();
    assert_eq!(code(client.model_infer(dead).await).0, Code::Unavailable);

    let mut broken_request = text_request("", "x", 1, false);
    broken_request.model_name = "broken-model".to_string();
    let (c, message) = code(client.model_infer(broken_request).await);
    assert_eq!(c, Code::Internal);
    assert!(
        message.contains("500") && message.contains("simulated failure"),
        "{message}"
    );

    let status = client
        .model_statistics(ModelStatisticsRequest::default())
        .await
        .expect_err("UNIMPLEMENTED");
    assert_eq!(status.code(), Code::Unimplemented);
    assert!(
        status.message().contains("ModelStatistics"),
        "{}",
        status.message()
    );

    let mut oversized = text_request("", &"x".repeat(70_000), 1, false);
    oversized.id = "big".to_string();
    assert_eq!(
        code(client.model_infer(oversized).await).0,
        Code::OutOfRange
    );

    // The simulated engine runs in real time: 2000 tokens take seconds. The deadline goes as
    // `grpc-timeout` from a client that does not time the call itself: the proxy must end it,
    // with its own message. The engine is seen busy with the request before the deadline
    // passes, and idle after: the deadline dropped a request that reached it.
    let mut slow = tonic::Request::new(text_request("", "take your time", 2000, false));
    slow.metadata_mut()
        .insert("grpc-timeout", "1500m".parse().unwrap());
    let started = std::time::Instant::now();
    let mut slow_client = untimed_client(cluster.proxy.addr("grpc"));
    let answer = tokio::spawn(async move { slow_client.model_infer(slow).await });
    await_engine_busy(&cluster.engines()).await;
    let (c, message) = code(answer.await.unwrap());
    assert_eq!(c, Code::DeadlineExceeded, "{message}");
    assert!(message.contains("the deadline passed"), "{message}");
    let elapsed = started.elapsed();
    // Not before the deadline (the proxy's timer may round it by some milliseconds).
    assert!(
        (Duration::from_millis(1400)..Duration::from_secs(4)).contains(&elapsed),
        "ended after {elapsed:?}"
    );
    await_engines_idle(&cluster.engines()).await;

    let metrics = HttpClient::http1()
        .get(&format!("{}/metrics", cluster.proxy.url("admin")))
        .await
        .unwrap();
    let metrics = String::from_utf8_lossy(&metrics.body);
    for line in [
        "kvmesh_requests_total{model=\"sim-model\",protocol=\"grpc\",route=\"model_infer\",status=\"400\"} 3",
        "kvmesh_requests_total{model=\"sim-model\",protocol=\"grpc\",route=\"model_infer\",status=\"404\"} 1",
        "kvmesh_requests_total{model=\"sim-model\",protocol=\"grpc\",route=\"model_infer\",status=\"504\"} 1",
        "kvmesh_requests_total{model=\"\",protocol=\"grpc\",route=\"model_infer\",status=\"404\"} 1",
        "kvmesh_requests_total{model=\"broken-model\",protocol=\"grpc\",route=\"model_infer\",status=\"500\"} 1",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    // Connection refused (502) or, once health checks noticed, no healthy instance (503).
    let dead = "kvmesh_requests_total{model=\"dead-model\",protocol=\"grpc\",route=\"model_infer\",status=\"50";
    assert!(metrics.contains(dead), "{metrics}");
}

/// The deadline the stream-deadline checks give their calls: long enough that the engine is
/// seen busy with the request before it passes.
const STREAM_DEADLINE: Duration = Duration::from_millis(1500);

/// Asserts that the proxy ended a call because its deadline passed (its own message: a
/// client-side timeout would end it as `Cancelled`).
fn assert_proxy_deadline(status: tonic::Status) {
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status.message().contains("the deadline passed"),
        "{status:?}"
    );
}

/// Reads `responses` to their end: the status that ended the stream (it must end with one).
async fn ending_status(responses: &mut Streaming<ModelStreamInferResponse>) -> tonic::Status {
    loop {
        match grpc::next_message(responses).await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without an error"),
            Err(status) => return status,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_stream_releases_the_engine_request() {
    let cluster = Cluster::start("grpc-cancel", 1, &[], "", "policy: round_robin");
    let engines = cluster.engines();
    let mut client = cluster.client().await;
    let (tx, mut responses) = open_stream(&mut client).await;
    tx.send(text_request(
        "long",
        "Tell me a very long story.",
        2000,
        true,
    ))
    .await
    .unwrap();
    for _ in 0..3 {
        let message = grpc::next_message(&mut responses)
            .await
            .unwrap()
            .expect("a chunk");
        assert!(
            message.error_message.is_empty(),
            "{}",
            message.error_message
        );
    }
    await_engine_busy(&engines).await;
    drop(responses);
    drop(tx);
    drop(client);
    await_engines_idle(&engines).await;

    // A stream's deadline ends it and its requests too: the engine is seen busy with the
    // request first, and the proxy ends the stream (tonic's client times a call only up to
    // its response head, which a stream gets at once).
    let mut client = cluster.client().await;
    let (tx, rx) = mpsc::channel(4);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.set_timeout(STREAM_DEADLINE);
    let mut responses = client
        .model_stream_infer(request)
        .await
        .unwrap()
        .into_inner();
    tx.send(text_request("late", "Another long story.", 2000, true))
        .await
        .unwrap();
    await_engine_busy(&engines).await;
    assert_proxy_deadline(ending_status(&mut responses).await);
    await_engines_idle(&engines).await;

    // The same when the client already half-closed its side.
    let (tx, rx) = mpsc::channel(4);
    tx.send(text_request("closed", "A third long story.", 2000, true))
        .await
        .unwrap();
    drop(tx);
    let mut request = tonic::Request::new(ReceiverStream::new(rx));
    request.set_timeout(STREAM_DEADLINE);
    let mut responses = client
        .model_stream_infer(request)
        .await
        .unwrap()
        .into_inner();
    await_engine_busy(&engines).await;
    assert_proxy_deadline(ending_status(&mut responses).await);
    await_engines_idle(&engines).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_aware_routing_on_the_grpc_path() {
    // policy kv, token-id prompts (no tokenizer needed), the engines' block size.
    let cluster = Cluster::start(
        "grpc-kv",
        3,
        &["--no-delay"],
        "",
        "policy: kv\n    kv:\n      block_size: 64",
    );
    let engines = cluster.engines();
    let mut client = cluster.client().await;
    let prefix: Vec<i64> = (1000..1512).collect();
    let mut served_by = Vec::new();
    for turn in 0..6i64 {
        let mut ids = prefix.clone();
        ids.extend((0..64).map(|i| 5000 + turn * 100 + i));
        let answer = client.model_infer(ids_request(&ids, 2)).await.unwrap();
        let instance = answer
            .metadata()
            .get("x-kvmesh-instance")
            .and_then(|v| v.to_str().ok())
            .unwrap()
            .to_string();
        // The route explanation, as on HTTP: after the first turn, the prefix's 8 blocks
        // are found cached on the engine that served it.
        let route = answer
            .metadata()
            .get("x-kvmesh-route")
            .and_then(|v| v.to_str().ok())
            .expect("x-kvmesh-route metadata")
            .to_string();
        assert!(route.contains(&format!("instance={instance}")), "{route}");
        if turn > 0 {
            assert!(route.contains("overlap_blocks=8;"), "{route}");
        }
        served_by.push(instance);
    }
    assert!(
        served_by.iter().all(|i| *i == served_by[0]),
        "a shared prefix should stay on one engine: {served_by:?}"
    );
    let hits = engine_metric(&engines, "vllm:prefix_cache_hits_total").await;
    let chosen = engines.iter().position(|e| *e == served_by[0]).unwrap();
    for (i, hit) in hits.iter().enumerate() {
        if i == chosen {
            assert!(
                *hit >= 5.0 * 512.0,
                "the chosen engine hit {hit} tokens: {hits:?}"
            );
        } else {
            assert_eq!(*hit, 0.0, "{hits:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_and_their_models_apply_to_grpc() {
    // Keys "grpc-test-key" (every model) and "other-key" (dead-model only), by SHA-256.
    let models = "  - name: dead-model\n    policy: round_robin\n    backends:\n      - url: http://127.0.0.1:1\n\
                  auth:\n  keys:\n\
                  \x20   - name: main\n      sha256: a784d4ffcaf1606d080015ee5c00a76a2354a54425c547fa20a98b187fbdf8b3\n\
                  \x20   - name: narrow\n      sha256: 580843d03d2216ff1a275d0991bad66e4d1af871171d929e9de604b7959f9bca\n      models: [dead-model]\n";
    let cluster = Cluster::start(
        "grpc-auth",
        1,
        &["--no-delay"],
        models,
        "policy: round_robin",
    );
    let mut client = cluster.client().await;
    let with_key = |key: Option<&str>| {
        let mut request = tonic::Request::new(text_request("", "hi", 2, false));
        if let Some(key) = key {
            request
                .metadata_mut()
                .insert("authorization", format!("Bearer {key}").parse().unwrap());
        }
        request
    };
    for key in [None, Some("wrong-key")] {
        let status = client.model_infer(with_key(key)).await.expect_err("401");
        assert_eq!(status.code(), Code::Unauthenticated, "{key:?}: {status:?}");
    }
    let status = client
        .model_infer(with_key(Some("other-key")))
        .await
        .expect_err("403");
    assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
    let answer = client
        .model_infer(with_key(Some("grpc-test-key")))
        .await
        .expect("a valid key");
    assert_eq!(int_param(answer.get_ref(), "completion_tokens"), Some(2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_when_a_data_listener_has_it() {
    let scratch = ScratchDir::new("grpc-tls").unwrap();
    let certs = kvmesh_e2e::certs::TestCerts::generate(scratch.path()).unwrap();
    let sims = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let config = proxy_config(&engine_urls(&sims), "").replace(
        "    address: 127.0.0.1:0\nadmin:",
        &format!(
            "    address: 127.0.0.1:0\n    tls:\n      cert: {}\n      key: {}\nadmin:",
            certs.server_cert.display(),
            certs.server_key.display()
        ),
    ) + "grpc:\n  address: 127.0.0.1:0\n";
    let proxy = start_proxy(&scratch, &config).unwrap();
    let ca = std::fs::read_to_string(&certs.ca).unwrap();
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
        .domain_name("localhost");
    let endpoint = Endpoint::from_shared(format!("https://{}", proxy.addr("grpc")))
        .unwrap()
        .tls_config(tls)
        .unwrap();
    let channel = grpc::connect(endpoint).await.expect("a TLS connection");
    let mut client = GrpcInferenceServiceClient::new(channel);
    let response = client
        .model_infer(text_request("tls", "over TLS", 3, false))
        .await
        .expect("ModelInfer over TLS")
        .into_inner();
    assert_eq!(int_param(&response, "completion_tokens"), Some(3));
    // Plaintext HTTP/2 is refused on a TLS listener.
    let plain =
        grpc::connect(Endpoint::from_shared(format!("http://{}", proxy.addr("grpc"))).unwrap())
            .await;
    if let Ok(channel) = plain {
        let mut client = GrpcInferenceServiceClient::new(channel);
        assert!(client.server_live(ServerLiveRequest {}).await.is_err());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_a_killed_engine_continue_on_another() {
    const REQUESTS: usize = 6;
    const MAX_TOKENS: i64 = 300;
    let scratch = ScratchDir::new("grpc-migrate").expect("scratch dir");
    // Real-time decode (~6 ms per token): each stream lasts about two seconds.
    let mut victim = start_engines(&scratch, 1, &[]).expect("engine-sim");
    let survivor = start_engines(&scratch, 1, &[]).expect("engine-sim");
    let urls = [engine_urls(&victim), engine_urls(&survivor)].concat();
    let config = proxy_config(&urls, "") + "grpc:\n  address: 127.0.0.1:0\n";
    let proxy = start_proxy(&scratch, &config).expect("kvmesh-proxy");
    let mut client = GrpcInferenceServiceClient::new(channel(proxy.addr("grpc")).await);
    let (tx, mut responses) = open_stream(&mut client).await;
    for i in 0..REQUESTS {
        let request = text_request(
            &format!("r{i}"),
            &format!("tell story {i}"),
            MAX_TOKENS,
            true,
        );
        tx.send(request).await.unwrap();
    }
    drop(tx);

    let mut pieces: HashMap<String, i64> = HashMap::new();
    let mut finals: HashMap<String, ModelInferResponse> = HashMap::new();
    let mut killed = false;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let next = tokio::time::timeout_at(deadline, responses.message())
            .await
            .expect("the streams end");
        let Some(message) = next.expect("the call goes on") else {
            break;
        };
        assert!(
            message.error_message.is_empty(),
            "{}",
            message.error_message
        );
        let response = message.infer_response.expect("a response");
        assert!(
            !finals.contains_key(&response.id),
            "a response after the last"
        );
        if !output(&response, "text_output").is_empty() {
            *pieces.entry(response.id.clone()).or_default() += 1;
        }
        if is_final(&response) {
            finals.insert(response.id.clone(), response);
        }
        // Every request is running once each has a piece: the victim dies under half.
        if !killed && pieces.len() == REQUESTS {
            victim.kill();
            killed = true;
        }
    }
    assert!(killed);
    assert_eq!(finals.len(), REQUESTS);
    for (id, last) in &finals {
        assert_eq!(pieces[id], MAX_TOKENS, "request {id}: every token once");
        assert_eq!(
            int_param(last, "completion_tokens"),
            Some(MAX_TOKENS),
            "{id}"
        );
        assert_eq!(output(last, "finish_reason"), "length", "{id}");
    }
    // Round robin put half on the victim.
    assert_migrations(&HttpClient::http1(), &proxy, REQUESTS / 2).await;
}
