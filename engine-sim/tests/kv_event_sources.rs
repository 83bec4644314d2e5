//! engine-sim's `GET /kv_event_sources` held to vLLM 0.32.0's: the answer vLLM's own route
//! rendered for two data-parallel ranks publishing at `tcp://*:5557` and replaying at
//! `tcp://*:5567` (`engine-events/tests/fixtures/render_vllm_kv_event_sources.py`, run with
//! vLLM's own `ZmqEventPublisher` and route) must be what engine-sim answers configured the
//! same way, but for the ports; and a rank's endpoint must be where that rank's PUB socket
//! listens, a free port included.

use std::net::{SocketAddr, TcpListener as StdListener};

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvmesh_engine_sim::{EngineHandle, KvEventsConfig, SimConfig};
use serde_json::Value;
use tokio::net::{TcpListener, TcpStream};

/// What vLLM 0.32.0 answered (see the module doc).
const VLLM: &str =
    include_str!("../../engine-events/tests/fixtures/vllm-0.32.0-kv-event-sources.json");
/// The ports and topic vLLM was rendered with.
const VLLM_EVENTS_PORT: u16 = 5557;
const VLLM_REPLAY_PORT: u16 = 5567;
const TOPIC: &str = "kv-events";

fn config(events: Option<&str>, replay: Option<&str>) -> SimConfig {
    SimConfig {
        model: "qwen3".to_owned(),
        dp_ranks: 2,
        no_delay: true,
        kv_events: KvEventsConfig {
            endpoint: events.map(str::to_owned),
            replay_endpoint: replay.map(str::to_owned),
            topic: TOPIC.to_owned(),
            ..KvEventsConfig::default()
        },
        ..SimConfig::default()
    }
}

async fn spawn(config: SimConfig) -> Option<EngineHandle> {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    kvmesh_engine_sim::spawn(config, listener).await.ok()
}

/// A port `p` with `p + 1` free too (both released again).
fn free_pair() -> Option<u16> {
    let first = StdListener::bind("127.0.0.1:0").ok()?;
    let port = first.local_addr().ok()?.port();
    let _second = StdListener::bind(("127.0.0.1", port.checked_add(1)?)).ok()?;
    Some(port)
}

async fn get(addr: SocketAddr, path: &str) -> (StatusCode, String, Value) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::get(path)
        .header("host", "sim")
        .body(Full::new(Bytes::new()))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    let status = res.status();
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = res.into_body().collect().await.expect("body").to_bytes();
    let json = serde_json::from_slice(&body).expect("a JSON answer");
    (status, content_type, json)
}

/// vLLM's answer with its ports moved to `events` and `replay` (rank r at the port plus r).
fn vllm_at(events: u16, replay: u16) -> Value {
    let mut answer: Value = serde_json::from_str(VLLM).expect("the fixture is JSON");
    let ranks = answer.as_object_mut().expect("an object keyed by rank");
    for (rank, config) in ranks.iter_mut() {
        let rank: u16 = rank.parse().expect("ranks are numbers");
        for (field, vllm_port, port) in [
            ("endpoint", VLLM_EVENTS_PORT, events),
            ("replay_endpoint", VLLM_REPLAY_PORT, replay),
        ] {
            assert_eq!(
                config[field],
                format!("tcp://*:{}", vllm_port + rank),
                "vLLM offsets each rank's port"
            );
            config[field] = Value::from(format!("tcp://*:{}", port + rank));
        }
    }
    answer
}

#[tokio::test]
async fn the_answer_is_vllms_for_the_same_publishers() {
    let mut found = None;
    for _ in 0..20 {
        let (Some(events), Some(replay)) = (free_pair(), free_pair()) else {
            continue;
        };
        let config = config(
            Some(&format!("tcp://*:{events}")),
            Some(&format!("tcp://*:{replay}")),
        );
        if let Some(engine) = spawn(config).await {
            found = Some((engine, events, replay));
            break;
        }
    }
    let (engine, events, replay) = found.expect("two free pairs of consecutive ports");
    let (status, content_type, answer) = get(engine.local_addr(), "/kv_event_sources").await;
    assert_eq!(
        (status, content_type.as_str()),
        (StatusCode::OK, "application/json")
    );
    assert_eq!(answer, vllm_at(events, replay));
}

#[tokio::test]
async fn free_ports_are_reported_where_each_rank_publishes() {
    let engine = spawn(config(Some("tcp://127.0.0.1:0"), None))
        .await
        .expect("spawn");
    let (_, _, answer) = get(engine.local_addr(), "/kv_event_sources").await;
    for rank in 0..2 {
        let endpoint = answer[rank.to_string()]["endpoint"]
            .as_str()
            .expect("an endpoint");
        let addr = engine.rank_kv_events_addr(rank).expect("publishing");
        assert_eq!(endpoint, format!("tcp://{addr}"));
        assert_eq!(answer[rank.to_string()]["replay_endpoint"], Value::Null);
    }
    let silent = spawn(config(None, None)).await.expect("spawn");
    let (status, _, answer) = get(silent.local_addr(), "/kv_event_sources").await;
    assert_eq!(
        (status, answer),
        (StatusCode::OK, serde_json::json!({})),
        "no publisher: vLLM's {{}}"
    );
}
