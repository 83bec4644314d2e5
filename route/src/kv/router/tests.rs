//! The router end to end on fake instances: decisions, bookings, thresholds, explanations.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use bytes::Bytes;
use kvmesh_config::KvRoutingConfig;
use prometheus::{Encoder, Registry, TextEncoder};
use rand::SeedableRng;
use rand::rngs::StdRng;

use super::*;
use crate::candidates::{Candidates, Excluded};
use crate::kv::SHARE_WAIT;
use crate::kv::prediction::RECORD_STEP;
use crate::kv::replicas::SharedLoad;
use crate::metrics::KvFamilies;
use crate::policy::PolicyInput;
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

/// What `registry` exposes, as a scrape reads it.
fn metrics_text(registry: &Registry) -> String {
    let mut out = Vec::new();
    TextEncoder::new()
        .encode(&registry.gather(), &mut out)
        .unwrap();
    String::from_utf8(out).unwrap()
}

fn config() -> KvRoutingConfig {
    KvRoutingConfig {
        block_size: Some(BLOCK),
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
fn with_events_flowing_a_request_routed_before_its_events_still_draws_its_siblings() {
    let registry = Registry::new();
    let families = KvFamilies::register(&registry).unwrap();
    let instances = instances(4);
    let router = KvRouter::new(&config(), None, false, true, families.model("m")).unwrap();
    for instance in &instances {
        router.add_instance(instance.id());
    }
    router.event_feed().expect("events on").set_live(true);
    let first = request(&router, &conversation(7, 40));
    let decision = picked(choose(&router, &instances, &first, 3));
    assert_eq!(decision.overlap_blocks, 0);
    // No KV event has arrived for it yet (events live, the index empty).
    drop(router.commit(&decision, &first, Instant::now()));
    for seed in 0..20 {
        let sibling = request(&router, &conversation(7, 60));
        let chosen = picked(choose(&router, &instances, &sibling, seed));
        assert_eq!(chosen.index, decision.index, "seed {seed}");
        assert_eq!(chosen.overlap_blocks, 10);
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
    booking.prefill_done(false);
    let load = router.loads.snapshot(busy_one, &[]);
    assert_eq!((load.prefill_tokens, load.blocks), (0, 16));
    drop(booking);
    assert_eq!(
        router.loads.snapshot(busy_one, &[]),
        LoadSnapshot::default()
    );
}

#[test]
fn under_load_a_request_stays_where_its_prompt_is_cached_rather_than_recompute_it() {
    // Instance 0 caches a 4,000-token conversation whose next turn has 4,400 tokens. Both
    // instances have two requests queued for prefill, instance 0 5,000 tokens more of them:
    // its queue is about 20 ms longer, the recomputation elsewhere about 70 ms of work that
    // each request queued behind would wait.
    let next_turn = |queue_weight: f64| {
        let config = KvRoutingConfig {
            queue_weight,
            work_weight: 0.0,
            ..config()
        };
        let (router, instances) = router_with(config, 2);
        drop(pick_on(
            &router,
            &instances,
            request(&router, &conversation(1, 4000)),
            0,
        ));
        let next = request(&router, &conversation(1, 4400));
        let idle = picked(choose(&router, &instances, &next, 1));
        assert_eq!(idle.index, 0, "idle, the cache holder");
        assert_eq!(idle.cost.queue_ms, 0.0, "nothing queued, nothing charged");
        let _queued: Vec<_> = [(0, 10, 3500), (0, 11, 3500), (1, 12, 1000), (1, 13, 1000)]
            .into_iter()
            .map(|(index, seed, tokens)| {
                pick_on(
                    &router,
                    &instances,
                    request(&router, &conversation(seed, tokens)),
                    index,
                )
            })
            .collect();
        assert_eq!(router.loads.snapshot(0, &[]).prefill_requests, 2);
        let next = request(&router, &conversation(1, 4400));
        picked(choose(&router, &instances, &next, 1))
    };
    let charged = next_turn(KvRoutingConfig::default().queue_weight);
    assert_eq!(charged.index, 0, "{charged:?}");
    assert_eq!(charged.cost.new_prefill_tokens, 400);
    assert!(charged.cost.queue_ms > 0.0, "{charged:?}");
    let uncharged = next_turn(0.0);
    assert_eq!(
        uncharged.index, 1,
        "the shorter queue, recomputing: {uncharged:?}"
    );
    assert_eq!(uncharged.cost.new_prefill_tokens, 4400);
}

#[test]
fn the_work_weight_keeps_a_conversation_on_its_cache_holder_beside_an_idle_instance() {
    // Instance 0 caches a 4,000-token conversation and has a 5,000-token prompt queued for
    // prefill; instance 1 is idle. The next turn (4,400 tokens) would start about 20 ms
    // sooner on the idle instance, which must prefill all of it: about 75 ms of work against
    // 6 ms on the holder.
    let next_turn = |work_weight: f64| {
        let config = KvRoutingConfig {
            work_weight,
            ..config()
        };
        let (router, instances) = router_with(config, 2);
        let book = |seed, tokens| {
            pick_on(
                &router,
                &instances,
                request(&router, &conversation(seed, tokens)),
                0,
            )
        };
        drop(book(1, 4000));
        let _queued = book(10, 5000);
        let next = request(&router, &conversation(1, 4400));
        picked(choose(&router, &instances, &next, 1))
    };
    let unweighted = next_turn(0.0);
    assert_eq!(unweighted.index, 1, "the idle instance: {unweighted:?}");
    assert_eq!(unweighted.cost.new_prefill_tokens, 4400);
    let weighted = next_turn(4.0);
    assert_eq!(weighted.index, 0, "the cache holder: {weighted:?}");
    assert_eq!(weighted.cost.new_prefill_tokens, 400);
    assert!(weighted.cost.work_ms > 0.0);
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
    booking.prefill_done(false);
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
    drop(router.commit(&decision, &warm, Instant::now()));
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
    assert_eq!(chosen.active_blocks, 0);
    assert_eq!(chosen.prefill_tokens, 8);
    assert_eq!(chosen.probability, 1.0);
    assert_eq!(first.prompt_tokens, 48);
    assert_eq!(first.prompt_blocks, 12);
    // Idle instances: the predicted time is the profile's prefill of the uncached tokens.
    let profile = EngineProfile::DEFAULT;
    assert_eq!(chosen.predicted_ttft_ms, profile.iteration_prefill_ms(8));
    // The cost adds `work_weight` (2) times its tokens' prefill work.
    let work = profile.iteration_prefill_ms(8) - profile.prefill_fixed_ms;
    assert_eq!(chosen.work_ms, work);
    assert_eq!(chosen.cost, chosen.predicted_ttft_ms + 2.0 * work);
    let other = &first.instances[(decision.index + 1) % 3];
    assert_eq!(other.predicted_ttft_ms, profile.iteration_prefill_ms(48));
    assert_eq!((chosen.speed, chosen.harm_ms), (1.0, 0.0));
}

#[test]
fn peeking_names_the_pick_without_booking_or_predicting_it() {
    let (router, instances) = router_with(config(), 3);
    let warm = request(&router, &conversation(1, 40));
    let decision = picked(choose(&router, &instances, &warm, 0));
    drop(router.commit(&decision, &warm, Instant::now()));
    let next = PolicyInput::Kv(request(&router, &conversation(1, 48)));
    let before: Vec<_> = (0..3).map(|i| router.loads.snapshot(i, &[])).collect();
    let cached = router.overlap.cached_blocks();
    let mut excluded = Excluded::default();
    let all = Candidates::new(&instances, &excluded, 0);
    assert_eq!(router.peek(&all, &next), Some(decision.index));
    // The cache-rich instance excluded: one of the others, and still nothing booked.
    excluded.insert(decision.index);
    let rest = Candidates::new(&instances, &excluded, 0);
    let fallback = router.peek(&rest, &next).unwrap();
    assert_ne!(fallback, decision.index);
    let after: Vec<_> = (0..3).map(|i| router.loads.snapshot(i, &[])).collect();
    assert_eq!(before, after);
    assert_eq!(cached, router.overlap.cached_blocks());
    for index in 0..3 {
        excluded.insert(index);
    }
    let none = Candidates::new(&instances, &excluded, 0);
    assert_eq!(router.peek(&none, &next), None);
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
    let text = metrics_text(&registry);
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
    // No first token seen yet: both instances at the profile's speed.
    for instance in &instances {
        let speed = format!(
            "kvmesh_route_instance_speed{{instance=\"{}\",model=\"m\"}} 1\n",
            instance.url()
        );
        assert!(text.contains(&speed), "{text}");
    }
}

/// A prompt of `steps` prediction steps and a few blocks more, committed on one of two
/// instances; returns the router, the prompt's block count and the chosen worker.
fn commit_long_prompt(steps: usize) -> (KvRouter, u64, kvmesh_kv::WorkerKey) {
    let (router, instances) = router_with(config(), 2);
    let blocks = steps * RECORD_STEP + 10;
    let long = request(&router, &conversation(1, (blocks * BLOCK) as u32));
    let decision = picked(choose(&router, &instances, &long, 0));
    drop(router.commit(&decision, &long, Instant::now()));
    let worker = worker_key(decision.instance_id, None);
    (router, blocks as u64, worker)
}

#[tokio::test]
async fn a_long_prompts_prediction_is_recorded_in_steps_that_yield_to_the_runtime() {
    let (router, blocks, worker) = commit_long_prompt(3);
    let step = RECORD_STEP as u64;
    assert_eq!(
        router.overlap.cached_blocks(),
        vec![(worker, step)],
        "the first step is recorded with the decision"
    );
    let mut seen = vec![step];
    for _ in 0..16 {
        tokio::task::yield_now().await;
        let cached = router.overlap.cached_blocks()[0].1;
        if seen.last() != Some(&cached) {
            seen.push(cached);
        }
    }
    assert_eq!(
        seen,
        vec![step, 2 * step, 3 * step, blocks],
        "one step each time the runtime polls the recording task"
    );
}

#[test]
fn without_a_runtime_a_long_prompts_prediction_is_recorded_at_once() {
    let (router, blocks, worker) = commit_long_prompt(2);
    assert_eq!(router.overlap.cached_blocks(), vec![(worker, blocks)]);
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
    router.report_load(0, 0, 0.5, Duration::ZERO, Duration::from_secs(60));
    for seed in 0..10 {
        assert_eq!(
            picked(choose(&router, &instances, &fresh, seed)).instance_id,
            1,
            "50 blocks in use on instance 0"
        );
    }
    router.report_load(0, 0, 0.0, Duration::ZERO, Duration::from_secs(60));
    router.report_load(1, 3, 0.0, Duration::ZERO, Duration::from_secs(60));
    let decision = picked(choose(&router, &instances, &fresh, 0));
    assert_eq!(decision.instance_id, 0, "3 requests queued on instance 1");
    let explanation = router.explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0));
    assert_eq!(
        explanation.instances[1].active_prefill_tokens,
        3 * BLOCK as u64
    );
    router.set_capacity(1, 1000, 1);
    router.report_load(1, 0, 0.9, Duration::ZERO, Duration::ZERO);
    assert_eq!(
        router
            .explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0))
            .instances[1]
            .active_blocks,
        0,
        "expired at once"
    );
}

