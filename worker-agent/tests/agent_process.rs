//! The `kvmesh-agent` binary against real etcd and nats-server processes and an engine-sim
//! engine (in process, over real HTTP and ZMQ sockets).

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_control::{
    ConnectionState, EtcdRegistry, EventBatch, EventBus, InstanceState, LoadReport, Namespace,
    Registry, ReplyAssembler, SnapshotReply, SnapshotRequest, Subscription, WatchEvent,
};
use kvmesh_engine_sim::{KvEventEncoding, KvEventHash};
use kvmesh_kv::KvEvent;
use support::*;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const SECOND: Duration = Duration::from_secs(1);

async fn resync(
    bus: &kvmesh_control::NatsBus,
    instance: &str,
    request: SnapshotRequest,
) -> SnapshotReply {
    let id = instance.parse().expect("instance id");
    let reply = bus
        .request(
            &Namespace::default().snapshot_subject(id),
            Bytes::from(request.to_json()),
            5 * SECOND,
        )
        .await
        .expect("resync reply");
    SnapshotReply::from_json(&reply).expect("valid reply")
}

fn snapshot_sequences(reply: &SnapshotReply) -> Vec<u64> {
    let SnapshotReply::Snapshot { events, .. } = reply else {
        panic!("expected a snapshot, got {reply:?}");
    };
    events
        .iter()
        .flat_map(|e| match &e.event {
            KvEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.sequence.0).collect(),
            _ => Vec::new(),
        })
        .collect()
}

