//! The proxy's control-plane intake through the in-process registry and bus: instances come
//! from records, KV events feed the index, gaps and first sights resync from the agent's
//! snapshot, a snapshot replaces what the proxy held, malformed messages are counted.
//! A fake agent answers resync requests; `POST /debug/route` shows the index's view.

// Shared with `tests/proxy.rs`, which uses the parts this file does not.
#[allow(dead_code)]
mod support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use kvmesh_config::Config;
use kvmesh_control::{
    EventBatch, EventBus, InProcessBus, InProcessRegistry, InstanceId, InstanceRecord,
    InstanceState, Namespace, RankedEvent, Registry, SnapshotReply, SnapshotRequest,
};
use kvmesh_kv::{BlockHasher, BlockParent, ExternalHash, KvEvent, LocalBlockHash, SequenceHash};
use kvmesh_proxy::{ControlPlane, Proxy, ReloadHandle};
use support::{Backend, send};
use tokio::sync::oneshot;

const MODEL: &str = "m";
const BLOCK: usize = 4;

/// A proxy with in-process discovery and events, `policy: kv` with block size 4.
struct Harness {
    registry: Arc<InProcessRegistry>,
    bus: Arc<InProcessBus>,
    namespace: Namespace,
    main: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    reload: ReloadHandle,
    _shutdown: oneshot::Sender<()>,
}

impl Harness {
    async fn start() -> Self {
        Self::start_with(&format!(
            "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
             health_check:\n  enabled: false\n\
             models:\n  - name: {MODEL}\n    policy: kv\n    kv:\n      block_size: {BLOCK}\n    backends: []\n\
             discovery:\n  kind: in_process\nevents:\n  kind: in_process\n  resync_timeout: 1s\n"
        ))
        .await
    }

    /// A proxy of config `yaml` (with in-process discovery and events).
    async fn start_with(yaml: &str) -> Self {
        let config = Config::from_yaml_str(yaml, "test.yaml").unwrap();
        let registry = Arc::new(InProcessRegistry::new());
        let bus = Arc::new(InProcessBus::new());
        let control = ControlPlane {
            registry: Some(registry.clone() as Arc<dyn Registry>),
            bus: Some(bus.clone() as Arc<dyn EventBus>),
        };
        let proxy = Proxy::bind_with(config, control).await.unwrap();
        let admin = proxy.admin_address();
        let main = proxy.listeners()[0].address;
        let reload = proxy.reload_handle();
        let (tx, rx) = oneshot::channel::<()>();
        tokio::spawn(proxy.run(async move {
            let _ = rx.await;
        }));
        Self {
            registry,
            bus,
            namespace: Namespace::default(),
            main,
            admin,
            reload,
            _shutdown: tx,
        }
    }

    /// Registers instance `id` at `url`.
    async fn register(&self, id: u64, url: &str) {
        self.register_as(id, url, kvmesh_control::InstanceRole::Both)
            .await;
    }

    /// Registers instance `id` at `url` in `role`.
    async fn register_as(&self, id: u64, url: &str, role: kvmesh_control::InstanceRole) {
        let record = InstanceRecord {
            instance_id: InstanceId(id),
            model: MODEL.to_string(),
            url: url.to_string(),
            protocol: "http1".to_string(),
            block_size: BLOCK as u32,
            total_blocks: 1000,
            dp_ranks: 1,
            labels: Default::default(),
            adapters: Vec::new(),
            event_subject: self.namespace.event_subject(MODEL),
            snapshot_subject: self.namespace.snapshot_subject(InstanceId(id)),
            state: InstanceState::Ready,
            role,
        };
        let key = self.namespace.instance_key(MODEL, InstanceId(id));
        self.registry.put(&key, &record, None).await.unwrap();
    }

    async fn publish(&self, batch: &EventBatch) {
        let subject = self.namespace.event_subject(MODEL);
        self.bus
            .publish(&subject, Bytes::from(batch.to_json()))
            .await
            .unwrap();
    }

