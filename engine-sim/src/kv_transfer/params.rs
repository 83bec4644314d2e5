//! `kv_transfer_params`, the object vLLM's disaggregation proxies pass between the legs.

use serde::{Deserialize, Serialize};

/// A request's or an answer's `kv_transfer_params` (every field optional on the wire).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
pub(crate) struct KvTransferParams {
    /// Prefill leg: keep the KV for a remote decode.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// Decode leg: the KV was computed remotely; pull it.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// The engine holding the blocks.
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    /// Its block ids.
    #[serde(default)]
    pub remote_block_ids: Option<Vec<u64>>,
    /// Host of its side channel.
    #[serde(default)]
    pub remote_host: Option<String>,
    /// Port of its side channel.
    #[serde(default)]
    pub remote_port: Option<u16>,
    /// Its tensor-parallel size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// The prefill's request id there (the handle of the held blocks).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
}

/// What a decode leg names: where to read which blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RemotePrefill {
    /// `host:port` of the prefill engine's side channel.
    pub address: String,
    /// The prefill's request id there.
    pub request_id: String,
    /// The block ids it holds.
    pub block_ids: Vec<u64>,
}

impl KvTransferParams {
    /// The answer of a prefill leg whose blocks `block_ids` this engine (`engine_id`, side
    /// channel `host:port`) holds under `request_id`.
    pub(crate) fn prefilled(
        engine_id: &str,
        host: String,
        port: u16,
        request_id: String,
        block_ids: Vec<u64>,
    ) -> Self {
        Self {
            do_remote_decode: false,
            do_remote_prefill: true,
            remote_engine_id: Some(engine_id.to_owned()),
            remote_block_ids: Some(block_ids),
            remote_host: Some(host),
            remote_port: Some(port),
            tp_size: Some(1),
            remote_request_id: Some(request_id),
        }
    }

    /// What a decode leg must pull (`Ok(None)`: nothing, it is not one); `Err` names the
    /// missing field.
    pub(crate) fn remote_prefill(&self) -> Result<Option<RemotePrefill>, &'static str> {
        if !self.do_remote_prefill {
            return Ok(None);
        }
        let host = self.remote_host.as_deref().ok_or("remote_host")?;
        let port = self.remote_port.ok_or("remote_port")?;
        let block_ids = self.remote_block_ids.clone().ok_or("remote_block_ids")?;
        let request_id = self.remote_request_id.clone().ok_or("remote_request_id")?;
        Ok(Some(RemotePrefill {
            address: format!("{host}:{port}"),
            request_id,
            block_ids,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_legs_request_parses_as_vllms_proxy_sends_it() {
        let sent = r#"{"do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null}"#;
        let params: KvTransferParams = serde_json::from_str(sent).unwrap();
        assert!(params.do_remote_decode && !params.do_remote_prefill);
        assert_eq!(params.remote_prefill(), Ok(None));
    }

    #[test]
    fn an_answer_round_trips_into_the_decode_legs_pull() {
        let answer = KvTransferParams::prefilled(
            "engine-a",
            "10.0.0.1".into(),
            8000,
            "cmpl-1".into(),
            vec![3, 4],
        );
        let text = serde_json::to_string(&answer).unwrap();
        let back: KvTransferParams = serde_json::from_str(&text).unwrap();
        assert_eq!(back, answer);
        assert_eq!(
            back.remote_prefill(),
            Ok(Some(RemotePrefill {
                address: "10.0.0.1:8000".into(),
                request_id: "cmpl-1".into(),
                block_ids: vec![3, 4],
            }))
        );
        let missing = KvTransferParams {
            remote_port: None,
            ..back
        };
        assert_eq!(missing.remote_prefill(), Err("remote_port"));
    }
}
