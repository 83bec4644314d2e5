//! An engine's Prometheus `/metrics` page and SGLang's `/get_server_info` as the agent reads
//! them: the exposition (`kvmesh_wire::prom_text`: `samples`, `sum`, `mean`, `labels`), the
//! load it states (`engine_load::read_load`, with each engine kind's gauges and with names
//! found in the page), and the KV cache shape (`cache_config::CacheConfig`).
//!
//! Whatever the bytes (read as UTF-8, lossily, as the agent reads them): nothing panics, and
//! - for the agent's metric names and names found in the page, `samples` are those of a plain
//!   reading of each line (its name, a label set that runs to the first `}` outside a quoted
//!   value, the first word after it as the value), the same read from the page whole or cut
//!   in two at a line's end; `sum` and `mean` are theirs; `labels` are those of the first
//!   line of the name whose label set reads as `name="value"` pairs, and written back in the
//!   exposition format, they read as themselves;
//! - a load is read exactly when the running and waiting samples sum to a finite number; its
//!   counts are those sums rounded down (0 below 0), its KV usage in [0, 1] and the first
//!   named gauge's mean where that is a number, and the load report the agent makes of it
//!   reads back from its JSON as itself;
//! - a KV cache shape says 1 or more for whatever it states: vLLM's the whole numbers of the
//!   first `vllm:cache_config_info` sample's labels, trtllm-serve's the gauges' means (a
//!   whole block size), SGLang's the `page_size` and whole pages of `max_total_num_tokens`
//!   of a JSON object.

#![no_main]

use kvmesh_control::{InstanceId, LoadReport};
use kvmesh_wire::cache_config::CacheConfig;
use kvmesh_wire::engine_load::{EngineLoad, LoadGauges, SGLANG, TRTLLM, VLLM, read_load};
use kvmesh_wire::prom_text::{labels, mean, samples, sum};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

/// The agent's gauges per engine kind.
const KINDS: [LoadGauges<'static>; 3] = [VLLM, SGLANG, TRTLLM];

const OTHER_NAMES: [&str; 3] = [
    "vllm:cache_config_info",
    "trtllm_kv_cache_tokens_per_block",
    "trtllm_kv_cache_max_blocks",
];

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let found = found_names(&text);
    // The agent's names that the page has, and the names of its first lines.
    let mut names: Vec<&str> = KINDS
        .iter()
        .flat_map(|gauges| {
            [gauges.running, gauges.waiting]
                .into_iter()
                .chain(gauges.kv_usage.iter().copied())
        })
        .chain(OTHER_NAMES)
        .filter(|name| text.contains(name) && !found.contains(name))
        .collect();
    names.extend(found.iter().copied());
    // A cut at the end of a line a third of the way in.
    let third = (text.len() / 3..text.len())
        .find(|&at| text.is_char_boundary(at))
        .unwrap_or(text.len());
    let cut = text[third..].find('\n').map(|at| third + at + 1);
    for name in names {
        exposition(&text, name, cut);
    }
    for gauges in KINDS {
        load(&text, &gauges);
    }
    if let [running, waiting, usage @ ..] = found.as_slice() {
        load(
            &text,
            &LoadGauges {
                running,
                waiting,
                kv_usage: &usage[..usage.len().min(2)],
            },
        );
    }
    cache_config(&text, data);
});

/// The metric names of the first lines (up to 4, each once).
fn found_names(text: &str) -> Vec<&str> {
    let mut names = Vec::new();
    for line in text.lines() {
        let line = line.trim_start();
        let end = line
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .unwrap_or(line.len());
        let name = &line[..end];
        if !name.is_empty() && !names.contains(&name) {
            names.push(name);
            if names.len() == 4 {
                break;
            }
        }
    }
    names
}

/// One line of `text` as a sample of metric `name`: its label set (`{...}` as written, when
/// it has one) and its value's word.
fn line_sample<'t>(line: &'t str, name: &str) -> Option<(Option<&'t str>, &'t str)> {
    let line = line.trim_start();
    let token_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
    if &line[..token_end] != name {
        return None;
    }
    let rest = &line[token_end..];
    let (set, after) = if rest.starts_with('{') {
        // The set ends at the first `}` outside a quoted value (`\` escapes within one).
        let mut quoted = false;
        let mut chars = rest.char_indices().skip(1);
        let end = loop {
            match chars.next()? {
                (_, '"') => quoted = !quoted,
                (_, '\\') if quoted => {
                    chars.next()?;
                }
                (at, '}') if !quoted => break at,
                _ => {}
            }
        };
        (Some(&rest[..=end]), &rest[end + 1..])
    } else {
        (None, rest)
    };
    let word = after.split_ascii_whitespace().next().unwrap_or("");
    Some((set, word))
}

