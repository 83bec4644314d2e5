//! Reading samples out of a Prometheus text exposition (an engine's `/metrics`): the values of
//! one metric's samples, and the labels of its first sample. A sample line is the metric's
//! name, its label set in braces (optional) and its value, then an optional timestamp; lines
//! of other metrics, comments and lines that do not read are passed over.

/// The values of every sample of metric `name` (all label sets), in order.
pub fn samples(text: &str, name: &str) -> Vec<f64> {
    text.lines()
        .filter_map(|line| sample(line.trim_start(), name))
        .collect()
}

fn sample(line: &str, name: &str) -> Option<f64> {
    let rest = line.strip_prefix(name)?;
    let rest = if let Some(labels) = rest.strip_prefix('{') {
        let end = label_end(labels)?;
        &labels[end + 1..]
    } else if rest.starts_with([' ', '\t']) {
        rest
    } else {
        // Another metric whose name starts with `name`.
        return None;
    };
    parse_value(rest.split_ascii_whitespace().next()?)
}

/// The index of the `}` closing a label set, skipping quoted values.
fn label_end(labels: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in labels.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' if quoted => escaped = true,
            '"' => quoted = !quoted,
            '}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => v.parse().ok(),
    }
}

/// The labels of metric `name`'s first sample whose label set reads (`name="value"` pairs,
/// escapes undone); `None` when it has no such sample.
pub fn labels(text: &str, name: &str) -> Option<Vec<(String, String)>> {
    text.lines().find_map(|line| {
        let set = line.trim_start().strip_prefix(name)?.strip_prefix('{')?;
        parse_labels(&set[..label_end(set)?])
    })
}

/// `a="x",b="y"` as pairs.
fn parse_labels(mut set: &str) -> Option<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    loop {
        set = set.trim_start_matches([',', ' ']);
        if set.is_empty() {
            return Some(pairs);
        }
        let (name, rest) = set.split_once('=')?;
        let mut chars = rest.strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                (i, '"') => break i,
                (_, c) => value.push(c),
            }
        };
        pairs.push((name.trim().to_owned(), value));
        set = &rest[end + 2..];
    }
}

/// The sum of metric `name`'s samples; `None` when absent.
pub fn sum(text: &str, name: &str) -> Option<f64> {
    let s = samples(text, name);
    (!s.is_empty()).then(|| s.iter().sum())
}

/// The mean of metric `name`'s samples; `None` when absent.
pub fn mean(text: &str, name: &str) -> Option<f64> {
    let s = samples(text, name);
    (!s.is_empty()).then(|| s.iter().sum::<f64>() / s.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP vllm:num_requests_running Running.\n\
        # TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3.0\n\
        vllm:num_requests_running{model_name=\"a} b\",engine=\"1\"} 2\n\
        vllm:num_requests_running_total 100\n\
        vllm:num_requests_waiting 1 1732272000000\n\
        vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
        vllm:kv_cache_usage_perc{engine=\"1\"} 0.25\n";

    #[test]
    fn gauges_are_summed_or_averaged() {
        assert_eq!(sum(TEXT, "vllm:num_requests_running"), Some(5.0));
        assert_eq!(sum(TEXT, "vllm:num_requests_waiting"), Some(1.0));
        assert_eq!(mean(TEXT, "vllm:kv_cache_usage_perc"), Some(0.375));
        assert_eq!(sum(TEXT, "vllm:gpu_cache_usage_perc"), None);
        assert_eq!(samples("x{a=\"\\\"}\"} 7\nx NaN\n", "x").len(), 2);
        assert!(samples("x{broken 1\n", "x").is_empty());
    }

    #[test]
    fn labels_of_the_first_sample() {
        let text = "# TYPE vllm:cache_config_info gauge\n\
            vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"2048\",x=\"a\\\"b,c\"} 1.0\n";
        let labels = labels(text, "vllm:cache_config_info").expect("labels");
        assert_eq!(
            labels,
            [
                ("block_size".to_owned(), "16".to_owned()),
                ("num_gpu_blocks".to_owned(), "2048".to_owned()),
                ("x".to_owned(), "a\"b,c".to_owned()),
            ]
        );
        assert_eq!(super::labels(text, "vllm:other"), None);
        assert_eq!(super::labels("m{a=\"unterminated} 1\n", "m"), None);
    }
}
