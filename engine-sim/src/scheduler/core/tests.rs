use std::sync::Arc;
use std::time::Instant;

use tokio::sync::broadcast;
use tokio::sync::mpsc::{self, UnboundedReceiver};

use super::*;
use crate::config::{OffloadConfig, OffloadEvents};
use crate::hashing::{EngineHash, XXH3_SEED};
use crate::kv_events::{KvEvent, Medium};
use crate::lora::Lora;
use crate::scheduler::{Handoff, SeqRequest};

fn config(block_size: usize, num_gpu_blocks: usize) -> SimConfig {
    SimConfig {
        block_size,
        num_gpu_blocks,
        ..SimConfig::default()
    }
}

struct Fixture {
    core: SchedulerCore,
    metrics: Arc<EngineMetrics>,
    events: broadcast::Receiver<Arc<KvEventBatch>>,
}

fn fixture(config: &SimConfig) -> Fixture {
    let metrics = Arc::new(EngineMetrics::new(config, 0));
    let (tx, events) = broadcast::channel(64);
    Fixture {
        core: SchedulerCore::new(config, metrics.clone(), tx),
        metrics,
        events,
    }
}

fn request(
    prompt: Vec<u32>,
    block_size: usize,
    max_tokens: usize,
    stream: bool,
    stops: &[&str],
) -> (SeqRequest, UnboundedReceiver<SeqEvent>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let prompt_hashes = BlockHasher::new().sequence_hashes(&prompt, block_size, XXH3_SEED);
    let req = SeqRequest {
        index: 0,
        seed: crate::hashing::content_seed(&prompt),
        prompt,
        prompt_hashes,
        lora: None,
        cache_salt: None,
        max_tokens,
        stops: stops.iter().map(|s| (*s).to_owned()).collect(),
        stream,
        arrival: Instant::now(),
        tx,
        handoff: Handoff::None,
    };
    (req, rx)
}

/// A one-token request for `prompt` served with adapter `lora`.
fn adapter_request(
    prompt: Vec<u32>,
    block_size: usize,
    lora: &Lora,
) -> (SeqRequest, UnboundedReceiver<SeqEvent>) {
    let (mut req, rx) = request(prompt, block_size, 1, false, &[]);
    req.prompt_hashes =
        BlockHasher::new().sequence_hashes(&req.prompt, block_size, lora.hash_seed());
    req.lora = Some(lora.clone());
    (req, rx)
}

/// Runs iterations until nothing is left; returns the plans.
fn run_until_idle(core: &mut SchedulerCore) -> Vec<StepPlan> {
    let mut plans = Vec::new();
    for _ in 0..10_000 {
        if core.is_idle() {
            return plans;
        }
        let plan = core.schedule();
        core.complete(Instant::now());
        core.publish_events();
        plans.push(plan);
    }
    panic!("scheduler did not drain");
}

fn outcome(rx: &mut UnboundedReceiver<SeqEvent>) -> SeqOutcome {
    let mut streamed = String::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            SeqEvent::Delta { text, .. } => streamed.push_str(&text),
            SeqEvent::Finished(mut o) => {
                streamed.push_str(&o.text);
                o.text = streamed;
                return o;
            }
            SeqEvent::Failed { message, .. } => panic!("failed: {message}"),
        }
    }
    panic!("no outcome");
}

#[test]
fn a_prefill_leg_holds_its_blocks_until_they_are_read() {
    let mut f = fixture(&config(4, 64));
    let (mut req, mut rx) = request((0..10).collect(), 4, 1, false, &[]);
    req.handoff = Handoff::Hold("cmpl-1".into());
    f.core.enqueue(req);
    run_until_idle(&mut f.core);
    let held = outcome(&mut rx).held_blocks;
    // 10 prompt tokens and the sampled one: 3 blocks of 4, still allocated.
    assert_eq!(held.len(), 3);
    assert_eq!(f.core.cache().active_blocks(), 3);
    assert!(f.core.next_hold_deadline().is_some());
    assert_eq!(
        f.core.read_held(Some("cmpl-2"), &held),
        None,
        "another request's id"
    );
    assert_eq!(f.core.read_held(Some("cmpl-1"), &held), Some(3));
    assert_eq!(f.core.cache().active_blocks(), 0);
    assert_eq!(f.core.read_held(Some("cmpl-1"), &held), None, "read twice");
    assert_eq!(f.core.next_hold_deadline(), None);
}