    /// The ids `GET /v1/models` lists.
    async fn model_ids(&self) -> Vec<String> {
        let json = send(self.main, Method::GET, "/v1/models", &[], Bytes::new())
            .await
            .json()
            .await;
        json["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect()
    }

    async fn metrics(&self) -> String {
        send(self.admin, Method::GET, "/metrics", &[], Bytes::new())
            .await
            .text()
            .await
            .unwrap()
    }

    /// Waits until the metrics text contains `line`.
    async fn await_metric(&self, line: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let text = self.metrics().await;
            if text.contains(line) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {line:?} in\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Each instance's cached overlap with a token-id prompt, by URL.
    async fn overlaps(&self, tokens: &[u32]) -> Vec<(String, u64)> {
        let mut all = model_overlaps(self.admin, MODEL, tokens).await;
        all.sort();
        all
    }

    /// Polls until instance `url` overlaps `tokens` by `blocks`.
    async fn await_overlap(&self, url: &str, tokens: &[u32], blocks: u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let overlaps = self.overlaps(tokens).await;
            if overlaps.iter().any(|(u, b)| u == url && *b == blocks) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{url} never overlapped {blocks} blocks: {overlaps:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// A fake agent answering resync requests for one instance with scripted replies, recording
/// the requests.
struct FakeAgent {
    requests: Arc<Mutex<Vec<SnapshotRequest>>>,
    replies: Arc<Mutex<Vec<SnapshotReply>>>,
}

impl FakeAgent {
    async fn serve(bus: &Arc<InProcessBus>, subject: &str) -> Self {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let replies: Arc<Mutex<Vec<SnapshotReply>>> = Arc::new(Mutex::new(Vec::new()));
        let mut incoming = bus.serve(subject).await.unwrap();
        let (bus, seen, scripted) = (bus.clone(), requests.clone(), replies.clone());
        tokio::spawn(async move {
            while let Some(message) = incoming.next().await {
                let request = SnapshotRequest::from_json(&message.payload).unwrap();
                seen.lock().unwrap().push(request);
                let reply = {
                    let mut scripted = scripted.lock().unwrap();
                    if scripted.is_empty() {
                        None
                    } else {
                        Some(scripted.remove(0))
                    }
                };
                if let Some(reply) = reply {
                    bus.reply(&message, Bytes::from(reply.to_json()))
                        .await
                        .unwrap();
                }
            }
        });
        Self { requests, replies }
    }

    fn script(&self, reply: SnapshotReply) {
        self.replies.lock().unwrap().push(reply);
    }

    fn requests(&self) -> Vec<SnapshotRequest> {
        self.requests.lock().unwrap().clone()
    }
}

/// Stored events for `tokens`' full blocks `from..to`, chained from block `from - 1`, with
/// engine ids `base + i`.
fn stored(tokens: &[u32], from: usize, to: usize, base: u64) -> KvEvent {
    let hashes = BlockHasher::new(BLOCK, None).unwrap().hash(tokens);
    let parent = from.checked_sub(1).map(|p| BlockParent {
        external: ExternalHash(base + p as u64),
        sequence: hashes.sequence[p],
    });
    KvEvent::stored(
        parent,
        (from..to).map(|i| (ExternalHash(base + i as u64), hashes.local[i])),
    )
}

fn batch(id: u64, seq: u64, events: Vec<KvEvent>) -> EventBatch {
    EventBatch {
        instance_id: InstanceId(id),
        dp_rank: 0,
        tier: Default::default(),
        seq,
        events,
    }
}

fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32)
        .map(|i| seed * 10_000 + i)
        .collect()
}

#[tokio::test]
async fn a_gap_resyncs_from_the_agent_and_the_replay_is_applied_in_order() {
    let harness = Harness::start().await;
    let engine = Backend::ok().await;
    let id = 0xA1;
    let agent = FakeAgent::serve(
        &harness.bus,
        &harness.namespace.snapshot_subject(InstanceId(id)),
    )
    .await;
    let a = prompt(1, 6);
    // First sight: the proxy asks for a full snapshot, which holds blocks 0..2 as of seq 3.
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 2, 100),
        }],
        last_seq: 3,
    });
    harness.register(id, &engine.url).await;
    harness.await_overlap(&engine.url, &a, 2).await;
    harness
        .await_metric("kvmesh_kv_index_source{mode=\"events\",model=\"m\"} 1")
        .await;
    assert_eq!(agent.requests(), [SnapshotRequest::full()]);

    // Batch 4 continues the chain; batch 7 arrives after a gap: the proxy asks for 5 on and
    // applies 5, 6 and then the buffered 7, in order.
    harness
        .publish(&batch(id, 4, vec![stored(&a, 2, 3, 100)]))
        .await;
    harness.await_overlap(&engine.url, &a, 3).await;
    agent.script(SnapshotReply::Events {
        batches: vec![
            batch(id, 5, vec![stored(&a, 3, 4, 100)]),
            batch(id, 6, vec![stored(&a, 4, 5, 100)]),
        ],
        last_seq: 6,
    });
    harness
        .publish(&batch(id, 7, vec![stored(&a, 5, 6, 100)]))
        .await;
    harness.await_overlap(&engine.url, &a, 6).await;
    assert_eq!(
        agent.requests(),
        [SnapshotRequest::full(), SnapshotRequest::from_seq(5)]
    );
    harness
        .await_metric("kvmesh_kv_event_gaps_total{model=\"m\"} 1")
        .await;
    harness
        .await_metric("kvmesh_kv_resyncs_total{reason=\"gap\"} 1")
        .await;

    // A stale batch changes nothing; a removal applies.
    harness.publish(&batch(id, 6, vec![KvEvent::Cleared])).await;
    harness
        .publish(&batch(
            id,
            8,
            vec![KvEvent::Removed {
                blocks: vec![ExternalHash(103)],
            }],
        ))
        .await;
    harness.await_overlap(&engine.url, &a, 3).await;
    harness
        .await_metric("kvmesh_kv_event_batches_dropped_total{reason=\"stale\"} 1")
        .await;
}

