//! KV events over ZMQ as a vLLM consumer sees them: a SUB socket on the PUB endpoint, a DEALER
//! on the replay endpoint, and a small msgpack decoder that accepts both event encodings.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvmesh_engine_sim::hashing::{BlockHasher, EngineHash};
use kvmesh_engine_sim::{
    EngineHandle, KvEventEncoding, KvEventHash, KvEventsConfig, LoraModule, SimConfig,
};
use rmpv::Value;
use serde_json::json;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

const WAIT: Duration = Duration::from_secs(5);

/// A block hash as sent: an int, or the 32-byte digest.
#[derive(Debug, Clone, PartialEq, Eq)]
enum WireHash {
    Int(u64),
    Bytes(Vec<u8>),
}

impl WireHash {
    fn expected(hash: &EngineHash, kind: KvEventHash) -> Self {
        match kind {
            KvEventHash::Int => Self::Int(hash.id()),
            KvEventHash::Bytes => Self::Bytes(hash.digest().to_vec()),
        }
    }

    /// The one id space of both forms: the int, or the digest's last 8 bytes big-endian.
    fn id(&self) -> u64 {
        match self {
            Self::Int(id) => *id,
            Self::Bytes(b) => {
                let tail: [u8; 8] = b[b.len() - 8..].try_into().expect("8 bytes");
                u64::from_be_bytes(tail)
            }
        }
    }
}

/// A decoded event.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Stored {
        hashes: Vec<WireHash>,
        parent: Option<WireHash>,
        tokens: Vec<u32>,
        block_size: u64,
        /// `(lora_id, lora_name)` of an adapter's blocks.
        lora: Option<(u64, String)>,
    },
    Removed {
        hashes: Vec<WireHash>,
    },
    Cleared,
}

/// One received message.
#[derive(Debug)]
struct Batch {
    topic: Bytes,
    seq: u64,
    events: Vec<Event>,
}

fn wire_hash(v: &Value) -> WireHash {
    match v {
        Value::Integer(i) => WireHash::Int(i.as_u64().expect("u64 hash")),
        Value::Binary(b) => {
            assert_eq!(b.len(), 32, "byte hashes are SHA-256 digests");
            WireHash::Bytes(b.clone())
        }
        other => panic!("not a block hash: {other}"),
    }
}

fn hashes(v: &Value) -> Vec<WireHash> {
    v.as_array()
        .expect("hash list")
        .iter()
        .map(wire_hash)
        .collect()
}

fn tokens(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token list")
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .expect("token")
        })
        .collect()
}

fn parent(v: &Value) -> Option<WireHash> {
    (!v.is_nil()).then(|| wire_hash(v))
}

/// `lora_id` and `lora_name`: both nil (the base model) or both set.
fn lora(id: &Value, name: &Value) -> Option<(u64, String)> {
    if id.is_nil() && name.is_nil() {
        return None;
    }
    let id = id.as_u64().expect("lora_id is an int");
    let name = name.as_str().expect("lora_name is a string");
    Some((id, name.to_owned()))
}