#[test]
fn an_unread_hold_expires_and_a_hold_is_found_by_its_blocks() {
    let mut cfg = config(4, 64);
    cfg.kv_transfer.hold_timeout = std::time::Duration::from_secs(5);
    let mut f = fixture(&cfg);
    for (n, id) in ["a", "b"].into_iter().enumerate() {
        let (mut req, mut rx) = request(
            (0..8).map(|t| t + n as u32 * 100).collect(),
            4,
            1,
            false,
            &[],
        );
        req.handoff = Handoff::Hold(id.into());
        f.core.enqueue(req);
        run_until_idle(&mut f.core);
        outcome(&mut rx);
    }
    let deadline = f.core.next_hold_deadline().unwrap();
    f.core
        .expire_held(deadline - std::time::Duration::from_millis(1));
    assert_eq!(
        f.core.cache().active_blocks(),
        4,
        "not yet: two holds of two blocks"
    );
    f.core
        .expire_held(deadline + std::time::Duration::from_secs(1));
    assert_eq!(f.core.cache().active_blocks(), 0);
    assert!(
        f.metrics
            .render()
            .contains("kvmesh_sim_kv_holds_expired_total{engine=\"0\",model_name=\"sim-model\"} 2")
    );

    let (mut req, mut rx) = request((0..8).collect(), 4, 1, false, &[]);
    req.handoff = Handoff::Hold("c".into());
    f.core.enqueue(req);
    run_until_idle(&mut f.core);
    let held = outcome(&mut rx).held_blocks;
    assert_eq!(
        f.core.read_held(None, &held[..1]),
        None,
        "not the whole list"
    );
    assert_eq!(f.core.read_held(None, &held), Some(held.len()));
}

#[test]
fn a_decode_leg_prefills_only_what_was_not_pulled_and_stores_the_pulled_blocks() {
    let mut f = fixture(&config(4, 64));
    let (mut req, mut rx) = request((0..10).collect(), 4, 2, false, &[]);
    req.handoff = Handoff::Pulled(10);
    f.core.enqueue(req);
    let plans = run_until_idle(&mut f.core);
    // Two full blocks (8 tokens) arrived; the last two prompt tokens are computed here.
    assert_eq!(plans[0].prefill_tokens, 2);
    let done = outcome(&mut rx);
    assert_eq!((done.completion_tokens, done.cached_tokens), (2, 0));
    assert_eq!(
        f.metrics.snapshot().prefix_hits,
        0,
        "pulled is not a local hit"
    );
    let stored: usize = std::iter::from_fn(|| f.events.try_recv().ok())
        .flat_map(|batch| batch.events.clone())
        .filter(|event| matches!(event, KvEvent::BlockStored { .. }))
        .count();
    assert!(stored >= 1, "the pulled blocks are published as stored");
    // The next request with the same prefix hits them locally.
    let (again, mut rx) = request((0..10).collect(), 4, 1, false, &[]);
    f.core.enqueue(again);
    run_until_idle(&mut f.core);
    assert_eq!(outcome(&mut rx).cached_tokens, 8);
}

#[test]
fn repeated_prompt_hits_its_full_blocks() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (0..10).collect();
    let (r1, mut rx1) = request(prompt.clone(), 4, 3, false, &[]);
    f.core.enqueue(r1);
    run_until_idle(&mut f.core);
    assert_eq!(outcome(&mut rx1).completion_tokens, 3);
    assert_eq!(f.metrics.snapshot().prefix_queries, 10);
    assert_eq!(f.metrics.snapshot().prefix_hits, 0);

    let (r2, mut rx2) = request(prompt, 4, 3, false, &[]);
    f.core.enqueue(r2);
    run_until_idle(&mut f.core);
    let o = outcome(&mut rx2);
    assert_eq!(o.cached_tokens, 8);
    assert_eq!(f.metrics.snapshot().prefix_queries, 20);
    assert_eq!(f.metrics.snapshot().prefix_hits, 8);
}

