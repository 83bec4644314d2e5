//! engine-sim's data-parallel ranks held to vLLM's contract, as a running real vLLM 0.32.0
//! (CPU, `--data-parallel-size 2` behind one API server) showed it:
//! `engine-events/tests/fixtures/capture_live_vllm_dp.py` sent a script of requests with and
//! without `X-data-parallel-rank` and recorded every status, error body, streamed refusal,
//! `cached_tokens` and the rank that ran each request (`vllm:request_success_total{engine}`),
//! and the first batch each rank published. Here engine-sim with two ranks gets the same
//! requests and must answer the same: the header honoured, out-of-range ranks refused in
//! vLLM's words, unreadable headers ignored, the Responses API deaf to the header, the DP load
//! balancer's choices where no rank is named, separate prefix caches per rank; and rank `r`
//! publishing on the configured port plus `r`, its batches carrying `r`, with the same event
//! layout as vLLM's rank 1.

use std::collections::BTreeMap;
use std::net::{SocketAddr, TcpListener as StdListener};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvmesh_engine_sim::{EngineHandle, KvEventsConfig, SimConfig};
use rmpv::Value as Msgpack;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// What real vLLM answered (see the module doc).
const RECORD: &str = include_str!("../../engine-events/tests/fixtures/vllm-0.32.0-live-dp.json");
/// The payload frame real vLLM's rank 1 published for the record's first request.
const VLLM_RANK1_BATCH: &[u8] =
    include_bytes!("../../engine-events/tests/fixtures/vllm-0.32.0-live-dp-rank1.msgpack");
/// `scripts/vllm.sh serve`'s topic.
const TOPIC: &str = "kv-events";
const WAIT: Duration = Duration::from_secs(5);

fn record() -> Value {
    serde_json::from_str(RECORD).expect("the record is JSON")
}

/// engine-sim as the record's vLLM ran: two ranks, 32-token blocks, cached-token details,
/// model `qwen3`, KV events on `events` (and replay on `replay`) when given.
fn config(events: Option<(u16, u16)>) -> SimConfig {
    let record = record();
    SimConfig {
        model: "qwen3".to_owned(),
        block_size: record["block_size"].as_u64().expect("block_size") as usize,
        dp_ranks: record["data_parallel_size"].as_u64().expect("size") as usize,
        prompt_tokens_details: true,
        max_model_len: 4096,
        no_delay: true,
        kv_events: KvEventsConfig {
            endpoint: events.map(|(port, _)| format!("tcp://127.0.0.1:{port}")),
            replay_endpoint: events.map(|(_, port)| format!("tcp://127.0.0.1:{port}")),
            topic: TOPIC.to_owned(),
            ..KvEventsConfig::default()
        },
        ..SimConfig::default()
    }
}

async fn engine(config: SimConfig) -> EngineHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    kvmesh_engine_sim::spawn(config, listener)
        .await
        .expect("spawn")
}

/// An engine whose KV event and replay sockets sit at fixed ports (so rank 1's are at the
/// port plus 1): pairs of consecutive ports found free, retried if taken meanwhile.
async fn engine_at_fixed_ports() -> (EngineHandle, u16, u16) {
    for _ in 0..20 {
        let (Some(events), Some(replay)) = (free_pair(), free_pair()) else {
            continue;
        };
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        if let Ok(engine) = kvmesh_engine_sim::spawn(config(Some((events, replay))), listener).await
        {
            return (engine, events, replay);
        }
    }
    panic!("no two free pairs of consecutive ports");
}

/// A port `p` with `p + 1` free too (both released again).
fn free_pair() -> Option<u16> {
    let first = StdListener::bind("127.0.0.1:0").ok()?;
    let port = first.local_addr().ok()?.port();
    let _second = StdListener::bind(("127.0.0.1", port.checked_add(1)?)).ok()?;
    Some(port)
}

/// Sends `body` to `path`, with `X-data-parallel-rank: rank` when given.
async fn post(
    addr: SocketAddr,
    path: &str,
    body: &Value,
    rank: Option<&str>,
) -> (StatusCode, Bytes) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let mut req = Request::post(path)
        .header("host", "sim")
        .header("content-type", "application/json");
    if let Some(rank) = rank {
        req = req.header("X-data-parallel-rank", rank);
    }
    let req = req
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    let status = res.status();
    (
        status,
        res.into_body().collect().await.expect("body").to_bytes(),
    )
}