#[tokio::test]
async fn live_batches_are_timed_from_their_agent_numbering_them_to_the_intake() {
    let harness = Harness::start().await;
    let engine = Backend::ok().await;
    let id = 0xC7;
    let agent = FakeAgent::serve(
        &harness.bus,
        &harness.namespace.snapshot_subject(InstanceId(id)),
    )
    .await;
    let a = prompt(4, 3);
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 1, 100),
        }],
        last_seq: 3,
    });
    harness.register(id, &engine.url).await;
    harness.await_overlap(&engine.url, &a, 1).await;
    // Batch 4 was numbered 1.5 s ago by its agent's clock; batch 5 carries no time (an older
    // agent's) and is not timed.
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let mut stamped = Vec::new();
    batch(id, 4, vec![stored(&a, 1, 2, 100)]).write_json_at(now_ms - 1_500, &mut stamped);
    harness
        .bus
        .publish(
            &harness.namespace.event_subject(MODEL),
            Bytes::from(stamped),
        )
        .await
        .unwrap();
    harness
        .publish(&batch(id, 5, vec![stored(&a, 2, 3, 100)]))
        .await;
    harness.await_overlap(&engine.url, &a, 3).await;
    let text = harness.metrics().await;
    for line in [
        "kvmesh_kv_event_lag_seconds_count{model=\"m\"} 1",
        "kvmesh_kv_event_lag_seconds_bucket{model=\"m\",le=\"1\"} 0",
        "kvmesh_kv_event_lag_seconds_bucket{model=\"m\",le=\"2.5\"} 1",
    ] {
        assert!(text.contains(line), "no {line:?} in\n{text}");
    }
}

#[tokio::test]
async fn a_snapshot_replaces_what_the_proxy_held_and_garbage_is_counted() {
    let harness = Harness::start().await;
    let engine = Backend::ok().await;
    let id = 0xB2;
    let agent = FakeAgent::serve(
        &harness.bus,
        &harness.namespace.snapshot_subject(InstanceId(id)),
    )
    .await;
    let old = prompt(2, 4);
    let new = prompt(3, 4);
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&old, 0, 4, 200),
        }],
        last_seq: 1,
    });
    harness.register(id, &engine.url).await;
    harness.await_overlap(&engine.url, &old, 4).await;

    // A gap whose range left the agent's ring buffer: it answers with a snapshot that no
    // longer holds `old`; the proxy drops everything it held for the instance first.
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&new, 0, 3, 300),
        }],
        last_seq: 9,
    });
    harness.publish(&batch(id, 9, vec![KvEvent::Cleared])).await;
    harness.await_overlap(&engine.url, &new, 3).await;
    assert_eq!(harness.overlaps(&old).await, [(engine.url.clone(), 0)]);
    assert_eq!(
        agent.requests(),
        [SnapshotRequest::full(), SnapshotRequest::from_seq(2)]
    );

    // 1,000 malformed messages and a batch from an unknown instance: counted, never applied.
    let subject = harness.namespace.event_subject(MODEL);
    for i in 0..1000u32 {
        let payload = match i % 4 {
            0 => Bytes::from_static(b"not json"),
            1 => Bytes::from_static(b"{\"instance_id\":\"zz\",\"seq\":1,\"events\":[]}"),
            2 => Bytes::from(vec![0xFF; (i % 64) as usize]),
            _ => Bytes::from_static(
                b"{\"instance_id\":\"b2\",\"seq\":10,\"events\":[{\"type\":\"moved\"}]}",
            ),
        };
        harness.bus.publish(&subject, payload).await.unwrap();
    }
    harness
        .publish(&batch(0xDEAD, 1, vec![stored(&old, 0, 4, 1)]))
        .await;
    harness
        .await_metric("kvmesh_kv_events_malformed_total{kind=\"batch\"} 1000")
        .await;
    harness
        .await_metric("kvmesh_kv_event_batches_dropped_total{reason=\"unknown_instance\"} 1")
        .await;
    harness
        .publish(&batch(id, 10, vec![stored(&new, 3, 4, 300)]))
        .await;
    harness.await_overlap(&engine.url, &new, 4).await;
    assert_eq!(harness.overlaps(&old).await, [(engine.url.clone(), 0)]);
}

#[tokio::test]
async fn instances_follow_their_records_and_models_appear_and_disappear() {
    let harness = Harness::start().await;
    let engine = Backend::ok().await;
    let key = harness.namespace.instance_key("other", InstanceId(7));
    let record = InstanceRecord {
        instance_id: InstanceId(7),
        model: "other".to_string(),
        url: engine.url.clone(),
        protocol: "http1".to_string(),
        block_size: 16,
        total_blocks: 0,
        dp_ranks: 1,
        labels: Default::default(),
        adapters: Vec::new(),
        event_subject: harness.namespace.event_subject("other"),
        snapshot_subject: harness.namespace.snapshot_subject(InstanceId(7)),
        state: InstanceState::Ready,
        role: kvmesh_control::InstanceRole::Both,
    };
    harness.registry.put(&key, &record, None).await.unwrap();
    harness
        .await_metric("kvmesh_discovery_instances{model=\"other\"} 1")
        .await;
    assert_eq!(harness.model_ids().await, ["m", "other"]);
    let health = send(harness.admin, Method::GET, "/health", &[], Bytes::new())
        .await
        .json()
        .await;
    let other = health["models"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "other")
        .unwrap_or_else(|| panic!("no model other in {health}"))
        .clone();
    assert_eq!(other["instances"][0]["state"], "ready");
    let draining = InstanceRecord {
        state: InstanceState::Draining,
        ..record.clone()
    };
    harness.registry.put(&key, &draining, None).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let health = send(harness.admin, Method::GET, "/health", &[], Bytes::new())
            .await
            .json()
            .await;
        let state = health["models"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["name"] == "other")
            .map(|m| m["instances"][0]["state"].clone());
        if state == Some(serde_json::json!("draining")) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{health}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    harness.registry.delete(&key).await.unwrap();
    harness
        .await_metric("kvmesh_discovery_instances{model=\"other\"} 0")
        .await;
    let health = send(harness.admin, Method::GET, "/health", &[], Bytes::new())
        .await
        .json()
        .await;
    assert!(
        health["models"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["name"] != "other"),
        "{health}"
    );
    assert_eq!(harness.model_ids().await, ["m"], "configured models stay");
}