#[test]
fn a_report_scraped_while_another_replicas_request_ran_stops_counting_it_when_it_ends() {
    let config = KvRoutingConfig {
        total_kv_blocks: Some(100),
        ..config()
    };
    let (router, instances) = router_with(config, 2);
    let fresh = request(&router, &conversation(3, 16));
    let blocks_on_0 = || {
        router
            .explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0))
            .instances[0]
            .active_blocks
    };
    let running = |seq, blocks| {
        let loads = HashMap::from([(
            0,
            SharedLoad {
                blocks,
                requests: u64::from(blocks > 0),
                ..SharedLoad::default()
            },
        )]);
        share(
            seq,
            OwnLoads {
                eased: seq,
                loads,
                ..OwnLoads::default()
            },
        )
    };
    const MINUTE: Duration = Duration::from_secs(60);
    // Replica 9's request holds 30 blocks on instance 0, and the engine reports them.
    assert!(router.apply_replica_loads(9, running(1, 30)));
    router.report_load(0, 0, 0.3, Duration::ZERO, MINUTE);
    assert_eq!(blocks_on_0(), 30, "counted once: the replica's");
    // It ended: its share shows it gone, and the report, which still holds its blocks, is
    // not taken for foreign load.
    assert!(router.apply_replica_loads(9, running(2, 0)));
    assert_eq!(blocks_on_0(), 0);
    // Nor is a report scraped before the end that arrives after it.
    router.report_load(0, 0, 0.3, Duration::from_secs(1), MINUTE);
    assert_eq!(blocks_on_0(), 0);
    // A report scraped after the end holds another client's blocks: foreign.
    router.report_load(0, 0, 0.3, Duration::ZERO, MINUTE);
    assert_eq!(blocks_on_0(), 30);
}