/// Decodes one event in either encoding; also checks the fixed fields of each.
fn decode_event(v: &Value) -> Event {
    match v {
        Value::Array(a) => match a[0].as_str() {
            Some("BlockStored") => {
                assert_eq!(a.len(), 8, "trailing nil fields are omitted: {v}");
                assert_eq!(a[6].as_str(), Some("GPU"));
                Event::Stored {
                    hashes: hashes(&a[1]),
                    parent: parent(&a[2]),
                    tokens: tokens(&a[3]),
                    block_size: a[4].as_u64().expect("block size"),
                    lora: lora(&a[5], &a[7]),
                }
            }
            Some("BlockRemoved") => {
                assert_eq!(a.len(), 3, "{v}");
                assert_eq!(a[2].as_str(), Some("GPU"));
                Event::Removed {
                    hashes: hashes(&a[1]),
                }
            }
            Some("AllBlocksCleared") => {
                assert_eq!(a.len(), 1, "{v}");
                Event::Cleared
            }
            _ => panic!("unknown event {v}"),
        },
        Value::Map(m) => {
            let field = |key: &str| {
                m.iter()
                    .find(|(k, _)| k.as_str() == Some(key))
                    .map(|(_, v)| v)
                    .unwrap_or_else(|| panic!("no {key} in {v}"))
            };
            match field("type").as_str() {
                Some("BlockStored") => {
                    let lora = lora(field("lora_id"), field("lora_name"));
                    // Per block, the keys folded into the hash: the adapter's name, or nil.
                    let extra = match &lora {
                        Some((_, name)) => Value::Array(vec![Value::from(name.as_str())]),
                        None => Value::Nil,
                    };
                    let blocks = field("block_hashes").as_array().map_or(0, Vec::len);
                    assert_eq!(field("extra_keys"), &Value::Array(vec![extra; blocks]));
                    assert_eq!(field("medium").as_str(), Some("GPU"));
                    assert_eq!(field("group_idx").as_u64(), Some(0));
                    assert_eq!(field("kv_cache_spec_kind").as_str(), Some("full_attention"));
                    Event::Stored {
                        hashes: hashes(field("block_hashes")),
                        parent: parent(field("parent_block_hash")),
                        tokens: tokens(field("token_ids")),
                        block_size: field("block_size").as_u64().expect("block size"),
                        lora,
                    }
                }
                Some("BlockRemoved") => Event::Removed {
                    hashes: hashes(field("block_hashes")),
                },
                Some("AllBlocksCleared") => Event::Cleared,
                _ => panic!("unknown event {v}"),
            }
        }
        other => panic!("not an event: {other}"),
    }
}

/// Decodes the msgpack batch `[ts, events, dp_rank]`.
fn decode_payload(payload: &[u8]) -> Vec<Event> {
    let mut slice = payload;
    let v = rmpv::decode::read_value(&mut slice).expect("msgpack batch");
    assert!(slice.is_empty(), "trailing bytes after the batch");
    let batch = v.as_array().expect("positional batch");
    assert_eq!(batch.len(), 3, "{v}");
    assert!(batch[0].as_f64().is_some_and(|ts| ts > 1.6e9), "{v}");
    assert_eq!(batch[2].as_u64(), Some(0), "{v}");
    batch[1]
        .as_array()
        .expect("event list")
        .iter()
        .map(decode_event)
        .collect()
}

fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().expect("8-byte sequence number"))
}

fn decode_message(msg: ZmqMessage) -> Batch {
    let frames = msg.into_vec();
    assert_eq!(frames.len(), 3, "[topic, seq, payload]");
    Batch {
        topic: frames[0].clone(),
        seq: seq_of(&frames[1]),
        events: decode_payload(&frames[2]),
    }
}

async fn post(addr: SocketAddr, path: &str, body: serde_json::Value) -> (StatusCode, Bytes) {
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
    (
        status,
        res.into_body().collect().await.expect("body").to_bytes(),
    )
}

async fn complete(addr: SocketAddr, prompt: &[u32]) {
    complete_as(addr, "sim-model", prompt).await;
}