async fn get(addr: SocketAddr, path: &str) -> String {
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
    let body = res.into_body().collect().await.expect("body").to_bytes();
    String::from_utf8_lossy(&body).into_owned()
}

/// Finished requests per `engine` label (`vllm:request_success_total`, every reason).
async fn successes(addr: SocketAddr) -> BTreeMap<u64, f64> {
    let mut counts = BTreeMap::new();
    for line in get(addr, "/metrics").await.lines() {
        let Some(rest) = line.strip_prefix("vllm:request_success_total{") else {
            continue;
        };
        let rank = rest
            .split_once("engine=\"")
            .and_then(|(_, r)| r.split_once('"'))
            .and_then(|(r, _)| r.parse().ok())
            .expect("an engine label");
        let value: f64 = line
            .rsplit_once(' ')
            .and_then(|(_, v)| v.parse().ok())
            .expect("a value");
        *counts.entry(rank).or_default() += value;
    }
    counts
}

#[tokio::test]
async fn engine_sim_answers_the_rank_header_as_real_vllm_did() {
    let record = record();
    let engine = engine(config(None)).await;
    let addr = engine.local_addr();
    let steps = record["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), 15);
    for (i, step) in steps.iter().enumerate() {
        let mut body = step["body"].clone();
        if let Some(prompt) = step["prompt"].as_str() {
            body["prompt"] = record["prompts"][prompt].clone();
        }
        let header = step["header"].as_str();
        let before = successes(addr).await;
        let (status, answer) =
            post(addr, step["path"].as_str().expect("path"), &body, header).await;
        let after = successes(addr).await;
        let ran_on: Vec<u64> = after
            .iter()
            .filter(|(rank, n)| **n > before.get(rank).copied().unwrap_or(0.0))
            .map(|(rank, _)| *rank)
            .collect();
        let what = format!("step {i}: {} with rank header {header:?}", step["path"]);
        assert_eq!(u64::from(status.as_u16()), step["status"], "{what}");
        assert_eq!(
            json!(ran_on),
            step["ran_on"],
            "{what}: the rank that ran it"
        );
        if let Some(error) = step.get("error") {
            let answer: Value = serde_json::from_slice(&answer).expect("a JSON error");
            assert_eq!(&answer, error, "{what}");
        }
        if let Some(stream) = step.get("stream_body") {
            assert_eq!(
                String::from_utf8_lossy(&answer),
                stream.as_str().expect("text"),
                "{what}"
            );
        }
        if let Some(cached) = step.get("cached_tokens") {
            let answer: Value = serde_json::from_slice(&answer).expect("a JSON answer");
            assert_eq!(
                &answer["usage"]["prompt_tokens_details"]["cached_tokens"], cached,
                "{what}: each rank has its own prefix cache"
            );
        }
    }
    // The record covers every case: honoured, refused (400 and streamed), ignored, balanced.
    let statuses: Vec<u64> = steps.iter().filter_map(|s| s["status"].as_u64()).collect();
    assert!(statuses.contains(&400) && steps.iter().any(|s| s.get("stream_body").is_some()));
    assert!(steps.iter().any(|s| s["header"].is_null()));
}

/// A SUB socket on one rank's PUB endpoint.
struct Subscriber {
    socket: SubSocket,
}

impl Subscriber {
    async fn connect(port: u16) -> Self {
        let mut socket = SubSocket::new();
        socket
            .connect(&format!("tcp://127.0.0.1:{port}"))
            .await
            .expect("connect SUB");
        socket.subscribe(TOPIC).await.expect("subscribe");
        Self { socket }
    }

    /// The next message within `wait`: `(topic, seq, payload)`.
    async fn next_within(&mut self, wait: Duration) -> Option<(Bytes, u64, Bytes)> {
        let msg = timeout(wait, self.socket.recv())
            .await
            .ok()?
            .expect("message");
        let frames = msg.into_vec();
        assert_eq!(frames.len(), 3, "[topic, seq, payload]");
        let seq = u64::from_be_bytes(frames[1].as_ref().try_into().expect("8-byte seq"));
        Some((frames[0].clone(), seq, frames[2].clone()))
    }

    async fn next(&mut self) -> (Bytes, u64, Bytes) {
        self.next_within(WAIT).await.expect("a batch in time")
    }
}

/// Subscribes to both ranks and waits until both subscriptions are in effect (ZMQ drops what
/// is published before): `POST /reset_prefix_cache` clears every rank, each publishing an
/// `AllBlocksCleared` batch, until each socket has seen one; then drains to the latest.
async fn subscribe_both(engine: &EngineHandle, port: u16) -> [Subscriber; 2] {
    let mut subs = [
        Subscriber::connect(port).await,
        Subscriber::connect(port + 1).await,
    ];
    let mut joined = [false; 2];
    for _ in 0..100 {
        let (status, _) = post(engine.local_addr(), "/reset_prefix_cache", &json!({}), None).await;
        assert_eq!(status, StatusCode::OK);
        for (sub, joined) in subs.iter_mut().zip(&mut joined) {
            while let Some((_, _, payload)) = sub.next_within(Duration::from_millis(100)).await {
                assert_eq!(event_types(&payload), ["AllBlocksCleared"]);
                *joined = true;
            }
        }
        if joined == [true, true] {
            return subs;
        }
    }
    panic!("the subscriptions never took effect");
}

fn decode(payload: &[u8]) -> Vec<Msgpack> {
    let mut slice = payload;
    let value = rmpv::decode::read_value(&mut slice).expect("msgpack batch");
    assert!(slice.is_empty(), "trailing bytes after the batch");
    value
        .as_array()
        .expect("[ts, events, data_parallel_rank]")
        .clone()
}

fn event_types(payload: &[u8]) -> Vec<String> {
    decode(payload)[1]
        .as_array()
        .expect("events")
        .iter()
        .map(|e| field(e, "type").as_str().expect("type").to_owned())
        .collect()
}

fn field<'a>(event: &'a Msgpack, key: &str) -> &'a Msgpack {
    event
        .as_map()
        .expect("events are maps")
        .iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {event}"))
}