#[test]
fn an_engines_reported_capacity_sets_its_busy_threshold() {
    let config = KvRoutingConfig {
        total_kv_blocks: Some(100),
        busy_decode_blocks_fraction: Some(0.5),
        ..config()
    };
    let (router, instances) = router_with(config, 2);
    let fresh = request(&router, &conversation(3, 16));
    router.set_capacity(0, 1000, 1);
    for instance in [0, 1] {
        router.report_load(instance, 0, 0.3, Duration::ZERO, Duration::from_secs(60));
    }
    let explanation = router.explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0));
    let (big, small) = (&explanation.instances[0], &explanation.instances[1]);
    assert_eq!(
        (big.active_blocks, big.busy),
        (300, false),
        "300 of 1,000 blocks"
    );
    assert_eq!(
        (small.active_blocks, small.busy),
        (30, false),
        "30 of the default 100"
    );
    router.report_load(1, 0, 0.6, Duration::ZERO, Duration::from_secs(60));
    let explanation = router.explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0));
    assert!(explanation.instances[1].busy, "60 of 100 blocks, over half");
    assert_eq!(
        picked(choose(&router, &instances, &fresh, 0)).instance_id,
        0
    );
    router.set_capacity(0, 0, 1);
    let explanation = router.explain(&instances, &fresh, 0, &mut StdRng::seed_from_u64(0));
    assert!(
        explanation.instances[0].busy,
        "unknown again: 300 blocks of the default 100"
    );
}

#[test]
fn a_session_stays_on_its_instance_until_it_is_busy() {
    let config = KvRoutingConfig {
        busy_prefill_tokens: Some(1_500),
        ..config()
    };
    let (router, instances) = router_with(config, 2);
    assert_eq!(router.session_header(), Some("x-session-id"));
    let turn = |seed| request(&router, &conversation(seed, 40)).in_session(Some("s"));
    let first = turn(1);
    let bound = picked(choose(&router, &instances, &first, 0));
    assert!(!bound.affinity, "nothing bound yet");
    drop(router.commit(&bound, &first, Instant::now()));
    // Load on the bound instance makes it the dearer one; the session stays, a request
    // without it goes to the other instance.
    let load = request(&router, &conversation(9, 1_000));
    let on_bound = Decision {
        index: bound.index,
        instance_id: bound.instance_id,
        ..picked(choose(&router, &instances, &load, 0))
    };
    let held = router.commit(&on_bound, &load, Instant::now());
    for seed in 0..10 {
        let other = picked(choose(
            &router,
            &instances,
            &request(&router, &conversation(50 + seed, 40)),
            seed as u64,
        ));
        assert_ne!(other.index, bound.index);
        let next = picked(choose(&router, &instances, &turn(2 + seed), seed as u64));
        assert_eq!(
            (next.index, next.affinity),
            (bound.index, true),
            "seed {seed}"
        );
    }
    let explained = router.explain(&instances, &turn(20), 0, &mut StdRng::seed_from_u64(0));
    assert_eq!(
        explained.session_bound_to.as_deref(),
        Some(instances[bound.index].url())
    );
    assert_eq!(
        explained.chosen.as_deref(),
        Some(instances[bound.index].url())
    );
    // Past its busy threshold the bound instance yields, and the session moves.
    let more = router.commit(&on_bound, &load, Instant::now());
    let moved = turn(30);
    let next = picked(choose(&router, &instances, &moved, 0));
    assert_eq!((next.index == bound.index, next.affinity), (false, false));
    drop(router.commit(&next, &moved, Instant::now()));
    drop((held, more));
    let after = picked(choose(&router, &instances, &turn(31), 0));
    assert_eq!((after.index, after.affinity), (next.index, true));
}

#[test]
fn without_a_session_header_nothing_binds() {
    let config = KvRoutingConfig {
        session_header: String::new(),
        ..config()
    };
    let (router, instances) = router_with(config, 2);
    assert_eq!(router.session_header(), None);
    assert!(router.share_sessions().is_none());
    let first = request(&router, &conversation(1, 40)).in_session(Some("s"));
    let decision = picked(choose(&router, &instances, &first, 0));
    drop(router.commit(&decision, &first, Instant::now()));
    let next = picked(choose(
        &router,
        &instances,
        &request(&router, &conversation(2, 40)).in_session(Some("s")),
        0,
    ));
    assert!(!next.affinity);
}

#[test]
fn bindings_are_shared_with_and_taken_from_other_replicas() {
    let (router, instances) = router_with(config(), 3);
    let mut shared = router.share_sessions().expect("sessions on");
    let first = request(&router, &conversation(1, 40)).in_session(Some("mine"));
    let decision = picked(choose(&router, &instances, &first, 0));
    drop(router.commit(&decision, &first, Instant::now()));
    let binding = shared.try_recv().expect("shared");
    assert_eq!(
        (&*binding.session, binding.instance),
        ("mine", decision.instance_id)
    );
    router.apply_session(SessionBinding {
        session: Arc::from("theirs"),
        instance: 2,
        ttl: Duration::from_secs(60),
    });
    let theirs = request(&router, &conversation(5, 40)).in_session(Some("theirs"));
    let chosen = picked(choose(&router, &instances, &theirs, 0));
    assert_eq!((chosen.instance_id, chosen.affinity), (2, true));
}

