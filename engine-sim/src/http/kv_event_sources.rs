//! `GET /kv_event_sources`: where each data-parallel rank publishes its KV events, the way
//! vLLM 0.32 answers it (`vllm/entrypoints/serve/instrumentator/basic.py`): an object keyed by
//! rank whose values are vLLM's `KVEventsConfig` as that rank's publisher resolved it, `{}`
//! when publishing is off.

use http::{Response, StatusCode};
use serde_json::{Map, Value, json};

use super::body::{ResponseBody, json_response};
use super::state::EngineState;

/// vLLM's `KVEventsConfig.hwm` and `max_queue_size` defaults, reported as vLLM reports them;
/// engine-sim's publisher has no such limits (a slow subscriber lags behind its buffer).
const VLLM_QUEUE_DEFAULT: u64 = 100_000;

/// `tcp://HOST:PORT` with the host as configured (`*` stays `*`, as vLLM reports its bind
/// address) and the port the socket got (the configured one plus the engine core's index, or
/// a free one for port 0, which vLLM resolves the same way).
fn endpoint(configured: &str, port: u16) -> String {
    let host = configured
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .map_or("*", |(host, _)| host);
    format!("tcp://{host}:{port}")
}

/// The answer.
pub(crate) fn handle(state: &EngineState) -> Response<ResponseBody> {
    let events = &state.config.kv_events;
    let mut ranks = Map::new();
    for (rank, core) in state.ranks.iter().enumerate() {
        let (Some(configured), Some((events_addr, replay_addr))) =
            (&events.endpoint, core.kv_event_addrs)
        else {
            continue;
        };
        let replay = events
            .replay_endpoint
            .as_deref()
            .zip(replay_addr)
            .map(|(configured, addr)| endpoint(configured, addr.port()));
        ranks.insert(
            rank.to_string(),
            json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": endpoint(configured, events_addr.port()),
                "replay_endpoint": replay,
                "buffer_steps": events.buffer_steps,
                "hwm": VLLM_QUEUE_DEFAULT,
                "max_queue_size": VLLM_QUEUE_DEFAULT,
                "topic": events.topic,
            }),
        );
    }
    json_response(StatusCode::OK, &Value::Object(ranks))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configured_host_is_kept_with_the_bound_port() {
        assert_eq!(endpoint("tcp://*:0", 40123), "tcp://*:40123");
        assert_eq!(
            endpoint("tcp://127.0.0.1:5557", 5558),
            "tcp://127.0.0.1:5558"
        );
        assert_eq!(endpoint("tcp://[::1]:5557", 5557), "tcp://[::1]:5557");
    }
}
