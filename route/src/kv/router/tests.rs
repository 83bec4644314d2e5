//! The router end to end on fake instances: decisions, bookings, thresholds, explanations.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use kvmesh_config::KvRoutingConfig;
use prometheus::{Encoder, Registry, TextEncoder};
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;
use crate::candidates::{Candidates, Excluded};
use crate::metrics::KvFamilies;
use crate::prepare::{FallbackReason, PromptKind};

const BLOCK: usize = 4;

/// An instance that is never contacted.
#[derive(Debug)]
struct Fake {
    id: u64,
    url: String,
    in_flight: AtomicU64,
    healthy: AtomicBool,
}

impl Fake {
    /// Counts a request in flight until the guard drops.
    fn start_request(&self) -> InFlight<'_> {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self)
    }

    fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Relaxed);
    }
}

impl Candidate for Fake {
    fn id(&self) -> u64 {
        self.id
    }

    fn url(&self) -> &str {
        &self.url
    }

    fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    fn is_available(&self, _now_ms: u64) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

/// One request in flight on a [`Fake`].
struct InFlight<'a>(&'a Fake);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn instances(n: usize) -> Vec<Arc<Fake>> {
    (0..n)
        .map(|i| {
            Arc::new(Fake {
                id: i as u64,
                url: format!("http://127.0.0.1:{}", 9000 + i),
                in_flight: AtomicU64::new(0),
                healthy: AtomicBool::new(true),
            })
        })
        .collect()
}

fn router_with(config: KvRoutingConfig, n: usize) -> (KvRouter, Vec<Arc<Fake>>) {
    let (router, instances, _) = router_and_metrics(config, n);
    (router, instances)
}

fn router_and_metrics(config: KvRoutingConfig, n: usize) -> (KvRouter, Vec<Arc<Fake>>, Registry) {
    let registry = Registry::new();
    let families = KvFamilies::register(&registry).unwrap();
    let instances = instances(n);
    let router = KvRouter::new(&config, None, false, false, families.model("m")).unwrap();
    for instance in &instances {
        router.add_instance(instance.id());
    }
    (router, instances, registry)
}

fn config() -> KvRoutingConfig {
    KvRoutingConfig {
        block_size: BLOCK,
        ..KvRoutingConfig::default()
    }
}

/// A completions request for token ids `ids`.
fn request(router: &KvRouter, ids: &[u32]) -> KvRequest {
    let body = serde_json::json!({"model": "m", "prompt": ids}).to_string();
    let prepared = router
        .preparer()
        .prepare(PromptKind::Completion, &Bytes::from(body), true)
        .unwrap();
    router.request(&prepared, Instant::now())
}

fn fallback(router: &KvRouter) -> KvRequest {
    let prepared = router
        .preparer()
        .prepare(PromptKind::Other, &Bytes::from_static(b"{}"), true)
        .unwrap();
    router.request(&prepared, Instant::now())
}

fn conversation(seed: u32, tokens: u32) -> Vec<u32> {
    (0..tokens).map(|i| seed * 100_000 + i).collect()
}

fn picked(choice: Choice) -> Decision {
    match choice {
        Choice::Picked(decision) => decision,
        other => panic!("no instance picked: {other:?}"),
    }
}

fn choose(router: &KvRouter, instances: &[Arc<Fake>], request: &KvRequest, seed: u64) -> Choice {
    let mut rng = StdRng::seed_from_u64(seed);
    let excluded = Excluded::default();
    router.choose(&Candidates::new(instances, &excluded, 0), request, &mut rng)
}

#[test]
fn a_conversation_sticks_to_the_instance_that_caches_its_prefix() {
    let (router, instances) = router_with(config(), 4);
    let first = request(&router, &conversation(1, 40));
    let decision = picked(choose(&router, &instances, &first, 1));
    assert_eq!(decision.overlap_blocks, 0);
    drop(router.commit(&decision, &first, Instant::now()));
    // The next turn repeats the 40 tokens and adds 20: its first 10 blocks are predicted
    // cached on the first instance, which wins whatever the random tie-break would say.
    for seed in 0..20 {
        let next = request(&router, &conversation(1, 60));
        let again = picked(choose(&router, &instances, &next, seed));
        assert_eq!(again.index, decision.index);
        assert_eq!(again.overlap_blocks, 10);
        assert_eq!(again.cost.new_prefill_tokens, 20);
    }
}