/// Each instance's cached overlap with a token-id prompt of `model`, by URL.
async fn model_overlaps(
    admin: std::net::SocketAddr,
    model: &str,
    tokens: &[u32],
) -> Vec<(String, u64)> {
    let body = serde_json::json!({"model": model, "prompt": tokens}).to_string();
    let reply = send(
        admin,
        Method::POST,
        "/debug/route?route=completions",
        &[("content-type", "application/json")],
        body,
    )
    .await;
    let json = reply.json().await;
    json["instances"]
        .as_array()
        .unwrap_or_else(|| panic!("no instances in {json}"))
        .iter()
        .map(|i| {
            (
                i["instance"].as_str().unwrap().to_string(),
                i["overlap_blocks"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn a_reload_keeps_unchanged_models_and_moves_changed_ones_to_new_pools() {
    let yaml = |weight: f64| {
        format!(
            "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
             health_check:\n  enabled: false\n\
             models:\n  - name: m\n    policy: kv\n    kv:\n      block_size: {BLOCK}\n      overlap_weight: {weight}\n    backends: []\n\
             \x20 - name: n\n    policy: kv\n    kv:\n      block_size: {BLOCK}\n    backends: []\n\
             discovery:\n  kind: in_process\nevents:\n  kind: in_process\n  resync_timeout: 1s\n"
        )
    };
    let harness = Harness::start_with(&yaml(1.0)).await;
    let (registry, bus, admin) = (&harness.registry, &harness.bus, harness.admin);
    let reload = &harness.reload;
    let ns = Namespace::default();
    let empty = SnapshotReply::Snapshot {
        events: Vec::new(),
        last_seq: 0,
    };
    let mut agents = Vec::new();
    for (id, model) in [(1u64, "m"), (2, "n")] {
        let agent = FakeAgent::serve(bus, &ns.snapshot_subject(InstanceId(id))).await;
        agent.script(empty.clone());
        let record = InstanceRecord {
            instance_id: InstanceId(id),
            model: model.to_string(),
            url: format!("http://127.0.0.1:{}", 40000 + id),
            protocol: "http1".to_string(),
            block_size: BLOCK as u32,
            total_blocks: 1000,
            dp_ranks: 1,
            labels: Default::default(),
            adapters: Vec::new(),
            event_subject: ns.event_subject(model),
            snapshot_subject: ns.snapshot_subject(InstanceId(id)),
            state: InstanceState::Ready,
            role: kvmesh_control::InstanceRole::Both,
        };
        registry
            .put(&ns.instance_key(model, InstanceId(id)), &record, None)
            .await
            .unwrap();
        agents.push(agent);
    }
    let (pm, pn) = (prompt(1, 3), prompt(2, 3));
    let await_overlap = |model: &'static str, tokens: Vec<u32>, blocks: u64| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let overlaps = model_overlaps(admin, model, &tokens).await;
            if overlaps.iter().any(|(_, b)| *b == blocks) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{model} never overlapped {blocks} blocks: {overlaps:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    // Both agents answered their first-sight resync; then each engine stores a prompt.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while agents.iter().any(|agent| agent.requests().is_empty()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no first-sight resync"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (id, model, tokens) in [(1u64, "m", &pm), (2, "n", &pn)] {
        let subject = ns.event_subject(model);
        let batch = batch(id, 1, vec![stored(tokens, 0, 3, 100)]);
        bus.publish(&subject, Bytes::from(batch.to_json()))
            .await
            .unwrap();
    }
    await_overlap("m", pm.clone(), 3).await;
    await_overlap("n", pn.clone(), 3).await;

    // Model m's weight changes; n is untouched. m's new pool asks its agent for a snapshot.
    agents[0].script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&pm, 0, 3, 100),
        }],
        last_seq: 1,
    });
    reload
        .apply(Config::from_yaml_str(&yaml(4.0), "test.yaml").unwrap())
        .await
        .expect("models change by reload with a control plane");
    // n kept its pool: its index is there at once and its agent was asked nothing more.
    assert_eq!(
        model_overlaps(admin, "n", &pn).await,
        vec![("http://127.0.0.1:40002".to_string(), 3)]
    );
    await_overlap("m", pm.clone(), 3).await;
    assert_eq!(agents[1].requests().len(), 1, "n's agent asked again");
    let m_requests = agents[0].requests();
    assert_eq!(m_requests.len(), 2, "{m_requests:?}");
    assert_eq!(m_requests[1], SnapshotRequest::full());
    // The instance moved with its model: still one, and still listed.
    assert_eq!(
        model_overlaps(admin, "m", &pm).await,
        vec![("http://127.0.0.1:40001".to_string(), 3)]
    );

    // Changing the control plane itself still needs a restart.
    let moved = yaml(4.0).replace("resync_timeout: 1s", "resync_timeout: 2s");
    let error = reload
        .apply(Config::from_yaml_str(&moved, "test.yaml").unwrap())
        .await
        .expect_err("events change only on restart");
    assert!(error.to_string().contains("only on restart"), "{error}");
}