fn keys(event: &Msgpack) -> Vec<&str> {
    event
        .as_map()
        .expect("events are maps")
        .iter()
        .map(|(k, _)| k.as_str().expect("string keys"))
        .collect()
}

#[tokio::test]
async fn each_rank_publishes_on_the_port_plus_its_rank_with_its_rank_in_the_batch() {
    let record = record();
    let (engine, events_port, replay_port) = engine_at_fixed_ports().await;
    for rank in 0..2 {
        let offset = u16::try_from(rank).expect("small");
        assert_eq!(
            engine.rank_kv_events_addr(rank).map(|a| a.port()),
            Some(events_port + offset)
        );
        assert_eq!(
            engine.rank_kv_replay_addr(rank).map(|a| a.port()),
            Some(replay_port + offset)
        );
    }
    // What vLLM's ranks sent first (the script's first request ran on rank 1, its third on 0).
    let batches = record["batches"].as_array().expect("batches");
    for (rank, batch) in batches.iter().enumerate() {
        assert_eq!(batch["port_offset"], json!(rank));
        assert_eq!(batch["data_parallel_rank"], json!(rank));
        assert_eq!(batch["topic"], TOPIC);
        assert_eq!(batch["types"], json!(["BlockStored"]));
    }
    let mut subs = subscribe_both(&engine, events_port).await;

    // The record's first request, on rank 1.
    let first = &record["steps"][0];
    assert_eq!(first["header"], "1");
    let mut body = first["body"].clone();
    body["prompt"] = record["prompts"]["shared"].clone();
    let addr = engine.local_addr();
    let (status, _) = post(addr, "/v1/completions", &body, Some("1")).await;
    assert_eq!(status, StatusCode::OK);
    let (topic, _, sim) = subs[1].next().await;
    assert_eq!(topic, TOPIC.as_bytes());
    let (sim, real) = (decode(&sim), decode(VLLM_RANK1_BATCH));
    assert_eq!((sim.len(), real.len()), (3, 3));
    assert_eq!(real[2].as_u64(), Some(1), "vLLM's rank 1 writes its rank");
    assert_eq!(sim[2].as_u64(), Some(1), "so does engine-sim's");
    let (sim_events, real_events) = (
        sim[1].as_array().expect("events"),
        real[1].as_array().expect("events"),
    );
    assert_eq!(sim_events.len(), real_events.len());
    for (s, r) in sim_events.iter().zip(real_events) {
        assert_eq!(keys(s), keys(r), "the same fields in the same order");
        // The same prompt cut into the same blocks; the hashes differ by design (the
        // simulator's engine hash is its own, see kvmesh_engine_sim::hashing).
        for key in [
            "type",
            "token_ids",
            "block_size",
            "parent_block_hash",
            "medium",
        ] {
            assert_eq!(field(s, key), field(r, key), "{key}");
        }
        let count = |e: &Msgpack| field(e, "block_hashes").as_array().map(Vec::len);
        assert_eq!(count(s), count(r));
    }

    // Rank 0 published none of it: its next batch is the same prompt's, run there.
    let (status, _) = post(addr, "/v1/completions", &body, Some("0")).await;
    assert_eq!(status, StatusCode::OK);
    let (_, _, rank0) = subs[0].next().await;
    let rank0 = decode(&rank0);
    assert_eq!(rank0[2].as_u64(), Some(0));
    let stored = &rank0[1].as_array().expect("events")[0];
    assert_eq!(
        field(stored, "token_ids"),
        field(&real_events[0], "token_ids")
    );

    // Rank 1's replay socket, at the replay port plus 1, has its batches, rank 1 in each.
    let mut dealer = DealerSocket::new();
    dealer
        .connect(&format!("tcp://127.0.0.1:{}", replay_port + 1))
        .await
        .expect("connect DEALER");
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&0u64.to_be_bytes()));
    dealer.send(request).await.expect("replay request");
    let mut stores = 0;
    loop {
        let frames = timeout(WAIT, dealer.recv())
            .await
            .expect("a replay reply in time")
            .expect("message")
            .into_vec();
        assert_eq!(frames.len(), 4, "[empty, topic, seq, payload]");
        if frames[3].is_empty() {
            break;
        }
        let batch = decode(&frames[3]);
        assert_eq!(batch[2].as_u64(), Some(1), "a rank-1 batch");
        stores += usize::from(event_types(&frames[3]) == ["BlockStored"]);
    }
    assert_eq!(stores, 1, "rank 1 stored once");
}