/// A one-token completion of `prompt` asking for `model` (the base model or an adapter).
async fn complete_as(addr: SocketAddr, model: &str, prompt: &[u32]) {
    let (status, body) = post(
        addr,
        "/v1/completions",
        json!({"model": model, "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body:?}");
}

async fn reset(addr: SocketAddr) {
    let (status, _) = post(addr, "/reset_prefix_cache", json!({})).await;
    assert_eq!(status, StatusCode::OK);
}

async fn fault(addr: SocketAddr, body: serde_json::Value) {
    let (status, text) = post(addr, "/sim/kv_events/faults", body).await;
    assert_eq!(status, StatusCode::OK, "{text:?}");
}

fn config(block_size: usize, kv_events: KvEventsConfig) -> SimConfig {
    SimConfig {
        no_delay: true,
        block_size,
        kv_events,
        ..SimConfig::default()
    }
}

fn events_on(encoding: KvEventEncoding, hash: KvEventHash, topic: &str) -> KvEventsConfig {
    KvEventsConfig {
        endpoint: Some("tcp://127.0.0.1:0".to_owned()),
        replay_endpoint: Some("tcp://127.0.0.1:0".to_owned()),
        topic: topic.to_owned(),
        encoding,
        hash,
        ..KvEventsConfig::default()
    }
}

async fn engine(config: SimConfig) -> EngineHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    kvmesh_engine_sim::spawn(config, listener)
        .await
        .expect("spawn")
}

/// A SUB socket on an engine's PUB endpoint.
struct Subscriber {
    socket: SubSocket,
    http: SocketAddr,
    last_seq: u64,
}

impl Subscriber {
    /// Subscribes to a fresh engine (no batch published yet) and waits until the subscription
    /// is in effect: ZMQ drops messages published before it arrives, so probe with cache resets
    /// (each one batch, numbered 0, 1, ...) until one gets through, then drain to the latest.
    async fn attach(engine: &EngineHandle, topic: &str) -> Self {
        let mut socket = SubSocket::new();
        let addr = engine.kv_events_addr().expect("events on");
        socket
            .connect(&format!("tcp://{addr}"))
            .await
            .expect("connect SUB");
        socket.subscribe(topic).await.expect("subscribe");
        let http = engine.local_addr();
        for probe in 0..100u64 {
            reset(http).await;
            let Ok(msg) = timeout(Duration::from_millis(100), socket.recv()).await else {
                continue;
            };
            let mut batch = decode_message(msg.expect("message"));
            while batch.seq < probe {
                assert_eq!(batch.events, vec![Event::Cleared]);
                batch = decode_message(
                    timeout(WAIT, socket.recv())
                        .await
                        .expect("probe")
                        .expect("message"),
                );
            }
            assert_eq!(
                (batch.seq, &batch.events[..]),
                (probe, &[Event::Cleared][..])
            );
            return Self {
                socket,
                http,
                last_seq: probe,
            };
        }
        panic!("the subscription never took effect");
    }

    /// The next batch; checks that it follows the previous one without a gap.
    async fn next(&mut self) -> Batch {
        let expected = self.last_seq + 1;
        let batch = self.next_any().await;
        assert_eq!(batch.seq, expected, "sequence gap");
        batch
    }

    /// The next batch, whatever its number.
    async fn next_any(&mut self) -> Batch {
        let msg = timeout(WAIT, self.socket.recv())
            .await
            .expect("a batch in time")
            .expect("message");
        let batch = decode_message(msg);
        self.last_seq = batch.seq;
        batch
    }

    /// Proves nothing else was published: a reset's `AllBlocksCleared` must come next.
    async fn expect_quiet(&mut self) {
        reset(self.http).await;
        let batch = self.next().await;
        assert_eq!(batch.events, vec![Event::Cleared]);
    }
}

/// The store the engine must announce for the full blocks of `tokens` from block `from` on,
/// chained onto the blocks before it.
fn expected_store(tokens: &[u32], block_size: usize, from: usize, kind: KvEventHash) -> Event {
    expected_adapter_store(tokens, block_size, from, kind, None)
}

/// [`expected_store`] for blocks computed with adapter `lora` (`(lora_id, lora_name)`).
fn expected_adapter_store(
    tokens: &[u32],
    block_size: usize,
    from: usize,
    kind: KvEventHash,
    lora: Option<(u64, &str)>,
) -> Event {
    let mut hasher = BlockHasher::new();
    let mut chain: Vec<EngineHash> = Vec::new();
    for block in tokens.chunks_exact(block_size) {
        let parent = chain.last().map(EngineHash::id);
        chain.push(hasher.engine_hash(parent, block, lora.map(|(_, name)| name)));
    }
    Event::Stored {
        hashes: chain[from..]
            .iter()
            .map(|h| WireHash::expected(h, kind))
            .collect(),
        parent: from
            .checked_sub(1)
            .map(|p| WireHash::expected(&chain[p], kind)),
        tokens: tokens[from * block_size..chain.len() * block_size].to_vec(),
        block_size: block_size as u64,
        lora: lora.map(|(id, name)| (id, name.to_owned())),
    }
}

/// Sends a replay request for batches from `start` on; returns `(seq, events)` per batch,
/// checking the end marker.
async fn replay(engine: &EngineHandle, start: u64) -> Vec<(u64, Vec<Event>)> {
    let mut dealer = DealerSocket::new();
    let addr = engine.kv_replay_addr().expect("replay on");
    dealer
        .connect(&format!("tcp://{addr}"))
        .await
        .expect("connect DEALER");
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&start.to_be_bytes()));
    dealer.send(request).await.expect("send replay request");
    let mut out = Vec::new();
    loop {
        let frames = timeout(WAIT, dealer.recv())
            .await
            .expect("a replay reply in time")
            .expect("message")
            .into_vec();
        // As a running vLLM 0.32.0 sends them: [empty, topic, seq, payload].
        assert_eq!(frames.len(), 4, "[empty, topic, seq, payload]");
        assert!(frames[0].is_empty(), "delimiter");
        if frames[2][..] == [0xFF; 8] {
            assert!(frames[1].is_empty(), "the end marker has an empty topic");
            assert!(frames[3].is_empty(), "the end marker has an empty payload");
            return out;
        }
        out.push((seq_of(&frames[2]), decode_payload(&frames[3])));
    }
}