#[test]
fn adapter_blocks_match_only_the_same_adapter() {
    let mut f = fixture(&config(4, 64));
    let a = Lora {
        id: 1,
        name: "a".into(),
    };
    let b = Lora {
        id: 2,
        name: "b".into(),
    };
    let prompt: Vec<u32> = (0..10).collect();
    let mut cached = |req: (SeqRequest, UnboundedReceiver<SeqEvent>)| {
        let (r, mut rx) = req;
        f.core.enqueue(r);
        run_until_idle(&mut f.core);
        outcome(&mut rx).cached_tokens
    };
    assert_eq!(cached(adapter_request(prompt.clone(), 4, &a)), 0);
    assert_eq!(cached(adapter_request(prompt.clone(), 4, &a)), 8);
    assert_eq!(cached(request(prompt.clone(), 4, 1, false, &[])), 0);
    assert_eq!(cached(adapter_request(prompt.clone(), 4, &b)), 0);
    assert_eq!(cached(request(prompt.clone(), 4, 1, false, &[])), 8);
    assert_eq!(f.metrics.snapshot().prefix_hits, 16);

    // Each store carries its adapter and hashes in its adapter's engine-hash space.
    let mut stores = Vec::new();
    while let Ok(batch) = f.events.try_recv() {
        for e in &batch.events {
            if let KvEvent::BlockStored {
                block_hashes, lora, ..
            } = e
            {
                stores.push((lora.clone(), block_hashes[0]));
            }
        }
    }
    let mut h = BlockHasher::new();
    let first = |h: &mut BlockHasher, lora: Option<&str>| h.engine_hash(None, &prompt[..4], lora);
    assert_eq!(
        stores,
        vec![
            (Some(a), first(&mut h, Some("a"))),
            (None, first(&mut h, None)),
            (Some(b), first(&mut h, Some("b"))),
        ]
    );
}

#[test]
fn salted_prompts_match_only_the_same_salt() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (0..10).collect();
    let salted = |salt: Option<&str>| {
        let (mut r, rx) = request(prompt.clone(), 4, 1, false, &[]);
        r.cache_salt = salt.map(Arc::from);
        r.prompt_hashes = BlockHasher::new().salted_sequence_hashes(&r.prompt, 4, XXH3_SEED, salt);
        (r, rx)
    };
    let mut cached = |req: (SeqRequest, UnboundedReceiver<SeqEvent>)| {
        let (r, mut rx) = req;
        f.core.enqueue(r);
        run_until_idle(&mut f.core);
        outcome(&mut rx).cached_tokens
    };
    assert_eq!(cached(salted(Some("a"))), 0);
    assert_eq!(cached(salted(Some("a"))), 8);
    assert_eq!(cached(salted(None)), 0);
    assert_eq!(cached(salted(Some("b"))), 0);
    assert_eq!(cached(salted(None)), 8);
    // A salted prompt shorter than a block: its first block fills while it decodes, and is
    // salted then too.
    let (mut short, _rx) = request((0..3).collect(), 4, 2, false, &[]);
    short.cache_salt = Some(Arc::from("c"));
    f.core.enqueue(short);
    run_until_idle(&mut f.core);

    // The store of a sequence's first block names the salt; its engine hash carries it, and
    // only the first block's does.
    let mut h = BlockHasher::new();
    let mut stores = Vec::new();
    while let Ok(batch) = f.events.try_recv() {
        for e in &batch.events {
            if let KvEvent::BlockStored {
                block_hashes,
                parent_block_hash: None,
                token_ids,
                cache_salt,
                ..
            } = e
            {
                let salt = cache_salt.as_deref();
                let first = h.salted_engine_hash(None, &token_ids[..4], None, salt);
                assert_eq!(block_hashes[0], first);
                if let Some(&second) = block_hashes.get(1) {
                    let unsalted = h.engine_hash(Some(first.id()), &token_ids[4..8], None);
                    assert_eq!(second, unsalted);
                }
                stores.push(salt.map(str::to_owned));
            }
        }
    }
    let salt = |s: &str| Some(s.to_owned());
    assert_eq!(stores, vec![salt("a"), None, salt("b"), salt("c")]);
}