#[test]
fn a_replica_counts_the_load_another_shares_until_it_expires() {
    let (one, instances) = router_with(config(), 2);
    let (other, _) = router_with(config(), 2);
    let heavy = request(&one, &conversation(1, 4_000));
    let on_zero = Decision {
        index: 0,
        instance_id: 0,
        ..picked(choose(&one, &instances, &heavy, 0))
    };
    let held = one.commit(&on_zero, &heavy, Instant::now());
    let shared = one.own_loads();
    assert_eq!(shared.loads[&0].prefill_tokens, 4_000);
    assert_eq!(
        (shared.loads[&0].requests, shared.loads[&1].requests),
        (1, 0)
    );
    assert_eq!(shared.loads[&0].prefill_requests, 1);
    assert!(other.apply_replica_loads(7, share(1, shared)));
    assert_eq!(other.folded(0, &[]).prefill_requests, 1, "queued there");
    for seed in 0..10 {
        let fresh = request(&other, &conversation(2 + seed, 400));
        let chosen = picked(choose(&other, &instances, &fresh, u64::from(seed)));
        assert_eq!(chosen.instance_id, 1, "the other replica's prefill is on 0");
    }
    let explained = other.explain(
        &instances,
        &request(&other, &conversation(3, 400)),
        0,
        &mut StdRng::seed_from_u64(0),
    );
    assert_eq!(explained.instances[0].active_prefill_tokens, 4_000);
    assert_eq!(explained.instances[0].active_requests, 1);
    assert_eq!(explained.instances[0].queued_requests, 1);
    // The replica dies: its last share expires.
    let last = ReplicaShare {
        ttl: Duration::ZERO,
        ..share(2, one.own_loads())
    };
    assert!(other.apply_replica_loads(7, last));
    other.expire_replica_loads();
    let explained = other.explain(
        &instances,
        &request(&other, &conversation(3, 400)),
        0,
        &mut StdRng::seed_from_u64(0),
    );
    assert_eq!(explained.instances[0].active_prefill_tokens, 0);
    assert_eq!(explained.instances[0].queued_requests, 0);
    drop(held);
}

#[test]
fn another_replicas_decision_draws_the_siblings_of_its_prompt() {
    let registry = Registry::new();
    let families = KvFamilies::register(&registry).unwrap();
    let instances = instances(4);
    let one = KvRouter::new(&config(), None, false, true, families.model("m")).unwrap();
    let other = KvRouter::new(&config(), None, false, true, families.model("m2")).unwrap();
    for router in [&one, &other] {
        for instance in &instances {
            router.add_instance(instance.id());
        }
        router.event_feed().expect("events on").set_live(true);
    }
    let mut shared = one.share_decisions().expect("first share");
    assert!(one.share_decisions().is_none(), "once");
    let first = request(&one, &conversation(7, 40));
    let decision = picked(choose(&one, &instances, &first, 3));
    drop(one.commit(&decision, &first, Instant::now()));
    let sent = shared.try_recv().expect("shared");
    assert_eq!(sent.instance, decision.instance_id);
    // No KV event has arrived yet; the other replica learns the decision from the share.
    other.apply_decision(sent.instance, &sent.prompt.hashes);
    for seed in 0..20 {
        let sibling = request(&other, &conversation(7, 60));
        let chosen = picked(choose(&other, &instances, &sibling, seed));
        assert_eq!(chosen.instance_id, decision.instance_id, "seed {seed}");
        assert_eq!(chosen.overlap_blocks, 10);
    }
}

/// The prompt blocks of a request with tokens.
fn prompt_of(request: &KvRequest) -> Arc<crate::prepare::PromptBlocks> {
    match &request.input {
        RouteInput::Tokens(prompt) => Arc::clone(prompt),
        RouteInput::Fallback(reason) => panic!("no tokens: {reason:?}"),
    }
}

/// A KV event storing every block of `request`'s prompt.
fn stored_event(request: &KvRequest) -> kvmesh_kv::KvEvent {
    let prompt = prompt_of(request);
    kvmesh_kv::KvEvent::stored(
        None,
        prompt
            .hashes
            .local
            .iter()
            .enumerate()
            .map(|(i, &local)| (kvmesh_kv::ExternalHash(i as u64), local)),
    )
}

#[test]
fn an_unset_block_size_is_the_first_records_and_another_engines_is_scored_approximately() {
    use crate::policy::Policy;
    let (registry, families) = {
        let registry = Registry::new();
        let families = KvFamilies::register(&registry).unwrap();
        (registry, families)
    };
    let instances = instances(2);
    let unset = KvRoutingConfig {
        block_size: None,
        ..config()
    };
    let router = KvRouter::new(&unset, None, false, true, families.model("m")).unwrap();
    for instance in &instances {
        router.add_instance(instance.id());
    }
    let feed = Arc::clone(router.event_feed().expect("events on"));
    feed.set_live(true);
    assert_eq!(router.block_size(), 16, "no record yet: vLLM's GPU default");
    assert_eq!(request(&router, &conversation(1, 64)).shape.full_blocks, 4);
    // The first record sets it: the prompts are cut into the engine's blocks from now on.
    assert_eq!(router.fit_block_size(0, 4), BlockSizeFit::Adopted);
    assert_eq!(router.block_size(), 4);
    let prompt = request(&router, &conversation(1, 64));
    assert_eq!(
        (prompt.shape.full_blocks, prompt_of(&prompt).block_size),
        (16, 4)
    );
    // Instance 1's engine runs blocks of 8 tokens: a conflict. Its events are not indexed
    // (they could never match), its capacity counts in the model's blocks.
    assert_eq!(
        router.fit_block_size(1, 8),
        BlockSizeFit::Differs { model: 4 }
    );
    assert_eq!(router.block_size_conflicts(), [(1, 8)]);
    assert!(feed.is_approximate_only(1) && !feed.is_approximate_only(0));
    router.set_capacity(1, 100, 1);
    let event = stored_event(&prompt);
    feed.apply(kvmesh_kv::WorkerKey::new(0, 0), &event);
    feed.apply(kvmesh_kv::WorkerKey::new(1, 0), &event);
    let prompt = request(&router, &conversation(1, 64));
    let explanation = router.explain(&instances, &prompt, 0, &mut StdRng::seed_from_u64(0));
    assert_eq!(explanation.block_size, 4);
    let (matching, other) = (&explanation.instances[0], &explanation.instances[1]);
    assert_eq!(
        (matching.overlap_blocks, matching.block_size_mismatch),
        (16, None)
    );
    assert_eq!(
        (other.overlap_blocks, other.block_size_mismatch),
        (0, Some(8))
    );
    assert_eq!(other.kv_capacity_blocks, 200, "100 blocks of 8 tokens");
    let json = serde_json::to_value(&explanation).unwrap();
    assert_eq!(json["instances"][1]["block_size_mismatch"], 8);
    assert!(json["instances"][0].get("block_size_mismatch").is_none());
    // Routed there anyway, its header says so; its own decisions still predict its cache.
    let mut excluded = Excluded::default();
    excluded.insert(0);
    let input = PolicyInput::Kv(prompt);
    let picked = router
        .pick(&Candidates::new(&instances, &excluded, 0), &input)
        .expect("instance 1");
    assert_eq!(picked.index, 1);
    let header = picked.explanation.clone().unwrap_or_default();
    assert!(header.ends_with("; block_size_mismatch=8"), "{header}");
    drop(picked);
    let again = request(&router, &conversation(1, 64));
    let explanation = router.explain(&instances, &again, 0, &mut StdRng::seed_from_u64(0));
    assert_eq!(explanation.instances[1].overlap_blocks, 16, "predicted");
    let mut excluded = Excluded::default();
    excluded.insert(1);
    let header = router
        .pick(
            &Candidates::new(&instances, &excluded, 0),
            &PolicyInput::Kv(again),
        )
        .expect("instance 0")
        .explanation
        .unwrap_or_default();
    assert!(header.contains("overlap_blocks=16"), "{header}");
    assert!(!header.contains("block_size_mismatch"), "{header}");
    // The gauge says which instance conflicts.
    router.refresh_gauges(&instances);
    let text = metrics_text(&registry);
    for (instance, value) in [(&instances[0], 0), (&instances[1], 1)] {
        let series = format!(
            "kvmesh_route_block_size_mismatch{{instance=\"{}\",model=\"m\"}} {value}\n",
            instance.url()
        );
        assert!(text.contains(&series), "{text}");
    }
    // The event-fed index's heap bytes, as the index counts them.
    let bytes = feed.index().heap_bytes();
    assert!(bytes > 0);
    assert!(
        text.contains(&format!("kvmesh_index_bytes{{model=\"m\"}} {bytes}\n")),
        "{text}"
    );
    // It leaves: no conflict; every registered instance gone, the next record sets it again.
    router.remove_instance(1);
    assert!(router.block_size_conflicts().is_empty());
    assert!(!feed.is_approximate_only(1));
    assert!(router.reset_block_size());
    assert_eq!(router.block_size(), 16);
    router.add_instance(1);
    assert_eq!(router.fit_block_size(1, 8), BlockSizeFit::Adopted);
    assert_eq!(router.block_size(), 8);
}

