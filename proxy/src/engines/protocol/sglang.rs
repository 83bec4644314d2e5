//! SGLang's disaggregated serving, as sglang-router's PD mode speaks it: both legs are sent
//! at once, each the client's request with the prefill instance's `bootstrap_host` and
//! `bootstrap_port` and one `bootstrap_room` the two engines meet in; the prefill engine
//! hands the prompt's KV to the decode engine that joins its room, and the client gets the
//! decode engine's answer.

use bytes::Bytes;
use serde_json::{Map, Value};

/// SGLang's default `--disaggregation-bootstrap-port`.
pub(crate) const DEFAULT_BOOTSTRAP_PORT: u16 = 8998;

/// Where the two legs of one request meet: the prefill instance's bootstrap server and a
/// room of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bootstrap {
    /// The prefill instance's host (its URL's, without brackets).
    pub(crate) host: String,
    /// Its bootstrap port.
    pub(crate) port: u16,
    /// The room: a random 63-bit number, as sglang-router draws it.
    pub(crate) room: u64,
}

impl Bootstrap {
    /// A new room on the bootstrap server at `host:port`.
    pub(crate) fn new(host: &str, port: u16) -> Self {
        Self {
            host: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_string(),
            port,
            room: rand::random::<u64>() >> 1,
        }
    }
}

/// Either leg: the client's `request` with `bootstrap`'s three fields.
pub(crate) fn leg(request: &Map<String, Value>, bootstrap: &Bootstrap) -> Result<Bytes, String> {
    let mut leg = request.clone();
    leg.insert(
        "bootstrap_host".into(),
        Value::from(bootstrap.host.as_str()),
    );
    leg.insert("bootstrap_port".into(), Value::from(bootstrap.port));
    leg.insert("bootstrap_room".into(), Value::from(bootstrap.room));
    serde_json::to_vec(&leg)
        .map(Bytes::from)
        .map_err(|error| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leg_is_the_request_with_the_room() {
        let request: Map<String, Value> =
            serde_json::from_str(r#"{"model":"m","messages":[],"stream":true,"max_tokens":9}"#)
                .unwrap();
        let bootstrap = Bootstrap::new("[::1]", 9123);
        assert!(bootstrap.room < 1 << 63);
        let leg: Map<String, Value> =
            serde_json::from_slice(&leg(&request, &bootstrap).unwrap()).unwrap();
        assert_eq!(leg["bootstrap_host"], "::1");
        assert_eq!(leg["bootstrap_port"], 9123);
        assert_eq!(leg["bootstrap_room"], bootstrap.room);
        for (field, value) in &request {
            assert_eq!(&leg[field], value, "{field} kept");
        }
        assert_eq!(leg.len(), request.len() + 3);
        assert_ne!(Bootstrap::new("h", 1).room, Bootstrap::new("h", 1).room);
    }
}