#[test]
fn exact_multiple_of_block_size_hits_one_block_less() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (100..112).collect();
    for _ in 0..2 {
        let (r, _rx) = request(prompt.clone(), 4, 1, false, &[]);
        f.core.enqueue(r);
        run_until_idle(&mut f.core);
    }
    assert_eq!(f.metrics.snapshot().prefix_hits, 8);
}

#[test]
fn prefix_caching_off_never_hits() {
    let cfg = SimConfig {
        enable_prefix_caching: false,
        ..config(4, 64)
    };
    let mut f = fixture(&cfg);
    let prompt: Vec<u32> = (0..10).collect();
    for _ in 0..2 {
        let (r, _rx) = request(prompt.clone(), 4, 2, false, &[]);
        f.core.enqueue(r);
        run_until_idle(&mut f.core);
    }
    assert_eq!(f.metrics.snapshot().prefix_hits, 0);
    assert!(f.events.try_recv().is_err());
}

#[test]
fn chunked_prefill_respects_the_token_budget() {
    let cfg = SimConfig {
        max_num_batched_tokens: 8,
        ..config(4, 64)
    };
    let mut f = fixture(&cfg);
    let (r, mut rx) = request((0..20).collect(), 4, 2, false, &[]);
    f.core.enqueue(r);
    let plans = run_until_idle(&mut f.core);
    let prefill: Vec<usize> = plans.iter().map(|p| p.prefill_tokens).collect();
    assert_eq!(prefill, vec![8, 8, 4, 0]);
    assert_eq!(outcome(&mut rx).completion_tokens, 2);
}

#[test]
fn decode_is_budgeted_before_new_prefill() {
    let cfg = SimConfig {
        max_num_batched_tokens: 8,
        ..config(4, 64)
    };
    let mut f = fixture(&cfg);
    let (a, _rxa) = request((0..4).collect(), 4, 5, false, &[]);
    f.core.enqueue(a);
    f.core.schedule();
    f.core.complete(Instant::now());
    let (b, _rxb) = request((50..70).collect(), 4, 5, false, &[]);
    f.core.enqueue(b);
    let plan = f.core.schedule();
    // One decode token for A, the remaining 7 for B's first prefill chunk.
    assert_eq!(plan.batch, 2);
    assert_eq!(plan.prefill_tokens, 7);
}

#[test]
fn max_num_seqs_bounds_running() {
    let cfg = SimConfig {
        max_num_seqs: 2,
        ..config(4, 64)
    };
    let mut f = fixture(&cfg);
    let mut rxs = Vec::new();
    for i in 0..3u32 {
        let (r, rx) = request(vec![i; 5], 4, 2, false, &[]);
        f.core.enqueue(r);
        rxs.push(rx);
    }
    f.core.schedule();
    assert_eq!(f.core.queue_lengths(), (2, 1));
    run_until_idle(&mut f.core);
    for rx in &mut rxs {
        assert_eq!(outcome(rx).completion_tokens, 2);
    }
}

fn preemption_fixture(
    mode: PreemptionMode,
) -> (
    Fixture,
    UnboundedReceiver<SeqEvent>,
    UnboundedReceiver<SeqEvent>,
) {
    let cfg = SimConfig {
        preemption_mode: mode,
        ..config(2, 4)
    };
    let mut f = fixture(&cfg);
    let (a, rxa) = request(vec![1, 2, 3], 2, 5, false, &[]);
    let (b, rxb) = request(vec![7, 8, 9], 2, 5, false, &[]);
    f.core.enqueue(a);
    f.core.enqueue(b);
    // Two steps fill all four blocks; the third needs a fifth block.
    for _ in 0..2 {
        f.core.schedule();
        f.core.complete(Instant::now());
    }
    assert_eq!(f.core.cache().active_blocks(), 4);
    (f, rxa, rxb)
}