#[test]
fn bookings_hold_load_until_dropped_and_prefill_until_the_first_byte() {
    let (router, instances) = router_with(config(), 2);
    let long = request(&router, &conversation(1, 64)); // 16 blocks
    let decision = picked(choose(&router, &instances, &long, 3));
    let booking = router.commit(&decision, &long, Instant::now());
    let busy_one = decision.instance_id;
    let load = router.loads.snapshot(busy_one, &[]);
    assert_eq!((load.prefill_tokens, load.blocks), (64, 16));
    // A different prompt goes to the idle instance: the other one has 16 blocks of prefill
    // and 16 of decode ahead of it.
    let other = request(&router, &conversation(2, 8));
    assert_ne!(
        picked(choose(&router, &instances, &other, 3)).instance_id,
        busy_one
    );
    booking.prefill_done();
    let load = router.loads.snapshot(busy_one, &[]);
    assert_eq!((load.prefill_tokens, load.blocks), (0, 16));
    drop(booking);
    assert_eq!(
        router.loads.snapshot(busy_one, &[]),
        LoadSnapshot::default()
    );
}

#[test]
fn equal_costs_go_to_fewer_requests_in_flight() {
    let (router, instances) = router_with(config(), 3);
    let _a = instances[0].start_request();
    let _b = instances[2].start_request();
    let _c = instances[2].start_request();
    let fresh = request(&router, &conversation(7, 16));
    for seed in 0..20 {
        assert_eq!(picked(choose(&router, &instances, &fresh, seed)).index, 1);
    }
}

#[test]
fn requests_without_tokens_go_to_the_least_loaded_instance() {
    let (router, instances) = router_with(config(), 3);
    let heavy = request(&router, &conversation(1, 40));
    let light = request(&router, &conversation(2, 8));
    let _on_0 = router.commit(
        &Decision {
            index: 0,
            instance_id: 0,
            ..picked(choose(&router, &instances, &heavy, 0))
        },
        &heavy,
        Instant::now(),
    );
    let _on_2 = router.commit(
        &Decision {
            index: 2,
            instance_id: 2,
            ..picked(choose(&router, &instances, &light, 0))
        },
        &light,
        Instant::now(),
    );
    let embedding = fallback(&router);
    assert_eq!(embedding.input, RouteInput::Fallback(FallbackReason::Route));
    let decision = picked(choose(&router, &instances, &embedding, 5));
    assert_eq!(decision.index, 1);
    let booking = router.commit(&decision, &embedding, Instant::now());
    assert_eq!(router.loads.snapshot(1, &[]).blocks, 1);
    drop(booking);
    assert_eq!(router.loads.snapshot(1, &[]).blocks, 0);
}

#[test]
fn excluded_instances_fail_over_to_the_next_best() {
    let (router, instances) = router_with(config(), 3);
    let warm = request(&router, &conversation(1, 40));
    let mut decision = picked(choose(&router, &instances, &warm, 0));
    decision.index = 2;
    decision.instance_id = 2;
    drop(router.commit(&decision, &warm, Instant::now()));
    let next = request(&router, &conversation(1, 48));
    assert_eq!(picked(choose(&router, &instances, &next, 0)).index, 2);
    let mut excluded = Excluded::default();
    excluded.insert(2);
    let mut rng = StdRng::seed_from_u64(0);
    let failover =
        picked(router.choose(&Candidates::new(&instances, &excluded, 0), &next, &mut rng));
    assert_ne!(failover.index, 2);
    assert_eq!(failover.overlap_blocks, 0);
    excluded.insert(0);
    excluded.insert(1);
    assert_eq!(
        router.choose(&Candidates::new(&instances, &excluded, 0), &next, &mut rng),
        Choice::NoneEligible
    );
}