#[test]
fn a_configured_block_size_stays_whatever_the_records_say() {
    let (router, _) = router_with(config(), 2);
    assert_eq!(router.block_size(), BLOCK as u64);
    assert_eq!(
        router.fit_block_size(0, 0),
        BlockSizeFit::Matches,
        "unknown"
    );
    assert_eq!(
        router.fit_block_size(0, BLOCK as u64),
        BlockSizeFit::Matches
    );
    assert_eq!(
        router.fit_block_size(1, 16),
        BlockSizeFit::Differs {
            model: BLOCK as u64
        }
    );
    assert!(!router.reset_block_size());
    assert_eq!(router.block_size(), BLOCK as u64);
    assert_eq!(router.block_size_conflict(1), Some(16));
    // Without KV events there is nothing to leave out; the conflict is still reported.
    assert!(router.event_feed().is_none());
    router.set_capacity(1, 10, 1);
    let (instances, probe) = (instances(2), request(&router, &conversation(2, 8)));
    let explanation = router.explain(&instances, &probe, 0, &mut StdRng::seed_from_u64(0));
    assert_eq!(
        explanation.instances[1].kv_capacity_blocks, 40,
        "10 blocks of 16"
    );
}

/// Books `request` on instance `index` of `instances` (the others excluded).
fn pick_on<'r>(
    router: &'r KvRouter,
    instances: &[Arc<Fake>],
    request: KvRequest,
    index: usize,
) -> crate::policy::Picked<'r> {
    use crate::policy::Policy;
    let mut excluded = Excluded::default();
    for other in (0..instances.len()).filter(|&i| i != index) {
        excluded.insert(other);
    }
    let picked = router
        .pick(
            &Candidates::new(instances, &excluded, 0),
            &PolicyInput::Kv(request),
        )
        .expect("the one instance left");
    assert_eq!(picked.index, index);
    picked
}

#[test]
fn answers_check_the_index_and_an_instance_that_keeps_disagreeing_is_resynced() {
    let registry = Registry::new();
    let families = KvFamilies::register(&registry).unwrap();
    let instances = instances(2);
    let checked = KvRoutingConfig {
        cache_check: kvmesh_config::KvCacheCheckConfig {
            window: 4,
            mismatches: 2,
        },
        ..config()
    };
    let router = KvRouter::new(&checked, None, false, true, families.model("m")).unwrap();
    for instance in &instances {
        router.add_instance(instance.id());
    }
    let feed = Arc::clone(router.event_feed().expect("events on"));
    feed.set_live(true);
    let (resyncs, mut resync_requests) = mpsc::unbounded_channel();
    feed.resync_requests_to(resyncs);
    let url = |i: usize| instances[i].url.clone();
    // Instance 0's engine reported all 16 blocks of a 64-token prompt.
    let cached = request(&router, &conversation(1, 64));
    feed.apply(kvmesh_kv::WorkerKey::new(0, 0), &stored_event(&cached));
    let ask = || request(&router, &conversation(1, 66));
    // Its answer agrees: 64 tokens cached (the cap, ⌊65 / 4⌋ = 16 blocks, allows them all).
    let picked = pick_on(&router, &instances, ask(), 0);
    let booking = picked.booking.expect("booked");
    booking.engine_cached(&url(0), Some(64));
    drop(booking);
    // The engine evicted half without the index hearing of it: fewer blocks than reported
    // disagree, whatever else runs there.
    let booking = pick_on(&router, &instances, ask(), 0).booking.unwrap();
    booking.engine_cached(&url(0), Some(32));
    drop(booking);
    assert!(resync_requests.try_recv().is_err(), "one disagreement of 2");
    assert!(!feed.is_untrusted(0));
    let booking = pick_on(&router, &instances, ask(), 0).booking.unwrap();
    booking.engine_cached(&url(0), Some(0));
    drop(booking);
    // Two of the last four: untrusted, its resync asked for, scored by predictions alone.
    assert_eq!(resync_requests.try_recv().ok(), Some(0));
    assert!(feed.is_untrusted(0));
    let explanation = router.explain(&instances, &ask(), 0, &mut StdRng::seed_from_u64(0));
    let first = &explanation.instances[0];
    assert_eq!(first.reported_blocks, Some(0), "its events are not read");
    assert_eq!(
        first.overlap_blocks, 16,
        "its routing decisions still predict it"
    );
    let state = first.cache_check.clone().expect("checked");
    assert_eq!((state.judged, state.disagreed), (3, 2));
    assert!(state.untrusted);
    assert_eq!(
        state.last,
        Some(crate::kv::CheckedAnswer {
            expected_blocks: 16,
            actual_blocks: 0
        })
    );
    // Until its resync answers, its answers are not judged.
    let booking = pick_on(&router, &instances, ask(), 0).booking.unwrap();
    booking.engine_cached(&url(0), Some(0));
    drop(booking);
    router.refresh_gauges(&instances);
    let metrics = metrics_text(&registry);
    for series in [
        "kvmesh_route_cache_check_answers_total{model=\"m\",result=\"agreed\"} 1\n".to_string(),
        "kvmesh_route_cache_check_answers_total{model=\"m\",result=\"disagreed\"} 2\n".to_string(),
        "kvmesh_route_cache_check_blocks_count{model=\"m\"} 3\n".to_string(),
        "kvmesh_route_cache_check_blocks_sum{model=\"m\"} 24\n".to_string(),
        format!(
            "kvmesh_route_cache_check_mismatches_total{{instance=\"{}\",model=\"m\"}} 2\n",
            url(0)
        ),
        format!(
            "kvmesh_route_cache_check_untrusted{{instance=\"{}\",model=\"m\"}} 1\n",
            url(0)
        ),
    ] {
        assert!(metrics.contains(&series), "{series} in\n{metrics}");
    }
    // The resync's answer: trusted again, with an empty window.
    feed.trust(0);
    assert!(!feed.is_untrusted(0));
    let again = router.explain(&instances, &ask(), 0, &mut StdRng::seed_from_u64(0));
    assert_eq!(again.instances[0].reported_blocks, Some(16));
    assert_eq!(again.instances[0].cache_check.as_ref().unwrap().recent, 0);
}