#[tokio::test]
async fn stores_follow_the_prompt_in_every_format() {
    let formats = [
        (KvEventEncoding::Positional, KvEventHash::Int, ""),
        (KvEventEncoding::Positional, KvEventHash::Bytes, "kv-events"),
        (KvEventEncoding::Map, KvEventHash::Int, "kv-events"),
        (KvEventEncoding::Map, KvEventHash::Bytes, ""),
    ];
    for (encoding, hash, topic) in formats {
        let engine = engine(config(16, events_on(encoding, hash, topic))).await;
        let mut sub = Subscriber::attach(&engine, topic).await;
        let http = engine.local_addr();

        // 40 tokens: two full blocks are stored, the partial third is not.
        let prompt: Vec<u32> = (100..140).collect();
        complete(http, &prompt).await;
        let batch = sub.next().await;
        assert_eq!(batch.topic, topic.as_bytes(), "{encoding:?}");
        let want = expected_store(&prompt, 16, 0, hash);
        assert_eq!(batch.events, vec![want.clone()], "{encoding:?} {hash:?}");
        // Both hash forms share one id space: the int, or the digest's last 8 bytes.
        let Event::Stored { hashes, .. } = &batch.events[0] else {
            unreachable!("compared above")
        };
        let first = BlockHasher::new().engine_hash(None, &prompt[..16], None);
        assert_eq!(hashes[0].id(), first.id());

        // Reusing the resident blocks announces nothing.
        complete(http, &prompt).await;
        sub.expect_quiet().await;

        // The reset dropped them: a longer prompt stores all its blocks again, then an extension
        // stores only its new block, chained onto the last one.
        let longer: Vec<u32> = (100..156).collect();
        complete(http, &longer[..40]).await;
        assert_eq!(
            sub.next().await.events,
            vec![expected_store(&prompt, 16, 0, hash)]
        );
        complete(http, &longer).await;
        assert_eq!(
            sub.next().await.events,
            vec![expected_store(&longer, 16, 2, hash)],
            "{encoding:?} {hash:?}"
        );
        engine.stop().await;
    }
}

