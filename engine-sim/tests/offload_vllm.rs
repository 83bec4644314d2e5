//! engine-sim's host-memory tier (`--offload-blocks`) held to real vLLM 0.32.0 with its
//! OffloadingConnector (CPU spec, one block per chunk), as
//! `engine-events/tests/fixtures/capture_offload_vllm.py` recorded it: 48 device blocks of 32
//! tokens, 96 host blocks, every ZMQ message of the KV event stream
//! (`vllm-0.32.0-offload-{ph,sd}-bpc1.stream`: per message its three frames, each a 4-byte
//! big-endian length then the bytes) in both event forms (`ph`: placeholder, vLLM's default;
//! `sd`: `self_describing_kv_events`), and per step the request's `cached_tokens`
//! (`vllm-0.32.0-offload.json`). The scenario: prompt A (531 tokens), A again (a device hit),
//! 6 fillers that push A off the device, A (loaded from host memory), 12 fillers that push it
//! out of host memory too, A (a miss).
//!
//! engine-sim, configured alike, runs the same scenario (A's token ids from the record;
//! fillers of its own with as many full blocks as vLLM's had) and must report the same
//! `cached_tokens` at every step, offload and evict as many blocks at every step, and write
//! its host-tier events with vLLM's fields in vLLM's order, with the same value types,
//! `medium: "CPU"` and sizes. The hashes differ by design (see `kvmesh_engine_sim::hashing`);
//! on both streams every host-tier hash is a device hash announced before, and a
//! self-describing event's parent and tokens are that block's.
//!
//! Two differences are by design and not compared: vLLM announces a request's host stores one
//! step after its device stores (when the copy completes) and in no particular order; the
//! simulator announces them in the same batch, after the device events, in prefix order.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvmesh_engine_sim::{EngineHandle, KvEventsConfig, OffloadConfig, OffloadEvents, SimConfig};
use rmpv::Value as Msgpack;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use zeromq::{Socket, SocketRecv, SubSocket};

const RECORD: &str = include_str!("../../engine-events/tests/fixtures/vllm-0.32.0-offload.json");
const PLACEHOLDER_STREAM: &[u8] =
    include_bytes!("../../engine-events/tests/fixtures/vllm-0.32.0-offload-ph-bpc1.stream");
const SELF_DESCRIBING_STREAM: &[u8] =
    include_bytes!("../../engine-events/tests/fixtures/vllm-0.32.0-offload-sd-bpc1.stream");
/// The capture's engine: `scripts/vllm.sh serve --blocks 48`.
const GPU_BLOCKS: usize = 48;
const TOPIC: &str = "kv-events";
const WAIT: Duration = Duration::from_secs(5);

fn record() -> Value {
    serde_json::from_str(RECORD).expect("the record is JSON")
}

/// The messages of a recorded stream: `(topic, seq, payload)`.
fn read_stream(mut bytes: &[u8]) -> Vec<(Vec<u8>, u64, Vec<u8>)> {
    let mut frames = Vec::new();
    while !bytes.is_empty() {
        let (len, rest) = bytes.split_at(4);
        let len = u32::from_be_bytes(len.try_into().expect("4 bytes")) as usize;
        let (frame, rest) = rest.split_at(len);
        frames.push(frame.to_vec());
        bytes = rest;
    }
    assert_eq!(frames.len() % 3, 0, "three frames per message");
    frames
        .chunks(3)
        .map(|m| {
            let seq = u64::from_be_bytes(m[1].as_slice().try_into().expect("8-byte seq"));
            (m[0].clone(), seq, m[2].clone())
        })
        .collect()
}