#[test]
fn lifo_preempts_the_newest_sequence() {
    let (mut f, mut rxa, mut rxb) = preemption_fixture(PreemptionMode::Lifo);
    f.core.schedule();
    assert_eq!(f.metrics.snapshot().preemptions, 1);
    assert_eq!(f.core.queue_lengths(), (1, 1));
    f.core.complete(Instant::now());
    // A kept running and got its token; B waits with its progress kept for recomputation.
    run_until_idle(&mut f.core);
    let (a, b) = (outcome(&mut rxa), outcome(&mut rxb));
    assert_eq!((a.completion_tokens, b.completion_tokens), (5, 5));
    assert_eq!(a.finish, Finish::Length);
    // B recomputed its prefix on resume: its own evicted-or-cached blocks may hit.
    assert!(f.metrics.snapshot().prefix_queries >= 3 + 3 + 5);
}

#[test]
fn fifo_preempts_the_oldest_sequence() {
    let (mut f, mut rxa, mut rxb) = preemption_fixture(PreemptionMode::Fifo);
    let plan = f.core.schedule();
    assert_eq!(f.metrics.snapshot().preemptions, 1);
    assert_eq!(f.core.queue_lengths(), (1, 1));
    assert_eq!(plan.batch, 1);
    f.core.complete(Instant::now());
    run_until_idle(&mut f.core);
    assert_eq!(outcome(&mut rxa).completion_tokens, 5);
    assert_eq!(outcome(&mut rxb).completion_tokens, 5);
}

#[test]
fn identical_text_for_stream_and_non_stream() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (0..9).collect();
    let (a, mut rxa) = request(prompt.clone(), 4, 12, true, &[]);
    let (b, mut rxb) = request(prompt, 4, 12, false, &[]);
    f.core.enqueue(a);
    f.core.enqueue(b);
    run_until_idle(&mut f.core);
    let (a, b) = (outcome(&mut rxa), outcome(&mut rxb));
    assert_eq!(a.text, b.text);
    assert_eq!(a.text.split(' ').count(), 12);
}

#[test]
fn stop_string_ends_generation() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (0..9).collect();
    let (a, mut rxa) = request(prompt.clone(), 4, 12, false, &[]);
    f.core.enqueue(a);
    run_until_idle(&mut f.core);
    let full = outcome(&mut rxa).text;
    let third = full.split(' ').nth(2).unwrap_or_default().to_owned();
    let stop = format!(" {third}");
    let (b, mut rxb) = request(prompt, 4, 12, true, &[stop.as_str()]);
    f.core.enqueue(b);
    run_until_idle(&mut f.core);
    let o = outcome(&mut rxb);
    assert_eq!(o.finish, Finish::Stop);
    assert_eq!(o.stop.as_deref(), Some(stop.as_str()));
    assert!(o.completion_tokens <= 3);
    assert!(full.starts_with(&o.text));
    assert!(!o.text.contains(&stop));
}

#[test]
fn prompt_and_decode_blocks_are_stored_with_engine_hashes() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (0..4).collect();
    let (r, _rx) = request(prompt.clone(), 4, 6, false, &[]);
    f.core.enqueue(r);
    run_until_idle(&mut f.core);
    let mut stored = Vec::new();
    while let Ok(batch) = f.events.try_recv() {
        for e in &batch.events {
            if let KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } = e
            {
                stored.push((block_hashes.clone(), *parent_block_hash, token_ids.clone()));
            }
        }
    }
    assert_eq!(stored.len(), 2, "{stored:?}");
    let mut h = BlockHasher::new();
    let first = h.engine_hash(None, &prompt, None);
    assert_eq!(stored[0], (vec![first], None, prompt));
    // Second block: four generated tokens, promoted once decode filled it.
    let (hashes, parent, tokens) = &stored[1];
    assert_eq!(*parent, Some(first));
    assert_eq!(tokens.len(), 4);
    assert_eq!(hashes[0], h.engine_hash(Some(first.id()), tokens, None));
}