#[tokio::test]
async fn adapter_stores_carry_the_lora_in_every_format() {
    let formats = [
        (KvEventEncoding::Positional, KvEventHash::Int),
        (KvEventEncoding::Map, KvEventHash::Bytes),
    ];
    for (encoding, hash) in formats {
        let engine = engine(SimConfig {
            lora_modules: vec![LoraModule {
                name: "sql".to_owned(),
                path: "/adapters/sql".to_owned(),
            }],
            ..config(16, events_on(encoding, hash, ""))
        })
        .await;
        let mut sub = Subscriber::attach(&engine, "").await;
        let http = engine.local_addr();
        let (status, body) = post(
            http,
            "/v1/load_lora_adapter",
            json!({"lora_name": "chat", "lora_path": "/adapters/chat"}),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{body:?}");

        // The same prompt under each adapter and the base model: three stores, each in its
        // own hash space, each naming its adapter (ids in load order from 1).
        let prompt: Vec<u32> = (100..140).collect();
        for (model, lora) in [
            ("sql", Some((1, "sql"))),
            ("chat", Some((2, "chat"))),
            ("sim-model", None),
        ] {
            complete_as(http, model, &prompt).await;
            assert_eq!(
                sub.next().await.events,
                vec![expected_adapter_store(&prompt, 16, 0, hash, lora)],
                "{model} {encoding:?}"
            );
        }
        // A repeat under an adapter reuses its own blocks: nothing new is stored.
        complete_as(http, "sql", &prompt).await;
        sub.expect_quiet().await;
        engine.stop().await;
    }
}

#[tokio::test]
async fn eviction_removes_the_lru_tail_and_reset_clears() {
    let kv = events_on(KvEventEncoding::Positional, KvEventHash::Int, "");
    let engine = engine(SimConfig {
        num_gpu_blocks: 4,
        ..config(4, kv)
    })
    .await;
    let mut sub = Subscriber::attach(&engine, "").await;
    let http = engine.local_addr();
    let a: Vec<u32> = (1..=8).collect();
    complete(http, &a).await;
    let a_store = expected_store(&a, 4, 0, KvEventHash::Int);
    assert_eq!(sub.next().await.events, vec![a_store.clone()]);
    let Event::Stored {
        hashes: a_hashes, ..
    } = a_store
    else {
        unreachable!("expected_store builds a store")
    };
    // B needs three of the four blocks: one of A's two cached blocks must go, the deeper one.
    let b: Vec<u32> = (50..62).collect();
    complete(http, &b).await;
    let mut seen = Vec::new();
    while !seen.iter().any(|e| matches!(e, Event::Stored { .. })) {
        seen.extend(sub.next().await.events);
    }
    assert_eq!(
        seen,
        vec![
            Event::Removed {
                hashes: vec![a_hashes[1].clone()]
            },
            expected_store(&b, 4, 0, KvEventHash::Int),
        ]
    );
    reset(http).await;
    assert_eq!(sub.next().await.events, vec![Event::Cleared]);
    engine.stop().await;
}

#[tokio::test]
async fn replay_returns_dropped_batches_then_the_end_marker() {
    let kv = events_on(KvEventEncoding::Map, KvEventHash::Bytes, "");
    let engine = engine(config(16, kv)).await;
    let mut sub = Subscriber::attach(&engine, "").await;
    let http = engine.local_addr();
    let first = sub.last_seq;
    let p1: Vec<u32> = (0..32).collect();
    let p2: Vec<u32> = (1000..1016).collect();

    fault(http, json!({"drop_batches": 2})).await;
    complete(http, &p1).await;
    complete(http, &p2).await;
    reset(http).await;
    // The two stores were withheld: the reset arrives with a gap of two.
    let batch = sub.next_any().await;
    assert_eq!(batch.seq, first + 3);
    assert_eq!(batch.events, vec![Event::Cleared]);

    let replayed = replay(&engine, first + 1).await;
    assert_eq!(
        replayed,
        vec![
            (
                first + 1,
                vec![expected_store(&p1, 16, 0, KvEventHash::Bytes)]
            ),
            (
                first + 2,
                vec![expected_store(&p2, 16, 0, KvEventHash::Bytes)]
            ),
            (first + 3, vec![Event::Cleared]),
        ]
    );
    // From 0: every batch so far, numbered without a hole.
    let all = replay(&engine, 0).await;
    let seqs: Vec<u64> = all.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs, (0..=first + 3).collect::<Vec<_>>());
    assert!(replay(&engine, first + 4).await.is_empty());
    engine.stop().await;
}