#[test]
fn blocks_the_index_never_heard_of_disagree_unless_requests_in_flight_explain_them() {
    let (router, instances) = {
        let registry = Registry::new();
        let families = KvFamilies::register(&registry).unwrap();
        let instances = instances(2);
        let router = KvRouter::new(&config(), None, false, true, families.model("m")).unwrap();
        for instance in &instances {
            router.add_instance(instance.id());
        }
        (router, instances)
    };
    let feed = Arc::clone(router.event_feed().expect("events on"));
    feed.set_live(true);
    let url = instances[1].url.clone();
    let state = || {
        let probe = request(&router, &conversation(9, 8));
        router
            .explain(&instances, &probe, 0, &mut StdRng::seed_from_u64(0))
            .instances[1]
            .cache_check
            .clone()
            .expect("checked")
    };
    // A settled instance (nothing in flight, nothing ended lately) must be exact: the
    // engine had 8 blocks the index never heard of.
    let booking = pick_on(
        &router,
        &instances,
        request(&router, &conversation(1, 40)),
        1,
    )
    .booking
    .unwrap();
    booking.engine_cached(&url, Some(32));
    drop(booking);
    assert_eq!((state().judged, state().disagreed), (1, 1));
    // With a sibling in flight there, its blocks may already be cached before their
    // events arrive: up to the predicted overlap agrees.
    let sibling = pick_on(
        &router,
        &instances,
        request(&router, &conversation(2, 40)),
        1,
    );
    let booking = pick_on(
        &router,
        &instances,
        request(&router, &conversation(2, 42)),
        1,
    )
    .booking
    .unwrap();
    booking.engine_cached(&url, Some(40));
    assert_eq!((state().judged, state().disagreed), (2, 1));
    // Usage without cached_tokens is counted, not judged.
    booking.engine_cached(&url, None);
    let state = state();
    assert_eq!((state.judged, state.without_cached_tokens), (2, 1));
    drop((booking, sibling));
}

#[test]
fn a_request_goes_to_the_data_parallel_rank_that_reported_its_prefix() {
    let registry = Registry::new();
    let families = KvFamilies::register(&registry).unwrap();
    let instances = instances(2);
    let router = KvRouter::new(&config(), None, false, true, families.model("m")).unwrap();
    for instance in &instances {
        router.add_instance(instance.id());
    }
    let feed = Arc::clone(router.event_feed().expect("events on"));
    feed.set_live(true);
    // Rank 1 of instance 0 holds the conversation's 16 blocks, rank 0 the first 4 of them.
    let cached = request(&router, &conversation(1, 64));
    feed.apply(kvmesh_kv::WorkerKey::new(0, 1), &stored_event(&cached));
    let first = request(&router, &conversation(1, 16));
    feed.apply(kvmesh_kv::WorkerKey::new(0, 0), &stored_event(&first));
    let on_rank = pick_on(
        &router,
        &instances,
        request(&router, &conversation(1, 66)),
        0,
    );
    assert_eq!(on_rank.dp_rank, Some(1));
    let explanation = on_rank.explanation.expect("explained");
    assert!(explanation.contains("; rank=1"), "{explanation}");
    drop(on_rank.booking);
    // A prompt no rank holds: the engine chooses.
    let fresh = request(&router, &conversation(2, 66));
    let none = Excluded::default();
    let all = Candidates::new(&instances, &none, 0);
    let choice = router.choose(&all, &fresh, &mut StdRng::seed_from_u64(0));
    assert_eq!(picked(choice).dp_rank, None);
}

/// Another replica's share number `seq` of `own`, lasting a minute, settling no ask.
fn share(seq: u64, own: OwnLoads) -> ReplicaShare {
    ReplicaShare {
        seq,
        ttl: Duration::from_secs(60),
        own,
        decided: 0,
    }
}

fn requests_on(router: &KvRouter, instance: u64) -> u64 {
    router
        .own_loads()
        .loads
        .get(&instance)
        .map_or(0, |load| load.requests)
}

