//! Why a request went where it went: the `x-kvmesh-route` response header and the body of the
//! admin `POST /debug/route` endpoint.

use std::fmt::Write;

use serde::Serialize;

use crate::kv::cache_check::CacheCheckState;
use crate::kv::cost::Cost;
use crate::kv::decision::{Decision, KvRequest};
use crate::kv::load::LoadSnapshot;
use crate::kv::overlap::{TierWeights, instance_depth};
use crate::kv::tokenizer_check::TokenizerMismatch;
use crate::prepare::RouteInput;

/// The value of `x-kvmesh-route`: `instance=http://…; overlap_blocks=12; prompt_blocks=20;
/// ttft_ms=24.4; cost=31.5`, with `; reported_blocks=9` while KV events flow (the part of
/// the overlap the instance's engine reported caching, without this proxy's predictions of
/// its own decisions: what the engine's `cached_tokens` should show), `; rank=N` when the
/// request goes to the data-parallel rank that reported it, `; session=bound` when
/// the request's session chose the instance and `; fallback=<reason>` for a request routed
/// without tokens.
pub(crate) fn route_header(instance: &str, decision: &Decision, request: &KvRequest) -> String {
    let mut text = String::with_capacity(instance.len() + HEADER_SPARE);
    text.push_str("instance=");
    text.push_str(instance);
    push_field(&mut text, "overlap_blocks=", decision.overlap_blocks);
    push_field(&mut text, "prompt_blocks=", request.shape.full_blocks);
    text.push_str("; ttft_ms=");
    push_tenths(&mut text, decision.cost.ttft_ms);
    text.push_str("; cost=");
    push_tenths(&mut text, decision.cost.value);
    if let Some(reported) = &request.reported {
        let blocks = instance_depth(reported, decision.instance_id).min(request.shape.full_blocks);
        push_field(&mut text, "reported_blocks=", blocks);
    }
    if let Some(rank) = decision.dp_rank {
        push_field(&mut text, "rank=", rank);
    }
    if decision.affinity {
        text.push_str("; session=bound");
    }
    if let RouteInput::Fallback(reason) = &request.input {
        text.push_str("; fallback=");
        text.push_str(reason.label());
    }
    text
}

/// Room for the header's fields after the instance's URL, so that it is built without
/// growing.
const HEADER_SPARE: usize = 160;

/// Appends `; {name}{value}`.
fn push_field(text: &mut String, name: &str, value: impl itoa::Integer) {
    text.push_str("; ");
    text.push_str(name);
    text.push_str(itoa::Buffer::new().format(value));
}

/// Appends `value` with one decimal, as `{value:.1}` writes it, except that a value at (or
/// within a rounding error of) a tie may round away from zero where the float formatter
/// rounds to even, and a value that rounds to zero has no sign. Per request, this takes a
/// fraction of the float formatter's instructions.
fn push_tenths(text: &mut String, value: f64) {
    const EXACT: f64 = 1e15;
    let tenths = (value * 10.0).round();
    if tenths.is_nan() || tenths.abs() >= EXACT {
        let _ = write!(text, "{value:.1}");
        return;
    }
    let tenths = tenths as i64;
    if tenths < 0 {
        text.push('-');
    }
    let tenths = tenths.unsigned_abs();
    text.push_str(itoa::Buffer::new().format(tenths / 10));
    text.push('.');
    text.push(char::from(b'0' + (tenths % 10) as u8));
}

/// The `tracing` target of the decision log: at `debug`, one line per routing decision with
/// every candidate the cost compared (`RUST_LOG=info,kvmesh::decision=debug`), so that
/// placement can be studied after a run without `POST /debug/route` at each request.
pub(crate) const DECISION_TARGET: &str = "kvmesh::decision";

/// One candidate of a decision, as the decision log writes it.
pub(crate) struct LoggedCandidate<'a> {
    /// Its URL.
    pub(crate) url: &'a str,
    /// Its cached prefix blocks of the request.
    pub(crate) overlap_blocks: u32,
    /// Its load when scored.
    pub(crate) load: &'a LoadSnapshot,
    /// Its cost.
    pub(crate) cost: &'a Cost,
}