/// The events of a msgpack batch `[ts, events, dp_rank]`.
fn events(payload: &[u8]) -> Vec<Msgpack> {
    let mut slice = payload;
    let batch = rmpv::decode::read_value(&mut slice).expect("msgpack batch");
    assert!(slice.is_empty(), "trailing bytes after the batch");
    let batch = batch.as_array().expect("[ts, events, dp_rank]");
    assert_eq!(batch.len(), 3);
    assert_eq!(batch[2].as_u64(), Some(0));
    batch[1].as_array().expect("events").clone()
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

fn medium(event: &Msgpack) -> &str {
    field(event, "medium").as_str().expect("medium")
}

fn kind(event: &Msgpack) -> &str {
    field(event, "type").as_str().expect("type")
}

fn hashes(event: &Msgpack) -> Vec<u64> {
    field(event, "block_hashes")
        .as_array()
        .expect("block_hashes")
        .iter()
        .map(|h| h.as_u64().expect("int hashes"))
        .collect()
}

fn is_host(event: &Msgpack) -> bool {
    kind(event) != "AllBlocksCleared" && medium(event) == "CPU"
}

/// What a host-tier event must agree on between vLLM and engine-sim: its keys in order, each
/// value's msgpack type, and the values that do not depend on the prompt or the hash function
/// (type, medium, group, spec kind, block size, the number of hashes and tokens).
fn shape(event: &Msgpack) -> String {
    let entries = event.as_map().expect("events are maps");
    let mut out = Vec::new();
    for (key, value) in entries {
        let key = key.as_str().expect("string keys");
        let described = match (key, value) {
            ("type" | "medium" | "kv_cache_spec_kind", v) => format!("{v}"),
            ("group_idx" | "block_size", v) => format!("{v}"),
            (_, Msgpack::Array(items)) => format!("array[{}]", items.len()),
            (_, Msgpack::Nil) => "nil".to_owned(),
            (_, Msgpack::Integer(_)) => "int".to_owned(),
            (_, Msgpack::String(_)) => "str".to_owned(),
            (_, other) => panic!("unexpected {key}: {other}"),
        };
        out.push(format!("{key}={described}"));
    }
    out.join(" ")
}

/// Per host-tier hash seen so far: the device's parent and tokens of that block.
#[derive(Default)]
struct Stream {
    device: HashMap<u64, (Option<u64>, Vec<Msgpack>)>,
    host: BTreeSet<u64>,
    shapes: BTreeSet<String>,
    stored: usize,
    removed: usize,
}

impl Stream {
    /// Applies one batch; returns the host tier's (stored, removed) block counts in it. Checks
    /// that every host hash is a device hash announced before (its parent and tokens those of
    /// the device's block when the event has them) and every host removal a held block.
    fn apply(&mut self, events: &[Msgpack]) -> (usize, usize) {
        let (mut stored, mut removed) = (0, 0);
        for event in events {
            match (kind(event), is_host(event)) {
                ("BlockStored", false) => {
                    let tokens = field(event, "token_ids").as_array().expect("tokens");
                    let size = tokens.len() / hashes(event).len();
                    let mut parent = field(event, "parent_block_hash").as_u64();
                    for (i, h) in hashes(event).into_iter().enumerate() {
                        let block = tokens[i * size..(i + 1) * size].to_vec();
                        self.device.insert(h, (parent, block));
                        parent = Some(h);
                    }
                }
                ("BlockStored", true) => {
                    let [h] = hashes(event)[..] else {
                        panic!("one block per host store: {event}")
                    };
                    let (parent, tokens) = self
                        .device
                        .get(&h)
                        .unwrap_or_else(|| panic!("host hash {h} was never stored on the device"));
                    if field(event, "block_size").as_u64() != Some(0) {
                        assert_eq!(field(event, "parent_block_hash").as_u64(), *parent);
                        assert_eq!(field(event, "token_ids").as_array(), Some(tokens));
                    }
                    assert!(self.host.insert(h), "{h} stored on the host twice");
                    stored += 1;
                    self.shapes.insert(shape(event));
                }
                ("BlockRemoved", true) => {
                    for h in hashes(event) {
                        assert!(self.host.remove(&h), "{h} removed but not held");
                        removed += 1;
                    }
                    self.shapes.insert(shape(event));
                }
                _ => {}
            }
        }
        self.stored += stored;
        self.removed += removed;
        (stored, removed)
    }
}

async fn post(addr: SocketAddr, path: &str, body: &Value) -> (StatusCode, Value) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::post(path)
        .header("host", "sim")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let res = sender.send_request(req).await.expect("response");
    let status = res.status();
    let body = res.into_body().collect().await.expect("body").to_bytes();
    (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

/// engine-sim as the capture's vLLM ran, with the host tier in `form`.
async fn engine(form: OffloadEvents) -> EngineHandle {
    let record = record();
    let config = SimConfig {
        block_size: record["block_size"].as_u64().expect("block_size") as usize,
        num_gpu_blocks: GPU_BLOCKS,
        offload: OffloadConfig {
            blocks: record["cpu_blocks"].as_u64().expect("cpu_blocks") as usize,
            events: form,
            ..OffloadConfig::default()
        },
        prompt_tokens_details: true,
        no_delay: true,
        kv_events: KvEventsConfig {
            endpoint: Some("tcp://127.0.0.1:0".to_owned()),
            topic: TOPIC.to_owned(),
            ..KvEventsConfig::default()
        },
        ..SimConfig::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    kvmesh_engine_sim::spawn(config, listener)
        .await
        .expect("spawn")
}

/// A SUB socket on the engine's PUB endpoint, in effect: prefix-cache resets publish
/// `AllBlocksCleared` batches until one arrives (ZMQ drops what is published before).
async fn subscribe(engine: &EngineHandle) -> (SubSocket, u64) {
    let addr = engine.kv_events_addr().expect("events on");
    let mut sub = SubSocket::new();
    sub.connect(&format!("tcp://{addr}"))
        .await
        .expect("connect SUB");
    sub.subscribe(TOPIC).await.expect("subscribe");
    for _ in 0..100 {
        let (status, _) = post(engine.local_addr(), "/reset_prefix_cache", &json!({})).await;
        assert_eq!(status, StatusCode::OK);
        let mut last = None;
        while let Ok(Ok(msg)) = timeout(Duration::from_millis(100), sub.recv()).await {
            let frames = msg.into_vec();
            let seq = u64::from_be_bytes(frames[1].as_ref().try_into().expect("8-byte seq"));
            let events = events(&frames[2]);
            assert_eq!(events.len(), 1);
            assert_eq!(kind(&events[0]), "AllBlocksCleared");
            last = Some(seq);
        }
        if let Some(seq) = last {
            return (sub, seq + 1);
        }
    }
    panic!("the subscription never took effect");
}

/// Filler `n` with `blocks` full blocks and a partial one, sharing no block with A or
/// another filler.
fn filler(n: u32, blocks: usize, block_size: usize) -> Vec<u32> {
    (0..(blocks * block_size + 12) as u32)
        .map(|i| 100_000 * (n + 1) + i)
        .collect()
}

/// Runs the recorded scenario through engine-sim with the host tier in `form` and holds it
/// to the recorded `stream`.
async fn replays_like_vllm(form: OffloadEvents, stream: &[u8], tag: &str) {
    let record = record();
    let block_size = record["block_size"].as_u64().expect("block_size") as usize;
    let prompt_a: Vec<u32> = record["prompt_A_token_ids"]
        .as_array()
        .expect("A's tokens")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("token")).expect("u32"))
        .collect();
    let real: HashMap<u64, Vec<Msgpack>> = read_stream(stream)
        .into_iter()
        .map(|(topic, seq, payload)| {
            assert_eq!(topic, TOPIC.as_bytes());
            (seq, events(&payload))
        })
        .collect();
    let steps = record["captures"][tag].as_array().expect("steps");

    let engine = engine(form).await;
    let (mut sub, mut next_seq) = subscribe(&engine).await;
    let (mut vllm, mut sim) = (Stream::default(), Stream::default());
    let mut compared = 0;
    for step in steps {
        let name = step["step"].as_str().expect("step name");
        let Some(cached) = step["cached_tokens"].as_u64() else {
            // The capture's drain before the first request.
            continue;
        };
        let seqs: Vec<u64> = step["seqs"]
            .as_array()
            .expect("seqs")
            .iter()
            .map(|s| s.as_u64().expect("seq"))
            .collect();
        let (mut real_stored, mut real_removed, mut real_device_blocks) = (0, 0, 0);
        for seq in &seqs {
            let batch = &real[seq];
            let (s, r) = vllm.apply(batch);
            real_stored += s;
            real_removed += r;
            real_device_blocks += batch
                .iter()
                .filter(|e| kind(e) == "BlockStored" && !is_host(e))
                .map(|e| hashes(e).len())
                .sum::<usize>();
        }
        let prompt = match name.strip_prefix("filler-") {
            Some(n) => filler(
                n.parse().expect("filler number"),
                real_device_blocks,
                block_size,
            ),
            None => prompt_a.clone(),
        };
        let (status, body) = post(
            engine.local_addr(),
            "/v1/completions",
            &json!({"model": "sim-model", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{name}: {body}");
        assert_eq!(
            body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64(),
            Some(cached),
            "{tag} {name}: cached_tokens"
        );
        // vLLM published nothing for a full device hit; otherwise engine-sim's one iteration
        // published one batch.
        let (sim_stored, sim_removed) = if seqs.is_empty() {
            (0, 0)
        } else {
            let msg = timeout(WAIT, sub.recv())
                .await
                .unwrap_or_else(|_| panic!("{name}: no batch in time"))
                .expect("message");
            let frames = msg.into_vec();
            assert_eq!(frames.len(), 3, "[topic, seq, payload]");
            let seq = u64::from_be_bytes(frames[1].as_ref().try_into().expect("8-byte seq"));
            assert_eq!(seq, next_seq, "{name}: one batch per step, none missing");
            next_seq += 1;
            sim.apply(&events(&frames[2]))
        };
        assert_eq!(
            (sim_stored, sim_removed),
            (real_stored, real_removed),
            "{tag} {name}: host-tier blocks stored and evicted"
        );
        compared += 1;
    }
    assert_eq!(compared, 22, "every step of the scenario");
    // The scenario offloads and evicts (the totals of the capture), and both streams end with
    // the same number of blocks in host memory.
    assert!(sim.removed > 0 && sim.stored > sim.removed);
    assert_eq!((sim.stored, sim.removed), (vllm.stored, vllm.removed));
    assert_eq!(sim.host.len(), vllm.host.len());
    // vLLM's host-tier events and engine-sim's have the same fields, types and values.
    assert!(!vllm.shapes.is_empty());
    assert_eq!(sim.shapes, vllm.shapes, "{tag}: host-tier event shapes");
    engine.stop().await;
}

#[tokio::test]
async fn placeholder_offload_events_and_cached_tokens_match_vllm() {
    replays_like_vllm(OffloadEvents::Placeholder, PLACEHOLDER_STREAM, "ph-bpc1").await;
}

#[tokio::test]
async fn self_describing_offload_events_and_cached_tokens_match_vllm() {
    replays_like_vllm(
        OffloadEvents::SelfDescribing,
        SELF_DESCRIBING_STREAM,
        "sd-bpc1",
    )
    .await;
}

#[test]
fn the_recorded_host_tier_events_are_what_the_simulator_writes() {
    // The shapes the replay tests compare, spelled out from the capture: a placeholder store,
    // a self-describing store (the root block's parent is nil, a later block's an int), and
    // a removal.
    let shapes = |stream: &[u8]| {
        let mut set = BTreeSet::new();
        for (_, _, payload) in read_stream(stream) {
            for event in events(&payload).iter().filter(|e| is_host(e)) {
                set.insert(shape(event));
            }
        }
        set.into_iter().collect::<Vec<_>>()
    };
    let placeholder = r#"type="BlockStored" block_hashes=array[1] parent_block_hash=nil token_ids=array[0] block_size=0 lora_id=nil medium="CPU" lora_name=nil group_idx=0"#;
    let described = |parent: &str| {
        format!(
            r#"type="BlockStored" block_hashes=array[1] parent_block_hash={parent} token_ids=array[32] block_size=32 lora_id=nil medium="CPU" lora_name=nil group_idx=0 kv_cache_spec_kind="full_attention""#
        )
    };
    let ph = shapes(PLACEHOLDER_STREAM);
    assert!(ph.contains(&placeholder.to_owned()), "{ph:#?}");
    let sd = shapes(SELF_DESCRIBING_STREAM);
    for expected in [described("nil"), described("int")] {
        assert!(sd.contains(&expected), "{sd:#?}");
    }
    // A removal names the evicted blocks' hashes, nothing else.
    for shapes in [ph, sd] {
        let removals: Vec<&String> = shapes
            .iter()
            .filter(|s| s.starts_with(r#"type="BlockRemoved""#))
            .collect();
        assert!(!removals.is_empty(), "a host removal in every capture");
        for removal in removals {
            assert!(
                removal.ends_with(r#" medium="CPU" group_idx=0"#),
                "{removal}"
            );
        }
    }
}
