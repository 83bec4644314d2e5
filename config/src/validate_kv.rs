//! The rules of a model's `kv` section (shared by the config's models and discovery's
//! default model).

use crate::duration::format_duration;
use crate::violation::{Checked, fail, non_negative, positive};
use crate::{FieldPath, KvRoutingConfig, MAX_APPROX_TTL};

/// Longest accepted `kv.decider_timeout`.
const MAX_DECIDER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether `byte` may appear in a header name (RFC 9110 `tchar`).
fn is_header_name_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&byte)
}

/// Checks the `kv` section at `path`.
pub(crate) fn check_kv(kv: &KvRoutingConfig, path: &FieldPath) -> Checked {
    if kv.block_size == Some(0) {
        return fail(
            path.key("block_size"),
            "must be at least 1 (or null: the engines' own, from their instance records)",
        );
    }
    non_negative(kv.overlap_weight, path.key("overlap_weight"))?;
    non_negative(kv.harm_weight, path.key("harm_weight"))?;
    non_negative(kv.queue_weight, path.key("queue_weight"))?;
    non_negative(kv.work_weight, path.key("work_weight"))?;
    non_negative(kv.overlap_credit_decay, path.key("overlap_credit_decay"))?;
    non_negative(kv.temperature, path.key("temperature"))?;
    for (weight, name) in [
        (kv.tier_weights.host, "host"),
        (kv.tier_weights.disk, "disk"),
    ] {
        if !(0.0..=1.0).contains(&weight) {
            return fail(
                path.key("tier_weights").key(name),
                format!("{weight} is not in [0, 1] (0: worth a miss, 1: a device hit)"),
            );
        }
    }
    positive(kv.approx_ttl, path.key("approx_ttl"))?;
    if kv.approx_ttl > MAX_APPROX_TTL {
        return fail(
            path.key("approx_ttl"),
            format!("must be at most {}", format_duration(MAX_APPROX_TTL)),
        );
    }
    if kv.approx_max_blocks == 0 {
        return fail(path.key("approx_max_blocks"), "must be at least 1");
    }
    let ratio = kv.approx_prune_ratio;
    if !(ratio > 0.0 && ratio <= 1.0) {
        return fail(
            path.key("approx_prune_ratio"),
            format!("{ratio} is not in (0, 1]"),
        );
    }
    if let Some(fraction) = kv.busy_decode_blocks_fraction {
        non_negative(fraction, path.key("busy_decode_blocks_fraction"))?;
    }
    positive(kv.queue.timeout, path.key("queue").key("timeout"))?;
    positive(kv.session_ttl, path.key("session_ttl"))?;
    let check = &kv.cache_check;
    if check.window > 0 && !(1..=check.window).contains(&check.mismatches) {
        return fail(
            path.key("cache_check").key("mismatches"),
            format!(
                "{} is not in 1..={} (the window)",
                check.mismatches, check.window
            ),
        );
    }
    positive(
        kv.tokenizer_check.deadline,
        path.key("tokenizer_check").key("deadline"),
    )?;
    positive(
        kv.tokenizer_check.timeout,
        path.key("tokenizer_check").key("timeout"),
    )?;
    if !kv.session_header.bytes().all(is_header_name_byte) {
        return fail(
            path.key("session_header"),
            format!("{:?} is not a header name", kv.session_header),
        );
    }
    if kv.decider_timeout > MAX_DECIDER_TIMEOUT {
        return fail(
            path.key("decider_timeout"),
            format!(
                "must be at most {} (every request waits this long for an unresponsive decider)",
                format_duration(MAX_DECIDER_TIMEOUT)
            ),
        );
    }
    positive(kv.stale_request_timeout, path.key("stale_request_timeout"))
}