/// The decision log's candidates field: `url overlap=… prefill=… blocks=… foreign=…
/// requests=… queued=… speed=… ttft=… harm=… queue=… work=… cost=…`, candidates separated by
/// ` | ` (`blocks`: active KV blocks, `foreign` of them the engine's report beyond the
/// proxies' own).
pub(crate) fn decision_candidates<'a>(
    candidates: impl IntoIterator<Item = LoggedCandidate<'a>>,
) -> String {
    let mut text = String::new();
    for (i, c) in candidates.into_iter().enumerate() {
        if i > 0 {
            text.push_str(" | ");
        }
        let _ = write!(
            text,
            "{} overlap={} prefill={} blocks={} foreign={} requests={} queued={} speed={:.2} ttft={:.1} harm={:.1} queue={:.1} work={:.1} cost={:.1}",
            c.url,
            c.overlap_blocks,
            c.load.prefill_tokens,
            c.load.blocks,
            c.load.foreign_blocks,
            c.load.requests,
            c.load.prefill_requests,
            c.load.speed,
            c.cost.ttft_ms,
            c.cost.harm_ms,
            c.cost.queue_ms,
            c.cost.work_ms,
            c.cost.value,
        );
    }
    text
}

/// How a request would be routed now (`POST /debug/route`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    /// Tokens per block.
    pub(crate) block_size: u64,
    /// `kv.overlap_weight`.
    pub(crate) overlap_weight: f64,
    /// `kv.harm_weight`.
    pub(crate) harm_weight: f64,
    /// `kv.queue_weight`.
    pub(crate) queue_weight: f64,
    /// `kv.work_weight`.
    pub(crate) work_weight: f64,
    /// `kv.overlap_credit_decay`.
    pub(crate) overlap_credit_decay: f64,
    /// `kv.tier_weights`.
    pub(crate) tier_weights: TierWeights,
    /// `kv.temperature`.
    pub(crate) temperature: f64,
    /// The model's learned token factor ([`crate::kv::token_cost`]).
    pub(crate) token_factor: f64,
    /// Prompt tokens (0 without tokens).
    pub(crate) prompt_tokens: usize,
    /// Full blocks of the prompt.
    pub(crate) prompt_blocks: u32,
    /// Why the request has no tokens, when it has none.
    pub(crate) fallback: Option<&'static str>,
    /// The instance one draw of the selection picks now (`None`: none eligible or all busy).
    pub(crate) chosen: Option<String>,
    /// Every eligible instance is busy (the request would queue or get 503).
    pub(crate) all_busy: bool,
    /// The instance the request's session is bound to, if any.
    pub(crate) session_bound_to: Option<String>,
    /// Every instance, in config order.
    pub(crate) instances: Vec<InstanceExplanation>,
}

