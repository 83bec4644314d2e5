//! A 200,000-block snapshot resync into the real `kvmesh-proxy` process, blocks named by their
//! own sequence hashes as the worker-agent names them: the index holds exactly the snapshot's
//! blocks, and the proxy's resident memory grows by at most 1.5 times the index's own heap
//! bytes (the same index built in this process, its bytes from `KvIndex::heap_bytes`, which
//! `kv/tests/heap_bytes.rs` holds to a counting allocator). The proxy applies each part of the
//! snapshot as it arrives and returns the free heap to the system once the resync is applied:
//! it grew 1.27-1.35 times (8.4-8.9 MB for 6.6 MB, three idle runs; 1.23-1.34 idle and with
//! both cores busy when the index took 8.1 MB, before owners kept their counts in the block).
//! Part of that growth is a fixed ≈ 2 MB (decoded parts in flight, allocator arenas), so the
//! snapshot is large enough for the ratio to mean something: 100,000 blocks (then 4.2 MB) grew
//! 6.4 MB. Holding
//! the decoded parts until the last one was in, and keeping the free heap, it had grown up to
//! 1.77 times.

use std::time::Duration;

use bytes::Bytes;
use kvmesh_control::testing::{EtcdServer, NatsServer};
use kvmesh_control::{
    EtcdRegistry, EventBus, InstanceId, InstanceRecord, InstanceRole, InstanceState, Namespace,
    NatsBus, RankedEvent, Registry, SnapshotReply, reply_parts,
};
use kvmesh_e2e::cluster::{MODEL, engine_urls, start_engines, start_proxy};
use kvmesh_e2e::control_plane::{BLOCK_SIZE, await_metric, control_proxy_config_for};
use kvmesh_e2e::{HttpClient, ScratchDir};
use kvmesh_kv::{ExternalHash, KvEvent, KvIndex, LocalBlockHash, WorkerKey};

/// Blocks in the snapshot: 2,000 chains of 100.
const CHAINS: u64 = 2_000;
const CHAIN_BLOCKS: u64 = 100;

/// The snapshot's Stored events: chain `c` holds blocks of local hash `c × 100 + i + 1`, each
/// named by its own sequence hash, as the worker-agent names blocks.
fn snapshot_events() -> Vec<KvEvent> {
    (0..CHAINS)
        .map(|chain| {
            let mut event = KvEvent::stored(
                None,
                (0..CHAIN_BLOCKS).map(|i| {
                    let n = chain * CHAIN_BLOCKS + i + 1;
                    (
                        ExternalHash(0),
                        LocalBlockHash(n.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                    )
                }),
            );
            if let KvEvent::Stored { blocks, .. } = &mut event {
                for block in blocks {
                    block.external = ExternalHash::own(block.sequence);
                }
            }
            event
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200k_block_snapshot_fills_the_index_exactly_within_its_own_bytes() -> anyhow::Result<()>
{
    let total = CHAINS * CHAIN_BLOCKS;
    // The index's own bytes: the same events applied to an index in this process.
    let events = snapshot_events();
    let index = KvIndex::new();
    for event in &events {
        index.apply(WorkerKey::new(1, 0), event);
    }
    let index_bytes = index.heap_bytes() as u64;
    assert_eq!(index.stats().distinct_blocks as u64, total);
    drop(index);

    let scratch = ScratchDir::new("index-memory")?;
    let etcd = EtcdServer::start(&scratch.path().join("etcd")).await?;
    let nats = NatsServer::start(&scratch.path().join("nats")).await?;
    let sims = start_engines(&scratch, 1, &["--no-delay"])?;
    let engine = engine_urls(&sims).remove(0);
    let proxy = start_proxy(
        &scratch,
        &control_proxy_config_for(&etcd.url(), &nats.url(), ""),
    )?;
    let client = HttpClient::default();
    let metrics = format!("{}/metrics", proxy.url("admin"));
    await_metric(
        &client,
        &metrics,
        "kvmesh_events_connected",
        |v| v == 1.0,
        Duration::from_secs(15),
    )
    .await?;

    // A stand-in agent: it answers the proxy's first resync with the whole snapshot, in the
    // parts NATS's payload limit allows, as an agent does.
    let namespace = Namespace::default();
    let id = InstanceId(0x00c0_ffee_0000_0001);
    let bus = NatsBus::connect(&nats.url(), "kvmesh-e2e-agent").await?;
    let mut requests = bus.serve(&namespace.snapshot_subject(id)).await?;
    let reply = SnapshotReply::Snapshot {
        events: events
            .into_iter()
            .map(|event| RankedEvent {
                dp_rank: 0,
                tier: Default::default(),
                event,
            })
            .collect(),
        last_seq: 0,
    };
    let parts = reply_parts(&reply, 512 * 1024)?;
    drop(reply);
    let answering = tokio::spawn(async move {
        let mut answered = 0;
        while let Some(request) = requests.next().await {
            for part in &parts {
                bus.reply(&request, Bytes::clone(part)).await?;
            }
            answered += 1;
        }
        anyhow::Ok(answered)
    });

    let baseline = proxy.rss_bytes();
    let registry = EtcdRegistry::new(&etcd.url())?;
    let record = InstanceRecord {
        instance_id: id,
        model: MODEL.to_string(),
        url: engine.clone(),
        protocol: "http1".to_string(),
        block_size: BLOCK_SIZE as u32,
        total_blocks: 2 * total,
        dp_ranks: 1,
        labels: Default::default(),
        adapters: Vec::new(),
        event_subject: namespace.event_subject(MODEL),
        snapshot_subject: namespace.snapshot_subject(id),
        state: InstanceState::Ready,
        role: InstanceRole::Both,
    };
    registry
        .put(&namespace.instance_key(MODEL, id), &record, None)
        .await?;
    let series = format!("kvmesh_index_blocks{{instance=\"{engine}\",model=\"{MODEL}\"}}");
    await_metric(
        &client,
        &metrics,
        &series,
        |v| v == total as f64,
        Duration::from_secs(60),
    )
    .await?;
    // The proxy returns the resync's free heap to the system just after applying the last
    // part: the resident set settles within moments of the index being full.
    let bound = index_bytes as f64 * 1.5;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let grown = loop {
        let grown = proxy.rss_bytes().saturating_sub(baseline);
        if grown as f64 <= bound || tokio::time::Instant::now() >= deadline {
            break grown;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "the proxy grew by {} KB for an index of {} KB",
        grown >> 10,
        index_bytes >> 10
    );
    assert!(
        grown as f64 <= bound,
        "the proxy grew by {} KB for an index of {} KB ({:.0} B per block)",
        grown >> 10,
        index_bytes >> 10,
        index_bytes as f64 / total as f64
    );
    answering.abort();
    Ok(())
}