async fn events_translated_published_and_resynced(encoding: KvEventEncoding, hash: KvEventHash) {
    let mut servers = Servers::start("events").await;
    let engine = engine(encoding, hash).await;
    let engine_addr = engine.local_addr();
    let bus = servers.bus().await;
    let mut sub = bus.subscribe(&event_subject()).await.expect("subscribe");
    let mut loads = bus
        .subscribe(&Namespace::default().load_subject(MODEL))
        .await
        .expect("subscribe load");
    let events = format!("tcp://{}", engine.kv_events_addr().expect("events addr"));
    let replay = format!("tcp://{}", engine.kv_replay_addr().expect("replay addr"));
    let engine_url = format!("http://{engine_addr}");
    let agent = AgentProcess::start(&servers, &engine_url, &events, Some(&replay), &[]).await;

    // Registered in etcd with the contract's record.
    let ns = Namespace::default();
    let reg = EtcdRegistry::new(&servers.etcd.url()).expect("etcd client");
    let listing = reg.list(&ns.instances_prefix()).await.expect("list");
    assert_eq!(listing.records.len(), 1);
    let (key, record) = &listing.records[0];
    assert_eq!(record.instance_id.to_string(), agent.instance_id);
    assert_eq!(key, &ns.instance_key(MODEL, record.instance_id));
    assert_eq!(record.url, engine_url);
    assert_eq!((record.block_size, record.dp_ranks), (BLOCK as u32, 1));
    assert_eq!(record.event_subject, "kvmesh.kv.test%2Fmodel%2Ev1");
    assert_eq!(
        record.snapshot_subject,
        ns.snapshot_subject(record.instance_id)
    );
    assert_eq!(record.state, InstanceState::Ready);

    // A served prompt's blocks arrive with kvmesh's hashes of the same tokens.
    let first = prompt(1, 4);
    let expected = kvmesh_hashes(&first);
    complete(engine_addr, &first).await;
    let (mut seen, mut batches) = (Vec::new(), Vec::new());
    collect_until(&mut sub, &mut seen, &mut batches, |s| {
        expected.iter().all(|h| s.contains(h))
    })
    .await;
    for (i, b) in batches.iter().enumerate() {
        assert_eq!(b.seq, i as u64 + 1, "gap-free seq from 1");
        assert_eq!((b.instance_id, b.dp_rank), (record.instance_id, 0));
    }

    // Resync: the ring buffer replays what was published; a full snapshot holds the blocks.
    let replayed = resync(&bus, &agent.instance_id, SnapshotRequest::from_seq(1)).await;
    let SnapshotReply::Events {
        batches: ring,
        last_seq,
    } = &replayed
    else {
        panic!("expected events, got {replayed:?}");
    };
    assert_eq!(ring, &batches);
    assert_eq!(*last_seq, batches.len() as u64);
    let snapshot = resync(&bus, &agent.instance_id, SnapshotRequest::full()).await;
    let held = snapshot_sequences(&snapshot);
    assert!(
        expected.iter().all(|h| held.contains(h)),
        "snapshot {held:x?}"
    );
    assert_eq!(snapshot.last_seq(), *last_seq);

    // A batch the engine drops is recovered from its replay socket at the next one.
    fault(engine_addr, r#"{"drop_batches": 1}"#).await;
    let dropped = prompt(2, 3);
    complete(engine_addr, &dropped).await;
    let after = prompt(3, 2);
    complete(engine_addr, &after).await;
    let wanted: Vec<u64> = kvmesh_hashes(&dropped)
        .into_iter()
        .chain(kvmesh_hashes(&after))
        .collect();
    collect_until(&mut sub, &mut seen, &mut batches, |s| {
        wanted.iter().all(|h| s.contains(h))
    })
    .await;
    assert_eq!(
        agent.metric("kvmesh_agent_engine_seq_gaps_total").await,
        1.0
    );
    assert_eq!(
        agent
            .metric("kvmesh_agent_replays_total{result=\"ok\"}")
            .await,
        1.0
    );
    assert_eq!(
        agent.metric("kvmesh_agent_translation_misses_total").await,
        0.0
    );
    assert_eq!(agent.metric("kvmesh_agent_malformed_total").await, 0.0);

    // Load reports from the engine's /metrics.
    let report = tokio::time::timeout(5 * SECOND, loads.next())
        .await
        .expect("load report in time")
        .expect("subscription open");
    let report = LoadReport::from_json(&report.payload).expect("valid load report");
    assert_eq!(report.instance_id, record.instance_id);
    assert!(report.at_ms > 0);
    // Scraped moments before it was published, on the agent's own clock.
    let age_ms = report.age_ms.expect("a report carries its age");
    assert!(
        age_ms < 5_000,
        "scraped {age_ms} ms before it was published"
    );

    // NATS restarts: the agent reconnects and goes on; what it could not publish meanwhile
    // is in its ring buffer.
    let last_seen = batches.last().map_or(0, |b| b.seq);
    servers.nats.restart().await.expect("nats restarts");
    let mut state = bus.connection_state();
    tokio::time::timeout(
        15 * SECOND,
        state.wait_for(|s| matches!(s, ConnectionState::Connected { epoch } if *epoch >= 2)),
    )
    .await
    .expect("test client reconnected")
    .expect("state open");
    let mut next = None;
    for i in 0..20u32 {
        complete(engine_addr, &prompt(10 + i, 1)).await;
        if let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(500), sub.next()).await {
            next = Some(EventBatch::from_json(&msg.payload).expect("valid batch"));
            break;
        }
    }
    let next = next.expect("the agent publishes again after NATS restarted");
    assert!(next.seq > last_seen);
    let missed = resync(
        &bus,
        &agent.instance_id,
        SnapshotRequest::from_seq(last_seen + 1),
    )
    .await;
    let SnapshotReply::Events {
        batches: missed, ..
    } = missed
    else {
        panic!("expected events");
    };
    let seqs: Vec<u64> = missed.iter().map(|b| b.seq).collect();
    let expected_seqs: Vec<u64> = (last_seen + 1..=last_seen + seqs.len() as u64).collect();
    assert_eq!(seqs, expected_seqs);
    assert!(seqs.contains(&next.seq));
    drop(agent);
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn positional_int_hashes_translate_publish_and_resync() {
    events_translated_published_and_resynced(KvEventEncoding::Positional, KvEventHash::Int).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn map_byte_hashes_translate_publish_and_resync() {
    events_translated_published_and_resynced(KvEventEncoding::Map, KvEventHash::Bytes).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_after_the_engine_catches_up_from_its_replay_buffer() {
    let servers = Servers::start("late").await;
    let engine = engine(KvEventEncoding::Positional, KvEventHash::Int).await;
    let engine_addr = engine.local_addr();
    // Cached before the agent exists.
    complete(engine_addr, &prompt(1, 3)).await;
    complete(engine_addr, &prompt(2, 2)).await;
    let bus = servers.bus().await;
    let mut sub = bus.subscribe(&event_subject()).await.expect("subscribe");
    let events = format!("tcp://{}", engine.kv_events_addr().expect("events addr"));
    let replay = format!("tcp://{}", engine.kv_replay_addr().expect("replay addr"));
    let agent = AgentProcess::start(
        &servers,
        &format!("http://{engine_addr}"),
        &events,
        Some(&replay),
        &[],
    )
    .await;
    // Extends the first prompt: its new block's parent was stored before the agent started.
    let longer = prompt(1, 5);
    complete(engine_addr, &longer).await;
    let expected: Vec<u64> = kvmesh_hashes(&longer)
        .into_iter()
        .chain(kvmesh_hashes(&prompt(2, 2)))
        .collect();
    let (mut seen, mut batches) = (Vec::new(), Vec::new());
    collect_until(&mut sub, &mut seen, &mut batches, |s| {
        expected.iter().all(|h| s.contains(h))
    })
    .await;
    assert_eq!(
        agent.metric("kvmesh_agent_translation_misses_total").await,
        0.0
    );
    assert_eq!(
        agent
            .metric("kvmesh_agent_replays_total{result=\"ok\"}")
            .await,
        1.0
    );
    let snapshot = resync(&bus, &agent.instance_id, SnapshotRequest::full()).await;
    let held = snapshot_sequences(&snapshot);
    assert!(
        expected.iter().all(|h| held.contains(h)),
        "snapshot {held:x?}"
    );
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_whose_engine_buffer_no_longer_reaches_back_reports_its_view_incomplete() {
    let servers = Servers::start("lossy").await;
    let engine = engine_keeping(KvEventEncoding::Positional, KvEventHash::Int, Some(1)).await;
    let engine_addr = engine.local_addr();
    // Two batches before the agent exists; the engine's buffer keeps only the last.
    complete(engine_addr, &prompt(1, 3)).await;
    complete(engine_addr, &prompt(2, 2)).await;
    let bus = servers.bus().await;
    let mut loads = bus
        .subscribe(&Namespace::default().load_subject(MODEL))
        .await
        .expect("subscribe");
    let events = format!("tcp://{}", engine.kv_events_addr().expect("events addr"));
    let replay = format!("tcp://{}", engine.kv_replay_addr().expect("replay addr"));
    let agent = AgentProcess::start(
        &servers,
        &format!("http://{engine_addr}"),
        &events,
        Some(&replay),
        &[],
    )
    .await;
    assert_eq!(
        agent
            .metric("kvmesh_agent_replays_total{result=\"incomplete\"}")
            .await,
        1.0
    );
    assert_eq!(agent.metric("kvmesh_agent_kv_events_complete").await, 0.0);
    assert!(!next_report(&mut loads).await.events_complete);
    // The engine clears its cache (AllBlocksCleared): nothing lost matters any more.
    let (status, _) = http(engine_addr, "POST", "/reset_prefix_cache", "").await;
    assert_eq!(status, 200);
    complete(engine_addr, &prompt(3, 1)).await;
    let deadline = tokio::time::Instant::now() + 10 * SECOND;
    while !next_report(&mut loads).await.events_complete {
        assert!(tokio::time::Instant::now() < deadline, "never whole again");
    }
    assert_eq!(agent.metric("kvmesh_agent_kv_events_complete").await, 1.0);
    engine.stop().await;
}

/// The next load report on `loads`.
async fn next_report(loads: &mut kvmesh_control::Subscription) -> LoadReport {
    let message = tokio::time::timeout(5 * SECOND, loads.next())
        .await
        .expect("load report in time")
        .expect("subscription open");
    LoadReport::from_json(&message.payload).expect("valid load report")
}

/// A msgpack batch `[ts, [["BlockStored", [ids], nil, tokens, 16]], 0]`.
fn stored_batch(ids: &[u64], tokens: &[u32]) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = rmp::encode::write_array_len(&mut out, 3);
    let _ = rmp::encode::write_f64(&mut out, 1.0);
    let _ = rmp::encode::write_array_len(&mut out, 1);
    let _ = rmp::encode::write_array_len(&mut out, 5);
    let _ = rmp::encode::write_str(&mut out, "BlockStored");
    let _ = rmp::encode::write_array_len(&mut out, ids.len() as u32);
    for &id in ids {
        let _ = rmp::encode::write_uint(&mut out, id);
    }
    let _ = rmp::encode::write_nil(&mut out);
    let _ = rmp::encode::write_array_len(&mut out, tokens.len() as u32);
    for &t in tokens {
        let _ = rmp::encode::write_uint(&mut out, u64::from(t));
    }
    let _ = rmp::encode::write_uint(&mut out, BLOCK as u64);
    let _ = rmp::encode::write_uint(&mut out, 0);
    out
}

fn message(frames: Vec<Vec<u8>>) -> ZmqMessage {
    let mut frames = frames.into_iter().map(Bytes::from);
    let mut msg = ZmqMessage::from(frames.next().unwrap_or_default());
    for f in frames {
        msg.push_back(f);
    }
    msg
}

/// An agent reading engine events from a PUB socket of the test's, beside a real engine (for
/// its health and metrics), with a NATS client subscribed to the model's event subject.
struct TestPublisher {
    /// etcd and NATS (dropped last).
    servers: Servers,
    engine: kvmesh_engine_sim::EngineHandle,
    publisher: PubSocket,
    bus: kvmesh_control::NatsBus,
    sub: Subscription,
    agent: AgentProcess,
}

impl TestPublisher {
    async fn start(name: &str) -> Self {
        let servers = Servers::start(name).await;
        let engine = engine(KvEventEncoding::Positional, KvEventHash::Int).await;
        let mut publisher = PubSocket::new();
        let endpoint = publisher
            .bind("tcp://127.0.0.1:0")
            .await
            .expect("bind")
            .to_string();
        let bus = servers.bus().await;
        let sub = bus.subscribe(&event_subject()).await.expect("subscribe");
        let agent = AgentProcess::start(
            &servers,
            &format!("http://{}", engine.local_addr()),
            &endpoint,
            None,
            &[],
        )
        .await;
        Self {
            servers,
            engine,
            publisher,
            bus,
            sub,
            agent,
        }
    }
}

/// Until the agent's subscription has reached the PUB socket, messages are lost: sends a
/// valid store of `probe` (block id 1) until the agent publishes it, and returns that batch.
async fn probe_until_forwarded(
    publisher: &mut PubSocket,
    sub: &mut Subscription,
    seq: &mut u64,
    probe: &[u32],
) -> EventBatch {
    let sent_from = unix_ms();
    let (published, at_ms) = tokio::time::timeout(10 * SECOND, async {
        loop {
            let frames = vec![
                b"".to_vec(),
                seq.to_be_bytes().to_vec(),
                stored_batch(&[1], probe),
            ];
            publisher.send(message(frames)).await.expect("send");
            *seq += 1;
            if let Ok(Some(msg)) =
                tokio::time::timeout(Duration::from_millis(100), sub.next()).await
            {
                return EventBatch::from_json_at(&msg.payload).expect("valid batch");
            }
        }
    })
    .await
    .expect("the agent receives the probe");
    assert_eq!(stored_sequences(&published), kvmesh_hashes(probe));
    // A live batch carries when the agent numbered it, for the proxies' lag histogram.
    let at_ms = at_ms.expect("a live batch carries at_ms");
    assert!(
        (sent_from..=unix_ms()).contains(&at_ms),
        "at_ms {at_ms} outside the probe's time"
    );
    published
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_malformed_messages_are_counted_and_skipped() {
    let TestPublisher {
        servers: _servers,
        engine,
        mut publisher,
        bus: _bus,
        mut sub,
        agent,
    } = TestPublisher::start("malformed").await;

    let probe = prompt(1, 1);
    let mut seq = 0u64;
    let published = probe_until_forwarded(&mut publisher, &mut sub, &mut seq, &probe).await;

    let garbage = |i: u64, seq: u64| -> Vec<Vec<u8>> {
        let seq = seq.to_be_bytes().to_vec();
        match i % 5 {
            0 => vec![b"".to_vec(), seq, format!("garbage {i}").into_bytes()],
            1 => vec![b"".to_vec(), seq, vec![0xc1, 0x00, 0xff]],
            2 => vec![b"".to_vec(), seq, stored_batch(&[i], &probe)[..7].to_vec()],
            3 => vec![b"".to_vec(), b"seq".to_vec(), stored_batch(&[i], &probe)],
            _ => vec![b"".to_vec(), seq],
        }
    };
    let total = 10_000u64;
    let started = Instant::now();
    for chunk in 0..(total / 1000) {
        for i in chunk * 1000..(chunk + 1) * 1000 {
            let frames = garbage(i, seq);
            seq += 1;
            publisher.send(message(frames)).await.expect("send");
        }
        let want = ((chunk + 1) * 1000) as f64;
        let deadline = Instant::now() + 10 * SECOND;
        while agent.metric("kvmesh_agent_malformed_total").await < want {
            assert!(
                Instant::now() < deadline,
                "malformed messages not all counted:\n{}",
                agent.metrics().await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(
        agent.metric("kvmesh_agent_malformed_total").await,
        total as f64
    );
    eprintln!(
        "10,000 malformed messages handled in {:?}",
        started.elapsed()
    );

    // The agent is still alive and translating.
    let after = prompt(2, 2);
    let frames = vec![
        b"".to_vec(),
        seq.to_be_bytes().to_vec(),
        stored_batch(&[7, 8], &after),
    ];
    publisher.send(message(frames)).await.expect("send");
    let msg = tokio::time::timeout(5 * SECOND, sub.next())
        .await
        .expect("batch after garbage")
        .expect("subscription open");
    let batch = EventBatch::from_json(&msg.payload).expect("valid batch");
    assert_eq!(stored_sequences(&batch), kvmesh_hashes(&after));
    assert_eq!(
        batch.seq,
        published.seq + 1,
        "garbage consumed no seq numbers"
    );
    let (status, _) = http(agent.addr, "GET", "/health", "").await;
    assert_eq!(status, 200);
    engine.stop().await;
}

async fn next_change(watch: &mut kvmesh_control::Watch, secs: u64) -> WatchEvent {
    loop {
        let event = tokio::time::timeout(Duration::from_secs(secs), watch.next())
            .await
            .expect("registry change in time")
            .expect("watch open");
        if !matches!(event, WatchEvent::Synced | WatchEvent::Disconnected) {
            return event;
        }
    }
}

fn put_state(event: &WatchEvent) -> Option<InstanceState> {
    match event {
        WatchEvent::Put { record, .. } => Some(record.state),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_follows_health_leases_and_signals() {
    let mut servers = Servers::start("registration").await;
    let engine = engine(KvEventEncoding::Positional, KvEventHash::Int).await;
    let engine_url = format!("http://{}", engine.local_addr());
    let events = format!("tcp://{}", engine.kv_events_addr().expect("events addr"));
    let reg = EtcdRegistry::new(&servers.etcd.url()).expect("etcd client");
    let ns = Namespace::default();
    let mut watch = reg.watch(&ns.instances_prefix());
    assert_eq!(next_change_or_synced(&mut watch).await, WatchEvent::Synced);
    let flags = ["--lease-ttl", "2s", "--drain", "1s"];

    // kill -9: the record disappears within the lease TTL.
    let mut doomed = AgentProcess::start(&servers, &engine_url, &events, None, &flags).await;
    assert_eq!(
        put_state(&next_change(&mut watch, 5).await),
        Some(InstanceState::Ready)
    );
    let killed = Instant::now();
    doomed.child.start_kill().expect("kill -9");
    assert!(matches!(
        next_change(&mut watch, 10).await,
        WatchEvent::Delete { .. }
    ));
    assert!(
        killed.elapsed() < 5 * SECOND,
        "deleted after {:?}",
        killed.elapsed()
    );

    let agent = AgentProcess::start(&servers, &engine_url, &events, None, &flags).await;
    assert_eq!(
        put_state(&next_change(&mut watch, 5).await),
        Some(InstanceState::Ready)
    );

    // etcd loses everything: the watch reports the record gone, then the agent notices its
    // lost lease and registers again.
    servers
        .etcd
        .restart_empty()
        .await
        .expect("etcd restarts empty");
    let mut event = next_change(&mut watch, 20).await;
    if matches!(event, WatchEvent::Delete { .. }) {
        event = next_change(&mut watch, 20).await;
    }
    assert_eq!(
        put_state(&event),
        Some(InstanceState::Ready),
        "{event:?}\n{}",
        agent.logs()
    );

    // The engine goes away: not ready (the record stays).
    engine.stop().await;
    assert_eq!(
        put_state(&next_change(&mut watch, 10).await),
        Some(InstanceState::NotReady)
    );

    // SIGTERM: draining first, deregistered after the drain period.
    agent.signal("-TERM");
    assert_eq!(
        put_state(&next_change(&mut watch, 5).await),
        Some(InstanceState::Draining)
    );
    let draining = Instant::now();
    assert!(matches!(
        next_change(&mut watch, 10).await,
        WatchEvent::Delete { .. }
    ));
    assert!(
        draining.elapsed() >= Duration::from_millis(800),
        "drained only {:?}",
        draining.elapsed()
    );
    let mut agent = agent;
    let status = tokio::time::timeout(10 * SECOND, agent.child.wait())
        .await
        .expect("agent exits")
        .expect("status");
    assert!(status.success(), "agent exit status {status}");
}

async fn next_change_or_synced(watch: &mut kvmesh_control::Watch) -> WatchEvent {
    tokio::time::timeout(5 * SECOND, watch.next())
        .await
        .expect("watch event in time")
        .expect("watch open")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100k_block_snapshot_reaches_the_requester_in_parts_under_the_payload_limit() {
    let TestPublisher {
        servers: _servers,
        engine,
        mut publisher,
        bus,
        mut sub,
        agent,
    } = TestPublisher::start("big-snapshot").await;
    let mut seq = 0u64;
    let probe = probe_until_forwarded(&mut publisher, &mut sub, &mut seq, &prompt(1, 1)).await;

    // 17 prompts of 6,000 blocks (96k tokens each): 102,000 blocks, about 9 MiB of
    // snapshot against nats-server's default max_payload of 1 MiB.
    let (prompts, blocks_each) = (17u64, 6_000u64);
    for p in 0..prompts {
        let ids: Vec<u64> = (0..blocks_each).map(|b| 1_000_000 * (p + 1) + b).collect();
        let tokens: Vec<u32> = (0..(blocks_each as usize * BLOCK) as u32)
            .map(|t| t.wrapping_mul(2_654_435_761).wrapping_add(p as u32))
            .collect();
        let frames = vec![
            b"".to_vec(),
            seq.to_be_bytes().to_vec(),
            stored_batch(&ids, &tokens),
        ];
        seq += 1;
        publisher.send(message(frames)).await.expect("send");
        let msg = tokio::time::timeout(10 * SECOND, sub.next())
            .await
            .expect("the agent publishes the prompt's blocks")
            .expect("subscription open");
        let batch = EventBatch::from_json(&msg.payload).expect("valid batch");
        assert_eq!(batch.seq, probe.seq + p + 1);
    }

    let limit = bus.max_payload();
    let subject = Namespace::default().snapshot_subject(agent.instance_id.parse().expect("id"));
    let mut replies = bus
        .request_replies(&subject, Bytes::from(SnapshotRequest::full().to_json()))
        .await
        .expect("request");
    let mut assembler = ReplyAssembler::new();
    let mut parts = 0;
    let reply = loop {
        let part = tokio::time::timeout(10 * SECOND, replies.next())
            .await
            .expect("the next part in time")
            .expect("replies open");
        parts += 1;
        assert!(
            part.payload.len() <= limit,
            "a part of {} bytes",
            part.payload.len()
        );
        if let Some(reply) = assembler.push(&part.payload).expect("a valid part") {
            break reply;
        }
    };
    assert!(parts > 5, "{parts} parts");
    assert_eq!(reply.last_seq(), probe.seq + prompts);
    let sequences = snapshot_sequences(&reply);
    assert_eq!(sequences.len() as u64, 1 + prompts * blocks_each);
    let unique: std::collections::HashSet<u64> = sequences.iter().copied().collect();
    assert_eq!(unique.len(), sequences.len());
    assert_eq!(
        agent
            .metric("kvmesh_agent_resync_requests_total{kind=\"snapshot\"}")
            .await,
        1.0
    );
    engine.stop().await;
}