/// A sample value as the text format writes it.
fn value_of(word: &str) -> Option<f64> {
    match word {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => word.parse().ok(),
    }
}

/// A label set (`{a="x",b="y"}`) as pairs; `None` when it does not read so.
fn pairs_of(set: &str) -> Option<Vec<(String, String)>> {
    let mut rest = set.strip_prefix('{')?.strip_suffix('}')?;
    let mut pairs = Vec::new();
    loop {
        rest = rest.trim_start_matches([',', ' ']);
        if rest.is_empty() {
            return Some(pairs);
        }
        let equals = rest.find('=')?;
        let name = rest[..equals].trim().to_owned();
        let mut chars = rest[equals + 1..].strip_prefix('"')?.chars();
        let mut value = String::new();
        loop {
            match chars.next()? {
                '"' => break,
                '\\' => match chars.next()? {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                other => value.push(other),
            }
        }
        pairs.push((name, value));
        rest = chars.as_str();
    }
}

fn same(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn same_all(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(a, b)| same(*a, *b))
}

fn exposition(text: &str, name: &str, cut: Option<usize>) {
    let expected: Vec<f64> = text
        .lines()
        .filter_map(|line| line_sample(line, name))
        .filter_map(|(_, word)| value_of(word))
        .collect();
    let read = samples(text, name);
    assert!(
        same_all(&read, &expected),
        "{name}: {read:?} != {expected:?}"
    );
    if let Some(cut) = cut {
        let mut parts = samples(&text[..cut], name);
        parts.extend(samples(&text[cut..], name));
        assert!(same_all(&parts, &read), "{name}: cut at {cut}: {parts:?}");
    }
    let total = expected.iter().sum::<f64>();
    match (sum(text, name), mean(text, name)) {
        (None, None) => assert!(expected.is_empty()),
        (Some(s), Some(m)) => {
            assert!(same(s, total), "{name}: sum {s} != {total}");
            assert!(same(m, total / expected.len() as f64), "{name}: mean {m}");
        }
        other => panic!("{name}: sum and mean {other:?}"),
    }

    let expected_labels = text
        .lines()
        .filter_map(|line| line_sample(line, name))
        .find_map(|(set, _)| set.and_then(pairs_of));
    let read_labels = labels(text, name);
    assert_eq!(read_labels, expected_labels, "{name}");
    // Written back in the exposition format (valid label names only), they read as themselves.
    let Some(pairs) = read_labels else { return };
    let valid = |label: &str| {
        let mut chars = label.chars();
        chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if !pairs.iter().all(|(label, _)| valid(label)) || name.is_empty() {
        return;
    }
    let set: Vec<String> = pairs
        .iter()
        .map(|(label, value)| {
            let escaped = value
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{label}=\"{escaped}\"")
        })
        .collect();
    let line = format!(
        "# HELP {name} x\n{name}{{{}}} 1 1700000000000\n",
        set.join(",")
    );
    assert_eq!(labels(&line, name).as_ref(), Some(&pairs), "{line:?}");
    assert_eq!(samples(&line, name), [1.0], "{line:?}");
}

fn load(text: &str, gauges: &LoadGauges<'_>) {
    let count = |name: &str| {
        let values = samples(text, name);
        (!values.is_empty())
            .then(|| values.iter().sum::<f64>())
            .filter(|total| total.is_finite())
    };
    let read = read_load(text, gauges);
    let (Some(running), Some(waiting)) = (count(gauges.running), count(gauges.waiting)) else {
        assert_eq!(read, None, "{gauges:?}");
        return;
    };
    let Some(EngineLoad {
        running: read_running,
        waiting: read_waiting,
        kv_usage,
    }) = read
    else {
        panic!("no load of {gauges:?}: {running} running, {waiting} waiting");
    };
    for (count, total) in [(read_running, running), (read_waiting, waiting)] {
        if total < 1.0 {
            assert_eq!(count, 0, "{total}");
        } else if total < u64::MAX as f64 {
            // Rounded down: `count <= total < count + 1`, in f64's precision.
            assert!(
                count as f64 <= total && total < count as f64 + 1.0 + total * f64::EPSILON,
                "{count} of {total}"
            );
        } else {
            assert_eq!(count, u64::MAX, "{total}");
        }
    }
    assert!((0.0..=1.0).contains(&kv_usage), "{kv_usage}");
    let stated = gauges.kv_usage.iter().find_map(|name| {
        let values = samples(text, name);
        (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
    });
    match stated {
        Some(usage) if !usage.is_nan() => assert_eq!(kv_usage, usage.clamp(0.0, 1.0)),
        _ => assert_eq!(kv_usage, 0.0),
    }
    let report = LoadReport {
        instance_id: InstanceId(7),
        running: read_running,
        waiting: read_waiting,
        kv_usage,
        at_ms: 1_700_000_000_000,
        age_ms: Some(3),
        events_complete: true,
        last_seq: Some(9),
    };
    // serde_json reads a float back to within one unit in the last place (its default,
    // without `float_roundtrip`).
    let back = LoadReport::from_json(&report.to_json()).expect("the report reads back");
    assert!((back.kv_usage - kv_usage).abs() <= f64::EPSILON, "{back:?}");
    assert_eq!(LoadReport { kv_usage, ..back }, report);
}

/// A whole number of 1 or more as a label value writes one: decimal digits, a `+` allowed.
fn whole(value: &str) -> Option<u64> {
    let digits = value.strip_prefix('+').unwrap_or(value);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let significant = digits.trim_start_matches('0');
    if significant.len() > 20 {
        return None;
    }
    u64::try_from(significant.parse::<u128>().unwrap_or(0))
        .ok()
        .filter(|&n| n >= 1)
}

fn cache_config(text: &str, data: &[u8]) {
    let stated = |config: &CacheConfig| {
        assert!(config.block_size.is_none_or(|size| size >= 1), "{config:?}");
        assert!(
            config.total_blocks.is_none_or(|blocks| blocks >= 1),
            "{config:?}"
        );
    };

    let vllm = CacheConfig::from_vllm_metrics(text);
    let info = labels(text, "vllm:cache_config_info");
    assert_eq!(vllm.is_some(), info.is_some());
    if let (Some(config), Some(info)) = (vllm, info) {
        stated(&config);
        let label = |name: &str| {
            (info.iter())
                .find(|(label, _)| label == name)
                .and_then(|(_, value)| whole(value))
        };
        assert_eq!(
            config.block_size,
            label("block_size").map(|size| size as usize)
        );
        assert_eq!(config.total_blocks, label("num_gpu_blocks"));
    }

    let trtllm = CacheConfig::from_trtllm_metrics(text);
    let block_size = mean(text, "trtllm_kv_cache_tokens_per_block")
        .filter(|size| *size >= 1.0 && size.is_finite() && size.floor() == *size)
        .map(|size| size as usize);
    let total_blocks = mean(text, "trtllm_kv_cache_max_blocks")
        .filter(|blocks| *blocks >= 1.0 && blocks.is_finite())
        .map(|blocks| blocks.floor() as u64);
    if let Some(config) = trtllm {
        stated(&config);
    }
    assert_eq!(
        trtllm,
        (block_size.is_some() || total_blocks.is_some()).then_some(CacheConfig {
            block_size,
            total_blocks,
        })
    );

    let sglang = CacheConfig::from_sglang_info(data);
    match serde_json::from_slice::<Value>(data) {
        Ok(Value::Object(info)) => {
            let Some(config) = sglang else {
                panic!("an object not read: {info:?}");
            };
            stated(&config);
            let page = info
                .get("page_size")
                .and_then(Value::as_u64)
                .filter(|&p| p >= 1);
            assert_eq!(config.block_size, page.map(|page| page as usize));
            let tokens = info.get("max_total_num_tokens").and_then(Value::as_u64);
            let blocks = tokens.zip(page).map(|(tokens, page)| tokens / page);
            assert_eq!(config.total_blocks, blocks.filter(|&blocks| blocks >= 1));
        }
        _ => assert_eq!(sglang, None),
    }
}