#[tokio::test]
async fn duplicate_store_and_restart_faults() {
    let kv = events_on(KvEventEncoding::Positional, KvEventHash::Int, "");
    let engine = engine(config(16, kv)).await;
    let mut sub = Subscriber::attach(&engine, "").await;
    let http = engine.local_addr();
    let prompt: Vec<u32> = (7..39).collect();
    let store = expected_store(&prompt, 16, 0, KvEventHash::Int);

    fault(http, json!({"duplicate_stores": 1})).await;
    complete(http, &prompt).await;
    assert_eq!(sub.next().await.events, vec![store.clone()]);
    assert_eq!(sub.next().await.events, vec![store.clone()]);

    // A restart numbers from 0 again and starts with AllBlocksCleared; the cache is empty, so
    // the same prompt is stored anew.
    fault(http, json!({"restart": true})).await;
    let batch = sub.next_any().await;
    assert_eq!((batch.seq, batch.events), (0, vec![Event::Cleared]));
    complete(http, &prompt).await;
    assert_eq!(sub.next().await.events, vec![store.clone()]);
    let replayed = replay(&engine, 0).await;
    assert_eq!(replayed, vec![(0, vec![Event::Cleared]), (1, vec![store])]);

    let (status, _) = post(http, "/sim/kv_events/faults", json!({"drop": 1})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    engine.stop().await;
}

#[tokio::test]
async fn faults_need_a_publisher() {
    let engine = engine(config(16, KvEventsConfig::default())).await;
    assert!(engine.kv_events_addr().is_none() && engine.kv_replay_addr().is_none());
    let (status, _) = post(
        engine.local_addr(),
        "/sim/kv_events/faults",
        json!({"restart": true}),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    engine.stop().await;
}

/// Kills the child process when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn binary_announces_every_socket_per_engine() {
    let child = Command::new(env!("CARGO_BIN_EXE_kvmesh-engine-sim"))
        .args([
            "--port",
            "0",
            "--engines",
            "2",
            "--no-delay",
            "--block-size",
            "16",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-replay-endpoint",
            "tcp://127.0.0.1:0",
            "--kv-events-encoding",
            "map",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the binary");
    let mut running = Running(child);
    let stdout = running.0.stdout.take().expect("stdout");
    let lines = tokio::task::spawn_blocking(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let line = line.expect("utf-8 line");
            if line == "READY" {
                return lines;
            }
            lines.push(line);
        }
        panic!("no READY line: {lines:?}");
    });
    let lines = timeout(Duration::from_secs(30), lines)
        .await
        .expect("READY in time")
        .expect("reader");
    let names: Vec<&str> = lines
        .iter()
        .map(|l| l.split(' ').nth(1).expect("a name"))
        .collect();
    assert_eq!(
        names,
        [
            "engine-0",
            "kv-events-0",
            "kv-replay-0",
            "engine-1",
            "kv-events-1",
            "kv-replay-1"
        ]
    );
    let addrs: Vec<SocketAddr> = lines
        .iter()
        .map(|l| {
            assert!(l.starts_with("LISTENING "), "{l}");
            l.split(' ')
                .nth(2)
                .and_then(|a| a.parse().ok())
                .expect("ip:port")
        })
        .collect();
    assert!(addrs.iter().all(|a| a.port() != 0));
    let mut ports: Vec<u16> = addrs.iter().map(SocketAddr::port).collect();
    ports.sort_unstable();
    ports.dedup();
    assert_eq!(ports.len(), 6, "every socket has its own port");

    // Engine 1's PUB socket carries engine 1's events.
    let mut sub = SubSocket::new();
    sub.connect(&format!("tcp://{}", addrs[4]))
        .await
        .expect("connect");
    sub.subscribe("").await.expect("subscribe");
    let prompt: Vec<u32> = (0..16).collect();
    let mut got = None;
    for _ in 0..100 {
        complete(addrs[3], &prompt).await;
        if let Ok(msg) = timeout(Duration::from_millis(100), sub.recv()).await {
            got = Some(decode_message(msg.expect("message")));
            break;
        }
        reset(addrs[3]).await;
    }
    let batch = got.expect("engine 1 published");
    assert!(matches!(
        batch.events[..],
        [Event::Stored { .. }] | [Event::Cleared]
    ));
}