/// One instance in an [`Explanation`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InstanceExplanation {
    /// Its URL.
    pub(crate) instance: String,
    /// Healthy and not ejected.
    pub(crate) eligible: bool,
    /// Past a busy threshold.
    pub(crate) busy: bool,
    /// Cached prefix blocks of this request, in device memory.
    pub(crate) overlap_blocks: u32,
    /// The blocks after those that its engine holds in host memory (loaded back, counted at
    /// `kv.tier_weights.host`).
    pub(crate) host_blocks: u32,
    /// The blocks after those that it holds on disk (counted at `kv.tier_weights.disk`).
    pub(crate) disk_blocks: u32,
    /// The part of them its engine reported caching (KV events), without this proxy's
    /// predictions; `None` while events do not flow.
    pub(crate) reported_blocks: Option<u32>,
    /// Active prefill tokens now.
    pub(crate) active_prefill_tokens: u64,
    /// Active blocks now.
    pub(crate) active_blocks: u64,
    /// Requests booked now.
    pub(crate) active_requests: usize,
    /// Requests queued for prefill now (before their first byte): this proxy's, the other
    /// replicas' and those the engine reported waiting beyond them.
    pub(crate) queued_requests: usize,
    /// The KV cache capacity its load is measured by: its engine's (from the instance
    /// record), else `kv.total_kv_blocks` (0: unknown).
    pub(crate) kv_capacity_blocks: u64,
    /// Requests in flight now (the tie-break).
    pub(crate) in_flight: u64,
    /// Prefill tokens with this request.
    pub(crate) prefill_tokens: u64,
    /// Decode blocks with this request.
    pub(crate) decode_blocks: u64,
    /// How much slower than profiled the instance proved to be (1: as profiled).
    pub(crate) speed: f64,
    /// The first tokens `speed` was learned from (this replica's and those other replicas
    /// shared).
    pub(crate) speed_samples: u64,
    /// Predicted time to first token there, ms.
    pub(crate) predicted_ttft_ms: f64,
    /// Predicted time between its tokens there, ms.
    pub(crate) predicted_itl_ms: f64,
    /// Predicted stall of the streams running there, summed, ms.
    pub(crate) harm_ms: f64,
    /// Predicted wait added to the requests queued there for prefill, summed, ms.
    pub(crate) queue_ms: f64,
    /// The work the request's own prefill puts on the instance, ms.
    pub(crate) work_ms: f64,
    /// The cost.
    pub(crate) cost: f64,
    /// Chance of being chosen (0 for ineligible or busy instances).
    pub(crate) probability: f64,
    /// The block size of the instance's engine (from its instance record) when it differs
    /// from the model's `block_size`: its overlap is then predicted from routing decisions,
    /// not read from its KV events. Absent when they agree.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) block_size_mismatch: Option<u64>,
    /// Where the instance's engine tokenized a probe otherwise than the proxy (its
    /// `/tokenize`, checked when it registered): its overlap is then predicted from routing
    /// decisions, not read from its KV events. Absent when they agree or were not compared.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tokenizer_mismatch: Option<TokenizerMismatch>,
    /// How its engine's answers compared with the index (`kv.cache_check`); absent while
    /// the check is off or nothing was counted yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) cache_check: Option<CacheCheckState>,
    /// Its agent lost KV events the engine could not replay: its overlap is predicted from
    /// routing decisions until the agent's view is whole again. Absent when whole.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) events_incomplete: bool,
}