#[test]
fn busy_instances_are_skipped_and_all_busy_is_reported() {
    let config = KvRoutingConfig {
        busy_prefill_tokens: Some(30),
        total_kv_blocks: Some(100),
        busy_decode_blocks_fraction: Some(0.5),
        ..config()
    };
    let (router, instances) = router_with(config, 2);
    let big = request(&router, &conversation(1, 40)); // 40 prefill tokens, 10 blocks
    let first = picked(choose(&router, &instances, &big, 0));
    let _first = router.commit(&first, &big, Instant::now());
    let second = picked(choose(&router, &instances, &big, 0));
    assert_ne!(second.index, first.index, "the busy instance is skipped");
    let _second = router.commit(&second, &big, Instant::now());
    let small = request(&router, &conversation(2, 4));
    assert_eq!(choose(&router, &instances, &small, 0), Choice::AllBusy);
    assert!(!router.admissible(&instances, 0));
    for instance in &instances {
        instance.set_healthy(false);
    }
    assert!(
        router.admissible(&instances, 0),
        "nothing available is not \"busy\": routing reports it"
    );
    assert_eq!(choose(&router, &instances, &small, 0), Choice::NoneEligible);
    for instance in &instances {
        instance.set_healthy(true);
    }
    let explanation = router.explain(&instances, &small, 0, &mut StdRng::seed_from_u64(0));
    assert!(explanation.all_busy);
    assert_eq!(explanation.chosen, None);
    assert!(
        explanation
            .instances
            .iter()
            .all(|i| i.busy && i.probability == 0.0)
    );
}

#[tokio::test]
async fn admission_waits_for_released_load() {
    let config = KvRoutingConfig {
        busy_prefill_tokens: Some(30),
        queue: kvmesh_config::KvQueueConfig {
            max_size: 4,
            timeout: Duration::from_secs(30),
        },
        ..config()
    };
    let (router, instances) = router_with(config, 1);
    let big = request(&router, &conversation(1, 40));
    let decision = picked(choose(&router, &instances, &big, 0));
    let booking = router.commit(&decision, &big, Instant::now());
    let waiting = router.admit(&instances, || 0);
    tokio::pin!(waiting);
    assert!(
        futures_poll_once(waiting.as_mut()).await.is_none(),
        "busy: the request waits"
    );
    booking.prefill_done();
    assert_eq!(waiting.await, Ok(()));
}

/// Polls a future once; `Some` when it completed.
async fn futures_poll_once<F: std::future::Future + Unpin>(future: F) -> Option<F::Output> {
    let mut future = future;
    std::future::poll_fn(|cx| match std::pin::Pin::new(&mut future).poll(cx) {
        std::task::Poll::Ready(output) => std::task::Poll::Ready(Some(output)),
        std::task::Poll::Pending => std::task::Poll::Ready(None),
    })
    .await
}

#[test]
fn without_a_queue_all_busy_is_rejected_at_once() {
    let config = KvRoutingConfig {
        busy_prefill_tokens: Some(1),
        ..config()
    };
    let (router, instances) = router_with(config, 1);
    let big = request(&router, &conversation(1, 8));
    let decision = picked(choose(&router, &instances, &big, 0));
    let _booking = router.commit(&decision, &big, Instant::now());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let admitted = runtime.block_on(router.admit(&instances, || 0));
    assert_eq!(admitted, Err(Rejected::Busy));
    assert_eq!(router.metrics.busy_rejections.get(), 1);
}

#[test]
fn explaining_changes_nothing() {
    let (router, instances) = router_with(config(), 3);
    let warm = request(&router, &conversation(1, 40));
    let decision = picked(choose(&router, &instances, &warm, 0));
    let booking = router.commit(&decision, &warm, Instant::now());
    booking.prefill_done();
    let probe = request(&router, &conversation(1, 48));
    let before: Vec<_> = (0..3).map(|i| router.loads.snapshot(i, &[])).collect();
    let cached = router.overlap.cached_blocks();
    let first = router.explain(&instances, &probe, 0, &mut StdRng::seed_from_u64(1));
    let second = router.explain(&instances, &probe, 0, &mut StdRng::seed_from_u64(2));
    assert_eq!(first, second, "deterministic without ties");
    let after: Vec<_> = (0..3).map(|i| router.loads.snapshot(i, &[])).collect();
    assert_eq!(before, after);
    assert_eq!(cached, router.overlap.cached_blocks());
    let chosen = &first.instances[decision.index];
    assert_eq!(first.chosen.as_deref(), Some(chosen.instance.as_str()));
    assert_eq!(chosen.overlap_blocks, 10);
    assert_eq!(chosen.active_blocks, 10);
    assert_eq!(chosen.active_prefill_tokens, 0);
    assert_eq!(chosen.probability, 1.0);
    assert_eq!(first.prompt_tokens, 48);
    assert_eq!(first.prompt_blocks, 12);
    // Its cost: 8 new prefill tokens = 2 blocks; 10 active + 2 new blocks. An idle instance
    // costs 12 + 12.
    assert_eq!(chosen.cost, 2.0 + 12.0);
    assert_eq!(first.instances[(decision.index + 1) % 3].cost, 24.0);
    drop(booking);
}