/// A ready record of instance `id` of `model` at `url`, whose engine runs blocks of
/// `block_size` tokens.
fn record_of(ns: &Namespace, model: &str, id: u64, url: &str, block_size: u32) -> InstanceRecord {
    InstanceRecord {
        instance_id: InstanceId(id),
        model: model.to_string(),
        url: url.to_string(),
        protocol: "http1".to_string(),
        block_size,
        total_blocks: 1000,
        dp_ranks: 1,
        labels: Default::default(),
        adapters: Vec::new(),
        event_subject: ns.event_subject(model),
        snapshot_subject: ns.snapshot_subject(InstanceId(id)),
        state: InstanceState::Ready,
        role: kvmesh_control::InstanceRole::Both,
    }
}

/// The admin `GET /health` status and body.
async fn health(admin: std::net::SocketAddr) -> (u16, serde_json::Value) {
    let reply = send(admin, Method::GET, "/health", &[], Bytes::new()).await;
    let status = reply.status.as_u16();
    (status, reply.json().await)
}

#[tokio::test]
async fn a_config_without_models_serves_the_discovered_ones() {
    let harness = Harness::start_with(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\nmodels: []\n\
         discovery:\n  kind: in_process\nevents:\n  kind: in_process\n  resync_timeout: 1s\n",
    )
    .await;
    // Nothing listed, nothing discovered yet: served (no model lacks an instance), none known.
    assert_eq!(health(harness.admin).await.0, 200);
    assert!(harness.model_ids().await.is_empty());
    let body = serde_json::json!({"model": "found", "prompt": "hi"}).to_string();
    let json = [("content-type", "application/json")];
    let unknown = send(
        harness.main,
        Method::POST,
        "/v1/completions",
        &json,
        body.clone(),
    )
    .await;
    assert_eq!(unknown.status, 404);
    // An agent registers an engine of model `found`: the default model serves it.
    let engine = Backend::ok().await;
    let record = record_of(&harness.namespace, "found", 9, &engine.url, 16);
    let key = harness.namespace.instance_key("found", InstanceId(9));
    harness.registry.put(&key, &record, None).await.unwrap();
    harness
        .await_metric("kvmesh_discovery_instances{model=\"found\"} 1")
        .await;
    assert_eq!(harness.model_ids().await, ["found"]);
    let served = send(harness.main, Method::POST, "/v1/completions", &json, body).await;
    assert_eq!(served.status, 200);
    assert_eq!(
        served.header("x-kvmesh-instance"),
        Some(engine.url.as_str())
    );
    assert_eq!(engine.requests().len(), 1);
    let (status, body) = health(harness.admin).await;
    assert_eq!((status, &body["status"]), (200, &serde_json::json!("ok")));
}