#[test]
fn reused_blocks_emit_no_new_store() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (0..9).collect();
    for _ in 0..2 {
        let (r, _rx) = request(prompt.clone(), 4, 1, false, &[]);
        f.core.enqueue(r);
        run_until_idle(&mut f.core);
    }
    let mut stores = 0;
    while let Ok(batch) = f.events.try_recv() {
        for e in &batch.events {
            if let KvEvent::BlockStored { block_hashes, .. } = e {
                stores += block_hashes.len();
            }
        }
    }
    assert_eq!(stores, 2);
}

#[test]
fn cancelled_sequences_release_their_blocks() {
    let mut f = fixture(&config(4, 64));
    let (r, rx) = request((0..10).collect(), 4, 100, false, &[]);
    f.core.enqueue(r);
    f.core.schedule();
    f.core.complete(Instant::now());
    assert!(f.core.cache().active_blocks() > 0);
    drop(rx);
    f.core.schedule();
    assert_eq!(f.core.cache().active_blocks(), 0);
    assert!(f.core.is_idle());
}

#[test]
fn unschedulable_sequence_fails_instead_of_stalling() {
    let mut f = fixture(&config(2, 1));
    let (r, mut rx) = request((0..5).collect(), 2, 1, false, &[]);
    f.core.enqueue(r);
    f.core.schedule();
    assert!(matches!(rx.try_recv(), Ok(SeqEvent::Failed { .. })));
    assert!(f.core.is_idle());
}

#[test]
fn reset_clears_the_cache_and_announces_it() {
    let mut f = fixture(&config(4, 64));
    let prompt: Vec<u32> = (0..9).collect();
    let (r, _rx) = request(prompt.clone(), 4, 1, false, &[]);
    f.core.enqueue(r);
    run_until_idle(&mut f.core);
    let (done, _wait) = tokio::sync::oneshot::channel();
    f.core.handle(Command::ResetPrefixCache {
        restart: false,
        done,
    });
    let mut cleared = false;
    while let Ok(batch) = f.events.try_recv() {
        cleared |= batch.events.contains(&KvEvent::AllBlocksCleared);
        assert!(!batch.engine_restarted);
    }
    assert!(cleared);
    let (r, _rx) = request(prompt, 4, 1, false, &[]);
    f.core.enqueue(r);
    run_until_idle(&mut f.core);
    assert_eq!(f.metrics.snapshot().prefix_hits, 0);
}

#[test]
fn simulated_restart_clears_in_its_own_marked_batch() {
    let mut f = fixture(&config(4, 64));
    let (r, _rx) = request((0..9).collect(), 4, 1, false, &[]);
    f.core.enqueue(r);
    f.core.schedule();
    f.core.complete(Instant::now());
    // The stores of the iteration are still unpublished when the restart arrives.
    let (done, _wait) = tokio::sync::oneshot::channel();
    f.core.handle(Command::ResetPrefixCache {
        restart: true,
        done,
    });
    let stored = f.events.try_recv().expect("the pending stores");
    assert!(!stored.engine_restarted);
    assert!(matches!(stored.events[0], KvEvent::BlockStored { .. }));
    let restart = f.events.try_recv().expect("the restart batch");
    assert!(restart.engine_restarted);
    assert_eq!(restart.events, vec![KvEvent::AllBlocksCleared]);
}

/// An engine with `gpu_blocks` device blocks of 4 tokens and a host tier of `host_blocks`
/// whose stores are announced in `form`.
fn offload_config(gpu_blocks: usize, host_blocks: usize, form: OffloadEvents) -> SimConfig {
    SimConfig {
        offload: OffloadConfig {
            blocks: host_blocks,
            events: form,
            ..OffloadConfig::default()
        },
        ..config(4, gpu_blocks)
    }
}