#[test]
fn the_decider_sees_its_own_booking_and_holds_anothers_until_settled() {
    let (decider, instances) = router_with(config(), 2);
    let excluded = Excluded::default();
    let candidates = Candidates::new(&instances, &excluded, 0);
    // A burst of two fresh prompts, one reaching each replica: the decider's own first.
    let own = request(&decider, &conversation(1, 400));
    let own_pick = picked(choose(&decider, &instances, &own, 0));
    let _own = decider.commit(&own_pick, &own, Instant::now());
    let theirs = prompt_of(&request(&decider, &conversation(2, 400)));
    let other_settings = (9, 1, decider.settings() ^ 1);
    assert_eq!(
        decider.decide_for(&candidates, Arc::clone(&theirs), None, other_settings),
        None,
        "a replica configured otherwise routes alone"
    );
    assert_eq!(requests_on(&decider, 0) + requests_on(&decider, 1), 1);
    let steer = decider
        .decide_for(&candidates, theirs, None, (9, 1, decider.settings()))
        .expect("an idle instance is left");
    assert_ne!(
        steer.instance, own_pick.instance_id,
        "the second of the burst goes where the first is not"
    );
    assert_eq!(
        requests_on(&decider, steer.instance),
        1,
        "held for replica 9"
    );
    // Replica 9's share before it settled ask 1 leaves the booking; the one after takes it.
    let shared = HashMap::from([(
        steer.instance,
        SharedLoad {
            prefill_tokens: 400,
            blocks: 100,
            requests: 1,
            ..SharedLoad::default()
        },
    )]);
    assert!(decider.apply_replica_loads(9, share(1, OwnLoads::default())));
    assert_eq!(requests_on(&decider, steer.instance), 1);
    let settling = ReplicaShare {
        decided: 1,
        ..share(
            2,
            OwnLoads {
                eased: 0,
                loads: shared,
                ..OwnLoads::default()
            },
        )
    };
    assert!(decider.apply_replica_loads(9, settling));
    assert_eq!(
        requests_on(&decider, steer.instance),
        0,
        "settled: counted once"
    );
    assert_eq!(decider.replica_loads().on(steer.instance).requests, 1);
}

#[tokio::test]
async fn the_decider_waits_for_the_share_that_shows_what_the_asker_shed_before_asking() {
    // Without the work term, so that the running turn's 4,000 queued tokens outweigh the next
    // turn's cached blocks until a share shows the turn ended.
    let config = KvRoutingConfig {
        work_weight: 0.0,
        ..config()
    };
    let (decider, instances, registry) = router_and_metrics(config, 2);
    let waits = |outcome: &str| {
        let line =
            format!("kvmesh_route_decider_share_waits_total{{model=\"m\",outcome=\"{outcome}\"}} ");
        metrics_text(&registry)
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()).map(str::to_owned))
    };
    // Replica 9 sent a conversation's first turn to instance 0, which holds its blocks now,
    // and its share shows the turn running there.
    let first = request(&decider, &conversation(1, 1_800));
    decider.apply_decision(0, &prompt_of(&first).hashes);
    let running = HashMap::from([(
        0,
        SharedLoad {
            prefill_tokens: 4_000,
            blocks: 30,
            requests: 1,
            ..SharedLoad::default()
        },
    )]);
    let before = OwnLoads {
        eased: 6,
        loads: running,
        ..OwnLoads::default()
    };
    assert!(decider.apply_replica_loads(9, share(1, before)));
    // The turn ended (replica 9's seventh easing) and it asks for the next turn at once.
    let next = request(&decider, &conversation(1, 1_900));
    assert_eq!(
        picked(choose(&decider, &instances, &next, 0)).instance_id,
        1,
        "decided on the share before the end, the next turn leaves its blocks"
    );
    let ended = async {
        tokio::task::yield_now().await;
        let after = OwnLoads {
            eased: 7,
            loads: HashMap::new(),
            ..OwnLoads::default()
        };
        assert!(decider.apply_replica_loads(9, share(2, after)));
    };
    let (shown, ()) = tokio::join!(decider.await_share(9, 7), ended);
    assert!(shown, "the share arrived while the ask waited");
    let excluded = Excluded::default();
    let candidates = Candidates::new(&instances, &excluded, 0);
    let steer = decider
        .decide_for(
            &candidates,
            prompt_of(&next),
            None,
            (9, 1, decider.settings()),
        )
        .expect("chosen");
    assert_eq!(steer.instance, 0, "where its blocks are");
    assert_eq!(waits("shown").as_deref(), Some("1"));
    // An ask the last share already covers does not wait; one whose share never comes waits
    // its bound, then is decided anyway.
    assert!(decider.await_share(9, 7).await);
    assert_eq!(waits("shown").as_deref(), Some("1"), "not a wait");
    let started = Instant::now();
    assert!(!decider.await_share(9, 8).await);
    assert!(started.elapsed() >= SHARE_WAIT, "{:?}", started.elapsed());
    assert_eq!(waits("late").as_deref(), Some("1"));
}

#[tokio::test]
async fn a_replica_asks_the_lowest_live_replica_and_takes_its_choice() {
    let (asker, instances, registry) = router_and_metrics(config(), 2);
    let asks_timed = || {
        let text = metrics_text(&registry);
        let line = "kvmesh_route_decision_seconds_count{model=\"m\",stage=\"ask\"} ";
        text.lines()
            .find_map(|l| l.strip_prefix(line))
            .map(|count| count.to_string())
    };
    let mut outbox = asker.serve_asks(5).expect("asks start once");
    assert!(asker.serve_asks(5).is_none());
    let fresh = request(&asker, &conversation(1, 400));
    let excluded = Excluded::default();
    let candidates = Candidates::new(&instances, &excluded, 0);
    // Alone, it asks nobody.
    assert_eq!(asker.ask_decider(&candidates, &fresh).await, None);
    assert!(outbox.try_recv().is_err());
    // A replica with a higher id is not its decider; one with a lower id is.
    assert!(asker.apply_replica_loads(8, share(1, OwnLoads::default())));
    assert_eq!(asker.ask_decider(&candidates, &fresh).await, None);
    assert!(outbox.try_recv().is_err());
    assert!(asker.apply_replica_loads(3, share(1, OwnLoads::default())));
    let answer = async {
        let ask = outbox.recv().await.expect("an ask");
        assert_eq!(
            (ask.decider, ask.seq, ask.candidates.clone()),
            (3, 1, vec![0, 1])
        );
        assert_eq!(ask.settings, asker.settings());
        ask.answer
            .send(Some(Steer {
                instance: 1,
                dp_rank: None,
                session_bound: false,
            }))
            .expect("waiting");
    };
    assert_eq!(asks_timed().as_deref(), Some("0"), "nothing was asked yet");
    let (steer, ()) = tokio::join!(asker.ask_decider(&candidates, &fresh), answer);
    let steer = steer.expect("the decider chose");
    assert_eq!(asker.decided(), 1);
    assert_eq!(
        asks_timed().as_deref(),
        Some("1"),
        "the wait for the answer"
    );
    // Its own view prefers instance 0 (1 holds a booking); the decider's choice wins.
    let held = request_on(&asker, &instances, 1);
    let input = PolicyInput::Kv(fresh);
    let alone = asker
        .pick_steered(&candidates, &input, None)
        .expect("picked");
    assert_eq!(alone.index, 0);
    drop(alone);
    let steered = asker
        .pick_steered(&candidates, &input, Some(steer))
        .expect("picked");
    assert_eq!(steered.index, 1);
    drop((steered, held));
}