#[tokio::test]
async fn an_unset_block_size_comes_from_the_first_record_and_another_degrades_health() {
    let harness = Harness::start_with(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\n\
         models:\n  - name: m\n    policy: kv\n    backends: []\n\
         discovery:\n  kind: in_process\nevents:\n  kind: in_process\n  resync_timeout: 1s\n",
    )
    .await;
    let ns = &harness.namespace;
    let (first, second) = (Backend::ok().await, Backend::ok().await);
    let a = prompt(1, 6);
    // The first engine runs blocks of 4 tokens (BLOCK): the model takes them, so its
    // snapshot's blocks match a prompt the proxy cuts into blocks of 4.
    let agent = FakeAgent::serve(&harness.bus, &ns.snapshot_subject(InstanceId(1))).await;
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 6, 100),
        }],
        last_seq: 1,
    });
    let key = |id: u64| ns.instance_key(MODEL, InstanceId(id));
    let one = record_of(ns, MODEL, 1, &first.url, BLOCK as u32);
    harness.registry.put(&key(1), &one, None).await.unwrap();
    harness.await_overlap(&first.url, &a, 6).await;
    let explain = |tokens: Vec<u32>| async move {
        let body = serde_json::json!({"model": MODEL, "prompt": tokens}).to_string();
        let headers = [("content-type", "application/json")];
        let path = "/debug/route?route=completions";
        send(harness.admin, Method::POST, path, &headers, body)
            .await
            .json()
            .await
    };
    assert_eq!(explain(a.clone()).await["block_size"], BLOCK);
    let (status, body) = health(harness.admin).await;
    assert_eq!(
        (status, &body["status"]),
        (200, &serde_json::json!("ok")),
        "{body}"
    );
    assert_eq!(body["models"][0]["kv_block_size"], BLOCK, "{body}");

    // A second engine runs blocks of 8: it is served, scored by predictions alone (its
    // snapshot is not indexed), and the conflict shows in /health, the gauge and the
    // explanation. Readiness is unchanged (200).
    let other = FakeAgent::serve(&harness.bus, &ns.snapshot_subject(InstanceId(2))).await;
    other.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 6, 300),
        }],
        last_seq: 1,
    });
    let two = record_of(ns, MODEL, 2, &second.url, 8);
    harness.registry.put(&key(2), &two, None).await.unwrap();
    harness
        .await_metric(&format!(
            "kvmesh_route_block_size_mismatch{{instance=\"{}\",model=\"m\"}} 1",
            second.url
        ))
        .await;
    harness
        .await_metric(&format!(
            "kvmesh_route_block_size_mismatch{{instance=\"{}\",model=\"m\"}} 0",
            first.url
        ))
        .await;
    harness
        .await_metric("kvmesh_kv_event_batches_dropped_total{reason=\"block_size_mismatch\"} 1")
        .await;
    let (status, body) = health(harness.admin).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["status"], "degraded", "{body}");
    let reasons = body["degraded"].to_string();
    assert!(
        reasons.contains(&second.url) && reasons.contains("8 tokens"),
        "{body}"
    );
    let instances = body["models"][0]["instances"].as_array().unwrap().clone();
    let entry = |url: &str| {
        instances
            .iter()
            .find(|i| i["url"] == url)
            .cloned()
            .unwrap_or_else(|| panic!("no {url} in {body}"))
    };
    assert_eq!(
        entry(&second.url)["block_size_mismatch"],
        serde_json::json!({"engine_block_size": 8, "kv_block_size": BLOCK})
    );
    assert!(entry(&first.url).get("block_size_mismatch").is_none());
    let explained = explain(a.clone()).await;
    let of = |url: &str| {
        explained["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["instance"] == url)
            .cloned()
            .unwrap()
    };
    assert_eq!(of(&second.url)["block_size_mismatch"], 8, "{explained}");
    assert_eq!(of(&second.url)["overlap_blocks"], 0, "{explained}");
    assert_eq!(of(&first.url)["overlap_blocks"], 6, "{explained}");
    assert!(of(&first.url).get("block_size_mismatch").is_none());

    // It leaves: healthy again.
    harness.registry.delete(&key(2)).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (status, body) = health(harness.admin).await;
        if body["status"] == "ok" {
            assert_eq!(status, 200);
            assert!(body.get("degraded").is_none(), "{body}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{body}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn once_no_registered_instance_is_left_the_next_record_sets_the_block_size() {
    let harness = Harness::start_with(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\n\
         models:\n  - name: m\n    policy: kv\n    backends: []\n\
         discovery:\n  kind: in_process\nevents:\n  kind: in_process\n  resync_timeout: 1s\n",
    )
    .await;
    let ns = &harness.namespace;
    let admin = harness.admin;
    let await_block_size = |size: u64| async move {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let (_, body) = health(admin).await;
            if body["models"][0]["kv_block_size"] == size {
                return body;
            }
            assert!(tokio::time::Instant::now() < deadline, "{body}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    await_block_size(16).await;
    let key = |id: u64| ns.instance_key(MODEL, InstanceId(id));
    let put = |id: u64, block_size: u32| {
        let record = record_of(
            ns,
            MODEL,
            id,
            &format!("http://127.0.0.1:{}", 41000 + id),
            block_size,
        );
        let registry = Arc::clone(&harness.registry);
        let key = key(id);
        async move { registry.put(&key, &record, None).await.unwrap() }
    };
    put(1, 8).await;
    await_block_size(8).await;
    harness.registry.delete(&key(1)).await.unwrap();
    await_block_size(16).await;
    put(2, 32).await;
    await_block_size(32).await;
    // The engine restarted with another block size: its record replaces the instance, and
    // as it is the only one, the model takes the new size (nothing is degraded).
    put(2, 64).await;
    let body = await_block_size(64).await;
    assert_eq!(body["status"], "ok", "{body}");
}

/// An engine answering every request with usage whose `cached_tokens` is `cached`'s value.
async fn engine_reporting(cached: Arc<std::sync::atomic::AtomicU64>) -> Backend {
    Backend::start(move |_| {
        let tokens = cached.load(std::sync::atomic::Ordering::Relaxed);
        async move {
            let body = serde_json::json!({
                "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 26, "completion_tokens": 1, "total_tokens": 27,
                          "prompt_tokens_details": {"cached_tokens": tokens}},
            });
            http::Response::builder()
                .header("content-type", "application/json")
                .body(support::full(body.to_string()))
                .unwrap()
        }
    })
    .await
}

#[tokio::test]
async fn answers_that_keep_disagreeing_with_the_index_untrust_the_instance_until_its_resync() {
    let harness = Harness::start().await;
    let cached = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let engine = engine_reporting(Arc::clone(&cached)).await;
    let id = 0xC1;
    let agent = FakeAgent::serve(
        &harness.bus,
        &harness.namespace.snapshot_subject(InstanceId(id)),
    )
    .await;
    let a = prompt(1, 6);
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 6, 100),
        }],
        last_seq: 1,
    });
    harness.register(id, &engine.url).await;
    harness.await_overlap(&engine.url, &a, 6).await;
    harness
        .await_metric("kvmesh_kv_index_source{mode=\"events\",model=\"m\"} 1")
        .await;
    // 26 tokens: the 6 cached blocks and 2 more tokens (vLLM's cap allows all 6 as a hit).
    let mut tokens = a.clone();
    tokens.extend([1, 2]);
    let body = serde_json::json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
    let complete = || async {
        let reply = send(
            harness.main,
            Method::POST,
            "/v1/completions",
            &[("content-type", "application/json")],
            body.clone(),
        )
        .await;
        assert_eq!(reply.status, 200);
        let route = reply
            .header("x-kvmesh-route")
            .unwrap_or_default()
            .to_string();
        reply.text().await.unwrap();
        route
    };
    let answers = |result: &str, n: u64| {
        format!("kvmesh_route_cache_check_answers_total{{model=\"m\",result=\"{result}\"}} {n}\n")
    };
    cached.store(24, std::sync::atomic::Ordering::Relaxed);
    assert!(complete().await.contains("reported_blocks=6"));
    harness.await_metric(&answers("agreed", 1)).await;
    // The engine lost its cache and the index never heard of it: three of the last eight
    // answers disagree, and the instance is resynced. Its agent's snapshot is the truth.
    cached.store(0, std::sync::atomic::Ordering::Relaxed);
    agent.script(SnapshotReply::Snapshot {
        events: Vec::new(),
        last_seq: 1,
    });
    for _ in 0..3 {
        complete().await;
    }
    harness.await_metric(&answers("disagreed", 3)).await;
    harness
        .await_metric("kvmesh_kv_resyncs_total{reason=\"cache_check\"} 1")
        .await;
    let untrusted = format!(
        "kvmesh_route_cache_check_untrusted{{instance=\"{}\",model=\"m\"}} 0\n",
        engine.url
    );
    harness.await_metric(&untrusted).await;
    assert_eq!(
        agent.requests(),
        [SnapshotRequest::full(), SnapshotRequest::full()]
    );
    let mismatches = format!(
        "kvmesh_route_cache_check_mismatches_total{{instance=\"{}\",model=\"m\"}} 3\n",
        engine.url
    );
    assert!(harness.metrics().await.contains(&mismatches));
    // Trusted again, the index holds what the engine holds: the next answer agrees.
    assert!(complete().await.contains("reported_blocks=0"));
    harness.await_metric(&answers("agreed", 2)).await;
}