/// Every published event, in order.
fn published(f: &mut Fixture) -> Vec<KvEvent> {
    std::iter::from_fn(|| f.events.try_recv().ok())
        .flat_map(|batch| batch.events.clone())
        .collect()
}

fn hashes_on(events: &[KvEvent], on: Medium) -> (Vec<EngineHash>, Vec<EngineHash>) {
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for event in events {
        match event {
            KvEvent::BlockStored {
                block_hashes,
                medium,
                ..
            } if *medium == on => stored.extend_from_slice(block_hashes),
            KvEvent::BlockRemoved {
                block_hashes,
                medium,
            } if *medium == on => removed.extend_from_slice(block_hashes),
            _ => {}
        }
    }
    (stored, removed)
}

/// Runs a one-token request for `prompt`; its outcome and the plans.
fn serve(f: &mut Fixture, prompt: &[u32]) -> (SeqOutcome, Vec<StepPlan>) {
    let (r, mut rx) = request(prompt.to_vec(), 4, 1, false, &[]);
    f.core.enqueue(r);
    let plans = run_until_idle(&mut f.core);
    (outcome(&mut rx), plans)
}

#[test]
fn every_stored_block_is_offloaded_in_the_same_batch_after_the_device_stores() {
    let mut f = fixture(&offload_config(64, 16, OffloadEvents::Placeholder));
    let prompt: Vec<u32> = (0..10).collect();
    serve(&mut f, &prompt);
    let batch = f.events.try_recv().expect("the prefill's batch");
    let mut h = BlockHasher::new();
    let first = h.engine_hash(None, &prompt[..4], None);
    let second = h.engine_hash(Some(first.id()), &prompt[4..8], None);
    let placeholder = KvEvent::host_placeholder;
    assert_eq!(batch.events.len(), 3, "{:?}", batch.events);
    assert!(matches!(
        &batch.events[0],
        KvEvent::BlockStored { block_hashes, medium: Medium::Gpu, .. }
            if *block_hashes == [first, second]
    ));
    assert_eq!(batch.events[1..], [placeholder(first), placeholder(second)]);
    assert_eq!(f.core.cache().host_blocks(), 2);
}

#[test]
fn self_describing_offloads_name_parent_tokens_and_block_size() {
    let mut f = fixture(&offload_config(64, 16, OffloadEvents::SelfDescribing));
    let prompt: Vec<u32> = (0..10).collect();
    serve(&mut f, &prompt);
    let mut h = BlockHasher::new();
    let first = h.engine_hash(None, &prompt[..4], None);
    let second = h.engine_hash(Some(first.id()), &prompt[4..8], None);
    let host: Vec<KvEvent> = published(&mut f)
        .into_iter()
        .filter(|e| {
            matches!(
                e,
                KvEvent::BlockStored {
                    medium: Medium::Cpu,
                    ..
                }
            )
        })
        .collect();
    let described = |hash, parent, tokens: &[u32]| KvEvent::BlockStored {
        block_hashes: vec![hash],
        parent_block_hash: parent,
        token_ids: tokens.to_vec(),
        block_size: 4,
        lora: None,
        cache_salt: None,
        medium: Medium::Cpu,
    };
    assert_eq!(
        host,
        [
            described(first, None, &prompt[..4]),
            described(second, Some(first), &prompt[4..8])
        ]
    );
}