/// [`route_header`], followed by `; block_size_mismatch=<the engine's block size>` when the
/// chosen instance's engine runs another block size than the model, and by
/// `; tokenizer_mismatch=<probe>` when it tokenized that probe otherwise than the proxy:
/// either way its overlap was predicted from routing decisions, not read from its KV events.
pub(crate) fn route_header_noting(
    instance: &str,
    decision: &Decision,
    request: &KvRequest,
    block_size_mismatch: Option<u64>,
    tokenizer_mismatch: Option<&str>,
) -> String {
    let mut text = route_header(instance, decision, request);
    if let Some(engine) = block_size_mismatch {
        push_field(&mut text, "block_size_mismatch=", engine);
    }
    if let Some(probe) = tokenizer_mismatch {
        text.push_str("; tokenizer_mismatch=");
        text.push_str(probe);
    }
    text
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kvmesh_kv::{OverlapScores, WorkerKey, WorkerOverlap};

    use super::*;
    use crate::kv::cost::{Cost, RequestShape};
    use crate::prepare::{FallbackReason, PromptBlocks};

    #[test]
    fn the_header_names_instance_overlap_size_and_cost() {
        let decision = Decision {
            index: 1,
            instance_id: 1,
            overlap_blocks: 12,
            cost: Cost {
                ttft_ms: 24.44,
                value: 31.5,
                ..Cost::default()
            },
            affinity: false,
            dp_rank: None,
        };
        let prompt = PromptBlocks {
            tokens: 1300,
            hashes: Default::default(),
            block_size: 64,
        };
        let request = KvRequest {
            input: RouteInput::Tokens(Arc::new(prompt)),
            shape: RequestShape::new(1300, 64),
            scores: OverlapScores::default(),
            reported: None,
            session: None,
        };
        let header = route_header("http://127.0.0.1:8001", &decision, &request);
        assert_eq!(
            header,
            "instance=http://127.0.0.1:8001; overlap_blocks=12; prompt_blocks=20; ttft_ms=24.4; cost=31.5"
        );
        let fallback = KvRequest {
            input: RouteInput::Fallback(FallbackReason::Route),
            shape: RequestShape::default(),
            scores: OverlapScores::default(),
            reported: None,
            session: None,
        };
        let header = route_header("http://h:1", &decision, &fallback);
        assert!(header.ends_with("; fallback=route"));
        // With live events, the engine-reported part of the chosen instance's overlap.
        let reported = OverlapScores {
            workers: vec![WorkerOverlap {
                worker: WorkerKey::new(1, 0),
                depth: 9,
                cached_blocks: 40,
            }],
        };
        let with_events = KvRequest {
            reported: Some(reported),
            ..request
        };
        let header = route_header("http://127.0.0.1:8001", &decision, &with_events);
        assert!(
            header.ends_with("; cost=31.5; reported_blocks=9"),
            "{header}"
        );
        // Sent to the rank that reported it.
        let ranked = Decision {
            dp_rank: Some(1),
            ..decision
        };
        let header = route_header("http://127.0.0.1:8001", &ranked, &with_events);
        assert!(header.ends_with("; reported_blocks=9; rank=1"), "{header}");
    }

    #[test]
    fn the_header_notes_an_engine_of_another_block_size() {
        let decision = Decision {
            index: 0,
            instance_id: 3,
            overlap_blocks: 2,
            cost: Cost {
                ttft_ms: 1.0,
                value: 2.0,
                ..Cost::default()
            },
            affinity: false,
            dp_rank: None,
        };
        let request = KvRequest::without_prompt();
        let plain = route_header("http://h:1", &decision, &request);
        assert_eq!(
            route_header_noting("http://h:1", &decision, &request, None, None),
            plain
        );
        let noted = route_header_noting("http://h:1", &decision, &request, Some(32), None);
        assert_eq!(noted, format!("{plain}; block_size_mismatch=32"));
        let noted = route_header_noting("http://h:1", &decision, &request, None, Some("chat"));
        assert_eq!(noted, format!("{plain}; tokenizer_mismatch=chat"));
    }

    #[test]
    fn the_decision_log_lists_every_candidate_with_its_cost() {
        let idle = LoadSnapshot::default();
        let busy = LoadSnapshot {
            prefill_tokens: 700,
            blocks: 40,
            foreign_blocks: 2,
            requests: 3,
            prefill_requests: 1,
            speed: 2.5,
            ..LoadSnapshot::default()
        };
        let cheap = Cost {
            ttft_ms: 20.04,
            value: 20.04,
            ..Cost::default()
        };
        let dear = Cost {
            ttft_ms: 48.0,
            harm_ms: 12.5,
            queue_ms: 30.0,
            work_ms: 7.5,
            value: 90.5,
            ..Cost::default()
        };
        let line = decision_candidates([
            LoggedCandidate {
                url: "http://a:1",
                overlap_blocks: 0,
                load: &idle,
                cost: &cheap,
            },
            LoggedCandidate {
                url: "http://b:2",
                overlap_blocks: 9,
                load: &busy,
                cost: &dear,
            },
        ]);
        assert_eq!(
            line,
            "http://a:1 overlap=0 prefill=0 blocks=0 foreign=0 requests=0 queued=0 speed=1.00 ttft=20.0 harm=0.0 queue=0.0 work=0.0 cost=20.0 \
             | http://b:2 overlap=9 prefill=700 blocks=40 foreign=2 requests=3 queued=1 speed=2.50 ttft=48.0 harm=12.5 queue=30.0 work=7.5 cost=90.5"
        );
        assert_eq!(decision_candidates([]), "");
    }

    fn tenths(value: f64) -> String {
        let mut text = String::new();
        push_tenths(&mut text, value);
        text
    }

    #[test]
    fn tenths_read_as_the_float_formatter_writes_them() {
        for value in [
            0.0, 0.04, 1.0, 24.44, 31.5, 9.96, 99.99, 1234.56, -3.21, -0.96, 7e13,
        ] {
            assert_eq!(tenths(value), format!("{value:.1}"), "{value}");
        }
        assert_eq!(tenths(-0.01), "0.0");
        for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e300] {
            assert_eq!(tenths(value), format!("{value:.1}"), "{value}");
        }
    }

    proptest::proptest! {
        /// Away from ties (more than 0.01 from one), the two agree.
        #[test]
        fn tenths_agree_with_the_float_formatter_away_from_ties(
            whole in -1_000_000_000i64..1_000_000_000,
            offset in -0.039f64..0.039,
        ) {
            let value = whole as f64 / 10.0 + offset;
            proptest::prop_assume!(whole != 0 || value >= 0.0);
            proptest::prop_assert_eq!(tenths(value), format!("{value:.1}"));
        }
    }
}
