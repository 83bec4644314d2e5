//! Reading gauges out of a Prometheus text exposition (the engine's `/metrics`).

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
}
