//! The agent as the pod's inbound sidecar (`--inbound-listen`), in front of an engine-sim
//! decode engine, with a prefill engine beside it (both in process, over real HTTP): plain
//! requests, streams and engine errors pass through unchanged, the instance is registered at
//! the sidecar's address, decode legs are admitted into the pod's KV-transfer budget (a
//! burst larger than the budget all completes, within it), and a dead engine is a 502.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_agent::sidecar::pacer::PacerSettings;
use kvmesh_agent::{AgentConfig, AgentHandle, InboundConfig};
use kvmesh_control::{EventBus, InProcessBus, InProcessRegistry, Namespace, Registry};
use kvmesh_engine_sim::{EngineHandle, KvEventsConfig, KvTransferConfig, Role, SimConfig, spawn};
use serde_json::{Value, json};
use tokio::net::TcpListener;

/// Bytes per token of the default model shape, and the tokens per block.
const BYTES_PER_TOKEN: u64 = 147_456;
const BLOCK: usize = 16;

async fn call(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (StatusCode, Bytes) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let mut request = Request::builder()
        .method(Method::POST)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = client.request(request).await.expect("an answer");
    let status = response.status();
    (
        status,
        response.into_body().collect().await.unwrap().to_bytes(),
    )
}

async fn engine(role: Role) -> EngineHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let config = SimConfig {
        no_delay: true,
        block_size: BLOCK,
        kv_events: KvEventsConfig {
            endpoint: Some("tcp://127.0.0.1:0".into()),
            ..KvEventsConfig::default()
        },
        kv_transfer: KvTransferConfig {
            role,
            ..KvTransferConfig::default()
        },
        ..SimConfig::default()
    };
    spawn(config, listener).await.unwrap()
}

async fn sidecar(
    decode: &EngineHandle,
    registry: &Arc<InProcessRegistry>,
    pacing: PacerSettings,
) -> AgentHandle {
    let events = decode.kv_events_addr().unwrap();
    let mut config = AgentConfig::new(
        &format!("http://{}", decode.local_addr()),
        "sim-model",
        &format!("tcp://{events}"),
    );
    config.block_size = Some(BLOCK);
    config.inbound = Some(InboundConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        kv_bytes_per_token: BYTES_PER_TOKEN,
        pacing: Some(pacing),
        measured_rate: false,
    });
    let registry: Arc<dyn Registry> = registry.clone();
    let bus: Arc<dyn EventBus> = Arc::new(InProcessBus::new());
    kvmesh_agent::start(config, registry, bus).await.unwrap()
}

/// A prefill leg on `prefill` for `prompt`; the decode leg's body.
async fn decode_leg(prefill: SocketAddr, prompt: &[u32]) -> Value {
    let request = json!({"model": "sim-model", "prompt": prompt, "max_tokens": 4});
    let mut leg = request.clone();
    leg["kv_transfer_params"] = json!({"do_remote_decode": true});
    leg["max_tokens"] = json!(1);
    let (status, body) = call(prefill, "/v1/completions", &leg, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let answer: Value = serde_json::from_slice(&body).unwrap();
    let mut decode = request;
    decode["kv_transfer_params"] = answer["kv_transfer_params"].clone();
    decode
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sidecar_forwards_unchanged_and_paces_decode_legs_within_the_budget() {
    let prefill = engine(Role::Prefill).await;
    let decode = engine(Role::Decode).await;
    let registry = Arc::new(InProcessRegistry::new());
    // Room for two 8-block transfers at once.
    let transfer = 8 * BLOCK as u64 * BYTES_PER_TOKEN;
    let pacing = PacerSettings {
        max_in_flight_bytes: 2 * transfer,
        rate_bytes_per_sec: 1e12,
        max_wait: Duration::from_millis(250),
        // Held until the first token: at this rate the link bound would end them at once.
        hold_factor: 0.0,
    };
    let agent = sidecar(&decode, &registry, pacing).await;
    let inbound = agent.inbound_addr().expect("the sidecar listens");

    // Registered at the sidecar's address, not the engine's.
    let records = registry
        .list(&Namespace::default().instances_prefix())
        .await
        .unwrap();
    assert_eq!(records.records.len(), 1);
    assert_eq!(records.records[0].1.url, format!("http://{inbound}"));

    // Plain requests and streams pass through as the engine answers them.
    let plain = json!({"model": "sim-model", "prompt": [1, 2, 3], "max_tokens": 3});
    let (status, body) = call(inbound, "/v1/completions", &plain, &[]).await;
    assert_eq!(status, StatusCode::OK);
    let answer: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    let mut streamed = plain.clone();
    streamed["stream"] = json!(true);
    let (status, body) = call(inbound, "/v1/completions", &streamed, &[]).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.ends_with(b"data: [DONE]\n\n"), "{body:?}");
    let (status, body) = call(
        inbound,
        "/v1/completions",
        &plain,
        &[("x-sim-status", "503")],
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(String::from_utf8_lossy(&body).contains("simulated error"));

    // A burst of six decode legs (8 blocks each): all complete through a budget of two.
    let mut legs = Vec::new();
    for n in 0..6u32 {
        let prompt: Vec<u32> = (0..(8 * BLOCK as u32 + 5)).map(|t| t + n * 1000).collect();
        legs.push(decode_leg(prefill.local_addr(), &prompt).await);
    }
    let mut burst = tokio::task::JoinSet::new();
    for leg in legs {
        burst.spawn(async move { call(inbound, "/v1/completions", &leg, &[]).await });
    }
    while let Some(answer) = burst.join_next().await {
        let (status, body) = answer.unwrap();
        assert_eq!(status, StatusCode::OK, "{body:?}");
        let answer: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(answer["usage"]["completion_tokens"], 4);
    }
    let metrics = agent.metrics().render();
    assert_eq!(
        metric(&metrics, "kvmesh_agent_kv_transfers_admitted_total"),
        6.0
    );
    assert_eq!(
        metric(&metrics, "kvmesh_agent_kv_transfer_bytes_in_flight"),
        0.0
    );
    assert_eq!(metric(&metrics, "kvmesh_agent_kv_transfers_queued"), 0.0);
    assert_eq!(
        metric(&metrics, "kvmesh_agent_kv_transfer_wait_seconds_count"),
        6.0
    );
    // The decode engine pulled every leg's blocks (none fell back to a local prefill).
    let (_, text) = {
        let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
        let uri = format!("http://{}/metrics", decode.local_addr());
        let response = client.get(uri.parse().unwrap()).await.unwrap();
        ((), response.into_body().collect().await.unwrap().to_bytes())
    };
    let text = String::from_utf8_lossy(&text);
    assert!(
        text.lines()
            .any(|l| l.starts_with("kvmesh_sim_kv_transfers_total{")
                && l.contains("\"ok\"")
                && l.ends_with(" 6")),
        "{text}"
    );

    // The engine gone: the sidecar answers 502 itself.
    decode.stop().await;
    let (status, body) = call(inbound, "/v1/completions", &plain, &[]).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let error: Value = serde_json::from_slice(&body).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("engine")
    );
    assert!(
        metric(
            &agent.metrics().render(),
            "kvmesh_agent_inbound_requests_total"
        ) >= 10.0
    );
    agent.shutdown().await;
}