/// An agent's load report of an idle engine.
fn idle_report(
    id: u64,
    events_complete: bool,
    last_seq: Option<u64>,
) -> kvmesh_control::LoadReport {
    kvmesh_control::LoadReport {
        instance_id: InstanceId(id),
        running: 0,
        waiting: 0,
        kv_usage: 0.0,
        at_ms: 0,
        age_ms: None,
        events_complete,
        last_seq,
    }
}

#[tokio::test]
async fn an_agent_that_lost_events_its_engine_could_not_replay_degrades_its_instance() {
    let harness = Harness::start().await;
    let engine = Backend::ok().await;
    let id = 0xD1;
    let agent = FakeAgent::serve(
        &harness.bus,
        &harness.namespace.snapshot_subject(InstanceId(id)),
    )
    .await;
    let a = prompt(2, 4);
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 4, 200),
        }],
        last_seq: 1,
    });
    harness.register(id, &engine.url).await;
    harness.await_overlap(&engine.url, &a, 4).await;
    let report = |complete: bool| idle_report(id, complete, None);
    let subject = harness.namespace.load_subject(MODEL);
    let gauge = |value: u8| {
        format!(
            "kvmesh_route_kv_events_incomplete{{instance=\"{}\",model=\"m\"}} {value}\n",
            engine.url
        )
    };
    harness
        .bus
        .publish(&subject, Bytes::from(report(false).to_json()))
        .await
        .unwrap();
    harness.await_metric(&gauge(1)).await;
    let (status, degraded) = health(harness.admin).await;
    assert_eq!(status, 200);
    assert_eq!(degraded["status"], "degraded", "{degraded}");
    let line = degraded["degraded"][0].as_str().unwrap();
    assert!(
        line.contains(&engine.url) && line.contains("lost KV events"),
        "{line}"
    );
    assert_eq!(
        degraded["models"][0]["instances"][0]["events_incomplete"],
        true
    );
    // Scored by its predictions alone: its reported blocks are not read.
    harness.await_overlap(&engine.url, &a, 0).await;
    // Whole again (its engine cleared its cache or restarted): precise again.
    harness
        .bus
        .publish(&subject, Bytes::from(report(true).to_json()))
        .await
        .unwrap();
    harness.await_metric(&gauge(0)).await;
    harness.await_overlap(&engine.url, &a, 4).await;
    assert_eq!(health(harness.admin).await.1["status"], "ok");
}

#[tokio::test]
async fn batches_lost_with_no_later_batch_are_found_by_the_agents_load_reports() {
    let harness = Harness::start().await;
    let engine = Backend::ok().await;
    let id = 0xD2;
    let agent = FakeAgent::serve(
        &harness.bus,
        &harness.namespace.snapshot_subject(InstanceId(id)),
    )
    .await;
    let (a, b) = (prompt(4, 4), prompt(5, 4));
    agent.script(SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 4, 200),
        }],
        last_seq: 1,
    });
    harness.register(id, &engine.url).await;
    harness.await_overlap(&engine.url, &a, 4).await;
    // The agent numbered batches 2 and 3 (b's blocks); neither reached the bus, and its
    // engine went idle: no later batch shows the gap. Its load reports say it.
    agent.script(SnapshotReply::Snapshot {
        events: vec![
            RankedEvent {
                dp_rank: 0,
                tier: Default::default(),
                event: stored(&a, 0, 4, 200),
            },
            RankedEvent {
                dp_rank: 0,
                tier: Default::default(),
                event: stored(&b, 0, 4, 300),
            },
        ],
        last_seq: 3,
    });
    let report = idle_report(id, true, Some(3));
    let subject = harness.namespace.load_subject(MODEL);
    for _ in 0..2 {
        harness
            .bus
            .publish(&subject, Bytes::from(report.to_json()))
            .await
            .unwrap();
    }
    harness.await_overlap(&engine.url, &b, 4).await;
    assert_eq!(
        agent.requests(),
        [SnapshotRequest::full(), SnapshotRequest::from_seq(2)]
    );
    harness
        .await_metric("kvmesh_kv_resyncs_total{reason=\"gap\"} 1")
        .await;
}