#[test]
fn the_sweeper_drops_stale_bookings() {
    let (router, instances) = router_with(config(), 1);
    let warm = request(&router, &conversation(1, 40));
    let decision = picked(choose(&router, &instances, &warm, 0));
    let start = Instant::now();
    let booking = router.commit(&decision, &warm, start);
    assert_eq!(router.sweep(start + Duration::from_secs(299)), 0);
    assert_eq!(router.sweep(start + Duration::from_secs(301)), 1);
    assert_eq!(router.loads.snapshot(0, &[]), LoadSnapshot::default());
    drop(booking);
    assert_eq!(router.sweep_interval(), Duration::from_secs(30));
}

#[test]
fn index_gauges_follow_the_predictions() {
    let (router, instances, registry) = router_and_metrics(config(), 2);
    let warm = request(&router, &conversation(1, 40));
    let decision = picked(choose(&router, &instances, &warm, 0));
    drop(router.commit(&decision, &warm, Instant::now()));
    router.refresh_gauges(&instances);
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut out)
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    let gauge = |index: usize| {
        format!(
            "kvmesh_index_blocks{{instance=\"{}\",model=\"m\"}} ",
            instances[index].url()
        )
    };
    assert!(
        text.contains(&format!("{}10", gauge(decision.index))),
        "{text}"
    );
    assert!(
        text.contains(&format!("{}0", gauge(1 - decision.index))),
        "{text}"
    );
}

#[test]
fn a_removed_instance_loses_its_load_and_its_predictions() {
    let (router, instances) = router_with(config(), 2);
    let warm = request(&router, &conversation(1, 40));
    let decision = picked(choose(&router, &instances, &warm, 0));
    let booking = router.commit(&decision, &warm, Instant::now());
    let gone = decision.instance_id;
    router.remove_instance(gone);
    assert_eq!(router.loads.snapshot(gone, &[]), LoadSnapshot::default());
    assert!(router.overlap.cached_blocks().is_empty());
    drop(booking);
    let rest: Vec<Arc<Fake>> = instances
        .iter()
        .filter(|i| i.id() != gone)
        .cloned()
        .collect();
    let next = request(&router, &conversation(1, 48));
    let again = picked(choose(&router, &rest, &next, 0));
    assert_ne!(again.instance_id, gone);
    assert_eq!(again.overlap_blocks, 0);
}

#[test]
fn engine_reports_raise_the_load_of_their_instance() {
    let config = KvRoutingConfig {
        total_kv_blocks: Some(100),
        ..config()
    };
    let (router, instances) = router_with(config, 2);
    let fresh = request(&router, &conversation(3, 16));
    router.report_load(0, 0, 0.5, 0, Duration::ZERO, Duration::from_secs(60));
    for seed in 0..10 {
        assert_eq!(
            picked(choose(&router, &instances, &fresh, seed)).instance_id,
            1,
            "50 blocks in use on instance 0"
        );
    }
    router.report_load(0, 0, 0.0, 0, Duration::ZERO, Duration::from_secs(60));
    router.report_load(1, 3, 0.0, 0, Duration::ZERO, Duration::from_secs(60));
    let decision = picked(choose(&router, &instances, &fresh, 0));
    assert_eq!(decision.instance_id, 0, "3 requests queued on instance 1");
    let explanation = router.explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0));
    assert_eq!(
        explanation.instances[1].active_prefill_tokens,
        3 * BLOCK as u64
    );
    router.report_load(1, 0, 0.9, 1000, Duration::ZERO, Duration::ZERO);
    assert_eq!(
        router
            .explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0))
            .instances[1]
            .active_blocks,
        0,
        "expired at once"
    );
}