#[tokio::test]
async fn a_decider_that_does_not_answer_in_time_is_not_asked_for_a_while() {
    let config = KvRoutingConfig {
        decider_timeout: Duration::from_millis(20),
        ..config()
    };
    let (asker, instances) = router_with(config, 2);
    let excluded = Excluded::default();
    let candidates = Candidates::new(&instances, &excluded, 0);
    let mut outbox = asker.serve_asks(5).expect("asks start");
    assert!(asker.apply_replica_loads(3, share(1, OwnLoads::default())));
    let request = request(&asker, &conversation(1, 400));
    assert_eq!(asker.ask_decider(&candidates, &request).await, None);
    let unanswered = outbox.try_recv().expect("it was asked");
    assert_eq!(asker.decided(), 1, "given up is settled");
    assert_eq!(asker.ask_decider(&candidates, &request).await, None);
    assert!(outbox.try_recv().is_err(), "quiet after a timeout");
    drop(unanswered);
}

#[tokio::test]
async fn a_replica_whose_own_choice_is_decisive_routes_without_asking() {
    // Without the work term, so that 28 unseen turns can outweigh 1,800 cached tokens.
    let config = KvRoutingConfig {
        work_weight: 0.0,
        ..config()
    };
    let (asker, instances, registry) = router_and_metrics(config, 2);
    let asks = |outcome: &str| {
        let line = format!("kvmesh_route_decider_asks_total{{model=\"m\",outcome=\"{outcome}\"}} ");
        metrics_text(&registry)
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()).map(str::to_owned))
    };
    let excluded = Excluded::default();
    let candidates = Candidates::new(&instances, &excluded, 0);
    let mut outbox = asker.serve_asks(100).expect("asks start");
    assert!(asker.apply_replica_loads(3, share(1, OwnLoads::default())));
    // Instance 0 holds a conversation's first turn: its next turn prefills about 100 new
    // tokens there and 1,900 on instance 1. One other replica's unseen turn like it would
    // not change that: not asked.
    let first = request(&asker, &conversation(1, 1_800));
    asker.apply_decision(0, &prompt_of(&first).hashes);
    let next = request(&asker, &conversation(1, 1_900));
    assert_eq!(asker.ask_decider(&candidates, &next).await, None);
    assert!(outbox.try_recv().is_err(), "not asked");
    assert_eq!(asks("decisive").as_deref(), Some("1"));
    // With 28 other replicas, 28 unseen turns of 100 tokens could: it asks.
    for replica in 4..31 {
        assert!(asker.apply_replica_loads(replica, share(1, OwnLoads::default())));
    }
    let answer = async {
        let ask = tokio::time::timeout(Duration::from_secs(5), outbox.recv())
            .await
            .expect("asked")
            .expect("an ask");
        assert_eq!(ask.decider, 3);
        ask.answer
            .send(Some(Steer {
                instance: 0,
                dp_rank: None,
                session_bound: false,
            }))
            .expect("waiting");
    };
    let (steer, ()) = tokio::join!(asker.ask_decider(&candidates, &next), answer);
    assert_eq!(steer.map(|steer| steer.instance), Some(0));
    assert_eq!(asks("chosen").as_deref(), Some("1"));
    assert_eq!(asks("decisive").as_deref(), Some("1"));
    // A fresh prompt on two idle instances is a tie: asked.
    let fresh = request(&asker, &conversation(2, 400));
    let answer = async {
        let ask = tokio::time::timeout(Duration::from_secs(5), outbox.recv())
            .await
            .expect("asked")
            .expect("an ask");
        ask.answer.send(None).expect("waiting");
    };
    let (steer, ()) = tokio::join!(asker.ask_decider(&candidates, &fresh), answer);
    assert_eq!(steer, None);
    assert_eq!(asks("declined").as_deref(), Some("1"));
    // The same tie in a session bound to an open instance: the binding decides, not asked.
    asker.apply_session(SessionBinding {
        session: Arc::from("bound"),
        instance: 1,
        ttl: Duration::from_secs(60),
    });
    let bound = request(&asker, &conversation(3, 400)).in_session(Some("bound"));
    assert_eq!(asker.ask_decider(&candidates, &bound).await, None);
    assert!(outbox.try_recv().is_err(), "not asked");
    assert_eq!(asks("decisive").as_deref(), Some("2"));
}

#[test]
fn kv_settings_that_differ_have_other_fingerprints() {
    let (one, _) = router_with(config(), 1);
    let (same, _) = router_with(config(), 1);
    let other = KvRoutingConfig {
        tier_weights: kvmesh_config::KvTierWeights {
            host: 0.25,
            ..kvmesh_config::KvTierWeights::default()
        },
        ..config()
    };
    let (other, _) = router_with(other, 1);
    assert_eq!(one.settings(), same.settings());
    assert_ne!(one.settings(), other.settings());
}

#[test]
fn a_zero_decider_timeout_never_asks() {
    let config = KvRoutingConfig {
        decider_timeout: Duration::ZERO,
        ..config()
    };
    let (router, _) = router_with(config, 1);
    assert!(router.serve_asks(1).is_none());
}

/// A booking of a fresh prompt on `instance` of `router`.
fn request_on<'a>(router: &'a KvRouter, instances: &[Arc<Fake>], instance: u64) -> Booking<'a> {
    let heavy = request(router, &conversation(77, 4_000));
    let decision = Decision {
        index: instance as usize,
        instance_id: instance,
        ..picked(choose(router, instances, &heavy, 0))
    };
    router.commit(&decision, &heavy, Instant::now())
}