#[tokio::test]
async fn a_prefill_only_instance_of_a_model_without_disaggregation_takes_no_requests() {
    let harness = Harness::start().await;
    let (prefill, both) = (Backend::ok().await, Backend::ok().await);
    harness
        .register_as(0xE1, &prefill.url, kvmesh_control::InstanceRole::Prefill)
        .await;
    harness.register(0xE2, &both.url).await;
    harness
        .await_metric(&format!(
            "kvmesh_instance_prefill_only_unused{{instance=\"{}\",model=\"m\"}} 1\n",
            prefill.url
        ))
        .await;
    let complete = || async {
        let body = serde_json::json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1});
        send(
            harness.main,
            Method::POST,
            "/v1/completions",
            &[("content-type", "application/json")],
            body.to_string(),
        )
        .await
    };
    for _ in 0..4 {
        assert_eq!(complete().await.status, 200);
    }
    assert_eq!(both.requests().len(), 4);
    assert!(prefill.requests().is_empty(), "no whole request");
    let (status, degraded) = health(harness.admin).await;
    assert_eq!((status, &degraded["status"]), (200, &"degraded".into()));
    let line = degraded["degraded"][0].as_str().unwrap();
    assert!(
        line.contains(&prefill.url) && line.contains("prefill only"),
        "{line}"
    );
    // Only the prefill-only instance left: 503, naming the cause.
    harness
        .registry
        .delete(&harness.namespace.instance_key(MODEL, InstanceId(0xE2)))
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let reply = loop {
        let reply = complete().await;
        if reply.status != 200 || tokio::time::Instant::now() > deadline {
            break reply;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(reply.status, 503);
    let error = reply.json().await;
    assert_eq!(error["error"]["code"], "only_prefill_instances", "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--role prefill")
    );
    assert!(prefill.requests().is_empty());
    assert_eq!(
        health(harness.admin).await.0,
        503,
        "nothing serves the model"
    );
}

#[tokio::test]
async fn hostile_well_formed_batches_are_counted_and_change_nothing_else() {
    let harness = Harness::start().await;
    let engine = Backend::ok().await;
    let id = 0xB7;
    let agent = FakeAgent::serve(
        &harness.bus,
        &harness.namespace.snapshot_subject(InstanceId(id)),
    )
    .await;
    let a = prompt(7, 4);
    let truth = || SnapshotReply::Snapshot {
        events: vec![RankedEvent {
            dp_rank: 0,
            tier: Default::default(),
            event: stored(&a, 0, 2, 100),
        }],
        last_seq: 3,
    };
    agent.script(truth());
    harness.register(id, &engine.url).await;
    harness.await_overlap(&engine.url, &a, 2).await;
    harness
        .await_metric("kvmesh_kv_index_source{mode=\"events\",model=\"m\"} 1")
        .await;
    let index = format!(
        "kvmesh_index_blocks{{instance=\"{}\",model=\"m\"}} 2",
        engine.url
    );

    // A stale batch (numbered 2, before the snapshot's 3) naming blocks the engine does not
    // hold: dropped.
    harness
        .publish(&batch(id, 2, vec![stored(&a, 2, 4, 100)]))
        .await;
    harness
        .await_metric("kvmesh_kv_event_batches_dropped_total{reason=\"stale\"} 1")
        .await;
    // Removals of blocks nobody stored: applied, counted, nothing removed.
    harness
        .publish(&batch(
            id,
            4,
            vec![KvEvent::Removed {
                blocks: vec![ExternalHash(9_999)],
            }],
        ))
        .await;
    harness
        .await_metric(
            "kvmesh_kv_events_applied_total{event_type=\"removed\",model=\"m\",status=\"block_not_found\"} 1",
        )
        .await;
    // A rank the instance does not have (it registered one): dropped, counted.
    let mut other_rank = batch(id, 5, vec![stored(&a, 2, 4, 100)]);
    other_rank.dp_rank = 3;
    harness.publish(&other_rank).await;
    harness
        .await_metric("kvmesh_kv_event_batches_dropped_total{reason=\"unknown_rank\"} 1")
        .await;
    assert_eq!(harness.overlaps(&a).await, [(engine.url.clone(), 2)]);
    // Blocks under a parent nobody stored: held apart (they match nothing), counted, and
    // the instance is resynced, which restores exactly what its engine holds.
    agent.script(truth());
    harness
        .publish(&batch(
            id,
            6,
            vec![KvEvent::stored(
                Some(BlockParent {
                    external: ExternalHash(5_555),
                    sequence: SequenceHash(42),
                }),
                [(ExternalHash(7_777), LocalBlockHash(7))],
            )],
        ))
        .await;
    harness
        .await_metric(
            "kvmesh_kv_events_applied_total{event_type=\"stored\",model=\"m\",status=\"parent_not_found\"} 1",
        )
        .await;
    harness
        .await_metric("kvmesh_kv_resyncs_total{reason=\"repair\"} 1")
        .await;
    harness.await_metric(&index).await;
    assert_eq!(harness.overlaps(&a).await, [(engine.url.clone(), 2)]);
    // The agent's next batch goes on from the snapshot as if nothing had come between.
    harness
        .publish(&batch(id, 4, vec![stored(&a, 2, 3, 100)]))
        .await;
    harness.await_overlap(&engine.url, &a, 3).await;
}