#[test]
fn a_host_hit_is_loaded_counted_as_cached_and_not_prefilled() {
    // 3 device blocks: a 10-token prompt and its token (3 blocks) is evicted by the next one.
    let mut f = fixture(&offload_config(3, 16, OffloadEvents::Placeholder));
    let a: Vec<u32> = (0..10).collect();
    let b: Vec<u32> = (100..110).collect();
    let (first, plans) = serve(&mut f, &a);
    assert_eq!(first.cached_tokens, 0);
    assert_eq!((plans[0].prefill_tokens, plans[0].loaded_tokens), (10, 0));
    serve(&mut f, &b);
    let a_hashes = BlockHasher::new().sequence_hashes(&a, 4, XXH3_SEED);
    assert_eq!(
        f.core.cache().lookup(&a_hashes),
        0,
        "evicted from the device"
    );
    assert_eq!(
        f.core.cache().host_lookup(&a_hashes),
        2,
        "kept in host memory"
    );
    published(&mut f);

    let (again, plans) = serve(&mut f, &a);
    // Both full blocks come from host memory: only the last two tokens are prefilled.
    assert_eq!(again.cached_tokens, 8);
    assert_eq!((plans[0].prefill_tokens, plans[0].loaded_tokens), (2, 8));
    let snapshot = f.metrics.snapshot();
    assert_eq!((snapshot.prefix_hits, snapshot.external_hits), (0, 8));
    assert_eq!(
        snapshot.external_queries, 30,
        "each admission queries past its device hit"
    );
    // The loaded blocks are device blocks again (stored there), and already on the host
    // tier (nothing new offloaded).
    let events = published(&mut f);
    let mut h = BlockHasher::new();
    let first = h.engine_hash(None, &a[..4], None);
    let second = h.engine_hash(Some(first.id()), &a[4..8], None);
    let (gpu_stored, _) = hashes_on(&events, Medium::Gpu);
    assert_eq!(gpu_stored, [first, second]);
    assert_eq!(hashes_on(&events, Medium::Cpu), (Vec::new(), Vec::new()));
    // So the next request hits them on the device.
    let (third, plans) = serve(&mut f, &a);
    assert_eq!(third.cached_tokens, 8);
    assert_eq!(plans[0].loaded_tokens, 0);
    assert_eq!(f.metrics.snapshot().prefix_hits, 8);
}

#[test]
fn a_full_host_tier_evicts_its_least_recently_used_blocks() {
    // Two host blocks: the second prompt's two blocks push out the first's.
    let mut f = fixture(&offload_config(64, 2, OffloadEvents::Placeholder));
    let a: Vec<u32> = (0..10).collect();
    let b: Vec<u32> = (100..110).collect();
    serve(&mut f, &a);
    let (a_hashes, _) = hashes_on(&published(&mut f), Medium::Cpu);
    assert_eq!(a_hashes.len(), 2);
    serve(&mut f, &b);
    let events = published(&mut f);
    let (b_hashes, removed) = hashes_on(&events, Medium::Cpu);
    assert_eq!(removed, a_hashes, "one removal naming both, oldest first");
    assert_eq!(b_hashes.len(), 2);
    let removal_at = events
        .iter()
        .position(|e| {
            matches!(
                e,
                KvEvent::BlockRemoved {
                    medium: Medium::Cpu,
                    ..
                }
            )
        })
        .expect("a host removal");
    let first_host_store = events
        .iter()
        .position(|e| {
            matches!(
                e,
                KvEvent::BlockStored {
                    medium: Medium::Cpu,
                    ..
                }
            )
        })
        .expect("a host store");
    assert!(
        removal_at < first_host_store,
        "room is made before the stores"
    );
    assert_eq!(f.core.cache().host_blocks(), 2);
}

#[test]
fn a_reset_empties_the_host_tier_with_only_the_device_clear() {
    let mut f = fixture(&offload_config(4, 16, OffloadEvents::Placeholder));
    let a: Vec<u32> = (0..10).collect();
    serve(&mut f, &a);
    published(&mut f);
    let (done, _wait) = tokio::sync::oneshot::channel();
    f.core.handle(Command::ResetPrefixCache {
        restart: false,
        done,
    });
    assert_eq!(published(&mut f), [KvEvent::AllBlocksCleared]);
    assert_eq!(f.core.cache().host_blocks(), 0);
    let (again, plans) = serve(&mut f, &a);
    assert_eq!(again.cached_tokens, 0);
    assert_eq!((plans[0].prefill_tokens, plans[0].loaded_tokens), (10, 0));
    // Offloaded anew.
    let (stored, _) = hashes_on(&published(&mut f), Medium::Cpu);
    assert_eq!(stored.len(), 2);
}
