//! Test harness: real etcd and nats-server processes, an in-process engine-sim (real HTTP and
//! ZMQ sockets), and the `kvmesh-agent` binary as a child process.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use kvmesh_control::testing::{EtcdServer, NatsServer, TempDir, temp_dir};
use kvmesh_control::{EventBatch, Namespace, NatsBus, Subscription};
use kvmesh_engine_sim::{EngineHandle, KvEventEncoding, KvEventHash, SimConfig};
use kvmesh_kv::KvEvent;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};

/// The served model of every test engine (with a `/` and a `.` to exercise encoding).
pub const MODEL: &str = "test/model.v1";
/// Tokens per block.
pub const BLOCK: usize = 16;

/// etcd + NATS for one test.
pub struct Servers {
    pub etcd: EtcdServer,
    pub nats: NatsServer,
    /// Dropped last: the servers stop before their data goes.
    pub dir: TempDir,
}

impl Servers {
    pub async fn start(name: &str) -> Self {
        let dir = temp_dir(&format!("agent-{name}"));
        let etcd = EtcdServer::start(&dir.join("etcd"))
            .await
            .expect("etcd starts");
        let nats = NatsServer::start(&dir.join("nats"))
            .await
            .expect("nats starts");
        Self { etcd, nats, dir }
    }

    pub async fn bus(&self) -> NatsBus {
        NatsBus::connect(&self.nats.url(), "test")
            .await
            .expect("test NATS client")
    }
}

/// An engine-sim engine publishing KV events with replay.
pub async fn engine(encoding: KvEventEncoding, hash: KvEventHash) -> EngineHandle {
    engine_keeping(encoding, hash, None).await
}

/// [`engine`], whose replay buffer keeps `buffer_steps` batches (`None`: engine-sim's default).
pub async fn engine_keeping(
    encoding: KvEventEncoding,
    hash: KvEventHash,
    buffer_steps: Option<usize>,
) -> EngineHandle {
    let mut config = SimConfig {
        model: MODEL.to_owned(),
        block_size: BLOCK,
        no_delay: true,
        ..SimConfig::default()
    };
    config.kv_events.endpoint = Some("tcp://127.0.0.1:0".into());
    config.kv_events.replay_endpoint = Some("tcp://127.0.0.1:0".into());
    config.kv_events.encoding = encoding;
    config.kv_events.hash = hash;
    if let Some(steps) = buffer_steps {
        config.kv_events.buffer_steps = steps;
    }
    let mut engines = kvmesh_engine_sim::spawn_engines(&config, [127, 0, 0, 1].into(), 0, 1)
        .await
        .expect("engine starts");
    engines.pop().expect("one engine")
}

/// A running `kvmesh-agent` process.
pub struct AgentProcess {
    pub child: Child,
    pub addr: SocketAddr,
    pub instance_id: String,
    pub log: PathBuf,
}

impl AgentProcess {
    /// Starts the agent for `engine_url` / `events` with `extra` flags; waits for READY.
    pub async fn start(
        servers: &Servers,
        engine_url: &str,
        events: &str,
        replay: Option<&str>,
        extra: &[&str],
    ) -> Self {
        let instance_id = format!("{:016x}", rand_id());
        let log = servers.dir.join(format!("agent-{instance_id}.log"));
        let mut args: Vec<String> = vec![
            "--engine-url".into(),
            engine_url.into(),
            "--model".into(),
            MODEL.into(),
            "--kv-events-endpoint".into(),
            events.into(),
            "--block-size".into(),
            BLOCK.to_string(),
            "--etcd".into(),
            servers.etcd.url(),
            "--nats".into(),
            servers.nats.url(),
            "--instance-id".into(),
            instance_id.clone(),
            "--load-interval".into(),
            "100ms".into(),
            "--health-interval".into(),
            "200ms".into(),
        ];
        if let Some(replay) = replay {
            args.push("--kv-events-replay-endpoint".into());
            args.push(replay.into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let stderr = std::fs::File::create(&log).expect("log file");
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvmesh-agent"))
            .args(&args)
            .env("RUST_LOG", "kvmesh_agent=debug,kvmesh_control=debug,info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .expect("agent spawns");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let mut addr = None;
        let ready = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.strip_prefix("LISTENING agent ") {
                    addr = rest.parse().ok();
                }
                if line == "READY" {
                    return true;
                }
            }
            false
        })
        .await;
        if !matches!(ready, Ok(true)) {
            let logs = std::fs::read_to_string(&log).unwrap_or_default();
            panic!("agent not ready:\n{logs}");
        }
        // Keep draining stdout so the child never blocks.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Self {
            child,
            addr: addr.expect("LISTENING line"),
            instance_id,
            log,
        }
    }

    /// The agent's `/metrics` text.
    pub async fn metrics(&self) -> String {
        http(self.addr, "GET", "/metrics", "").await.1
    }

    /// The value of one sample of the agent's metrics (0 when absent).
    pub async fn metric(&self, sample: &str) -> f64 {
        let text = self.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|v| v.trim().parse().ok()))
            .unwrap_or(0.0)
    }

    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends a signal to the agent.
    pub fn signal(&self, sig: &str) {
        let pid = self.child.id().expect("running").to_string();
        let status = std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }
}

fn rand_id() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or_default();
    (u64::from(std::process::id()) << 32 | u64::from(nanos)).max(1)
}

/// A minimal HTTP/1.1 exchange (`Connection: close`); returns (status, body).
pub async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut raw))
        .await
        .expect("answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// A completion of `tokens` (as a token-id prompt) on `engine`.
pub async fn complete(engine: SocketAddr, tokens: &[u32]) {
    let body = serde_json::json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
    let (status, answer) = http(engine, "POST", "/v1/completions", &body).await;
    assert_eq!(status, 200, "completion failed: {answer}");
}

/// A prompt of `blocks` full blocks, distinct per `seed`.
pub fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32)
        .map(|i| seed * 100_000 + i)
        .collect()
}

/// kvmesh's sequence hashes of `tokens`.
pub fn kvmesh_hashes(tokens: &[u32]) -> Vec<u64> {
    kvmesh_kv::BlockHasher::new(BLOCK, None)
        .expect("hasher")
        .hash(tokens)
        .sequence
        .iter()
        .map(|s| s.0)
        .collect()
}

/// The sequence hashes of every stored block in `batch`.
pub fn stored_sequences(batch: &EventBatch) -> Vec<u64> {
    batch
        .events
        .iter()
        .flat_map(|e| match e {
            KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.sequence.0).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// Reads batches from `sub` until `done` holds for the sequence hashes stored so far.
pub async fn collect_until(
    sub: &mut Subscription,
    seqs: &mut Vec<u64>,
    batches: &mut Vec<EventBatch>,
    done: impl Fn(&[u64]) -> bool,
) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while !done(seqs) {
            let msg = sub.next().await.expect("subscription open");
            let batch = EventBatch::from_json(&msg.payload).expect("valid batch");
            seqs.extend(stored_sequences(&batch));
            batches.push(batch);
        }
    })
    .await
    .unwrap_or_else(|_| panic!("expected events not published; stored so far: {seqs:x?}"));
}

/// The event subject of the test model.
pub fn event_subject() -> String {
    Namespace::default().event_subject(MODEL)
}

/// POSTs a fault to the engine.
pub async fn fault(engine: SocketAddr, body: &str) {
    let (status, answer) = http(engine, "POST", "/sim/kv_events/faults", body).await;
    assert_eq!(status, 200, "fault injection failed: {answer}");
}