/// The value of the series `name{engine="<rank>",...}` in `/metrics`.
async fn rank_metric(addr: SocketAddr, name: &str, rank: u64) -> f64 {
    let prefix = format!("{name}{{engine=\"{rank}\",");
    get(addr, "/metrics")
        .await
        .lines()
        .find(|line| line.starts_with(&prefix))
        .and_then(|line| line.rsplit_once(' '))
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or_else(|| panic!("no {prefix}"))
}

#[tokio::test]
async fn the_balancer_avoids_a_busy_rank_and_places_each_choice() {
    let engine = engine(SimConfig {
        no_delay: false,
        ..config(None)
    })
    .await;
    let addr = engine.local_addr();
    let short = |i: u32| json!({"model": "qwen3", "prompt": [100 + i, 200, 300], "max_tokens": 1});
    // A long request on rank 1, running.
    let long =
        json!({"model": "qwen3", "prompt": [1, 2, 3], "max_tokens": 150, "ignore_eos": true});
    let running =
        tokio::spawn(async move { post(addr, "/v1/completions", &long, Some("1")).await });
    let deadline = tokio::time::Instant::now() + WAIT;
    while rank_metric(addr, "vllm:num_requests_running", 1).await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the long request never ran"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Two short ones without a rank, one after the other: the first scan starts at rank 0,
    // the second at rank 1, which is busy: both run on rank 0.
    for i in 0..2 {
        let before = successes(addr).await;
        let (status, _) = post(addr, "/v1/completions", &short(i), None).await;
        assert_eq!(status, StatusCode::OK);
        let after = successes(addr).await;
        assert_eq!(
            after[&0],
            before[&0] + 1.0,
            "request {i} ran on the idle rank"
        );
    }
    assert_eq!(rank_metric(addr, "vllm:num_requests_running", 1).await, 1.0);
    let (status, _) = running.await.expect("the long request");
    assert_eq!(status, StatusCode::OK);

    // Both ranks idle: `n: 2` places each choice, as vLLM places each child request.
    let before = successes(addr).await;
    let two = json!({"model": "qwen3", "prompt": [7, 8, 9], "max_tokens": 1, "n": 2});
    let (status, _) = post(addr, "/v1/completions", &two, None).await;
    assert_eq!(status, StatusCode::OK);
    let after = successes(addr).await;
    assert_eq!(
        (after[&0] - before[&0], after[&1] - before[&1]),
        (1.0, 1.0),
        "one choice per rank"
    );
}
