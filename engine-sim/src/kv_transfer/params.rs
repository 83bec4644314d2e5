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
    /// Its block ids: one list per KV cache group, as vLLM 0.32 sends them (`[[1, 2, ...]]`);
    /// a flat list (older vLLM) is accepted too.
    #[serde(default)]
    pub remote_block_ids: Option<BlockIds>,
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
    /// Its decode-context-parallel size (vLLM 0.32 sends 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcp_size: Option<u32>,
    /// Its pipeline-parallel size (vLLM 0.32 sends 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u32>,
    /// Prompt tokens whose KV the prefill engine holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_num_tokens: Option<usize>,
    /// When the held blocks expire (vLLM 0.32 sends null).
    #[serde(default)]
    pub remote_blocks_expiry_time: Option<serde_json::Value>,
    /// `pull`: the decode engine reads the blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_mode: Option<String>,
    /// Prompt tokens the prefill engine found in its own prefix cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_prefill_cached_tokens: Option<usize>,
}

/// `remote_block_ids`: per KV cache group (vLLM 0.32) or flat (older vLLM).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub(crate) enum BlockIds {
    /// One list per KV cache group; the simulator has one group.
    Grouped(Vec<Vec<u64>>),
    /// One list.
    Flat(Vec<u64>),
}

impl BlockIds {
    /// The block ids of the (only) full-attention group.
    fn into_ids(self) -> Vec<u64> {
        match self {
            Self::Grouped(groups) => groups.into_iter().next().unwrap_or_default(),
            Self::Flat(ids) => ids,
        }
    }
}

/// What a prefill leg reports about its prompt in its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefillCounts {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, served from the prefill engine's prefix cache.
    pub cached_tokens: usize,
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
    /// channel `host:port`) holds under `request_id`, in vLLM 0.32's NixlConnector shape.
    pub(crate) fn prefilled(
        engine_id: &str,
        host: String,
        port: u16,
        request_id: String,
        block_ids: Vec<u64>,
        counts: PrefillCounts,
    ) -> Self {
        Self {
            do_remote_decode: false,
            do_remote_prefill: true,
            remote_engine_id: Some(engine_id.to_owned()),
            remote_block_ids: Some(BlockIds::Grouped(vec![block_ids])),
            remote_host: Some(host),
            remote_port: Some(port),
            tp_size: Some(1),
            remote_request_id: Some(request_id),
            dcp_size: Some(1),
            pp_size: Some(1),
            remote_num_tokens: Some(counts.prompt_tokens),
            remote_blocks_expiry_time: None,
            transfer_mode: Some("pull".to_owned()),
            remote_prefill_cached_tokens: Some(counts.cached_tokens),
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
        let block_ids = self
            .remote_block_ids
            .clone()
            .ok_or("remote_block_ids")?
            .into_ids();
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
        let counts = PrefillCounts {
            prompt_tokens: 40,
            cached_tokens: 16,
        };
        let answer = KvTransferParams::prefilled(
            "engine-a",
            "10.0.0.1".into(),
            8000,
            "cmpl-1".into(),
            vec![3, 4],
            counts,
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

    #[test]
    fn an_answer_has_vllm_032s_nixl_shape_and_flat_ids_still_parse() {
        let counts = PrefillCounts {
            prompt_tokens: 300,
            cached_tokens: 0,
        };
        let answer =
            KvTransferParams::prefilled("e", "h".into(), 5601, "r".into(), vec![1, 2], counts);
        let value = serde_json::to_value(&answer).unwrap();
        // The keys and values a vLLM 0.32 prefill engine with NixlConnector answers
        // (../shared/reference/real-vllm.md), ids as one list per KV cache group.
        let mut keys: Vec<&str> = value
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "dcp_size",
                "do_remote_decode",
                "do_remote_prefill",
                "pp_size",
                "remote_block_ids",
                "remote_blocks_expiry_time",
                "remote_engine_id",
                "remote_host",
                "remote_num_tokens",
                "remote_port",
                "remote_prefill_cached_tokens",
                "remote_request_id",
                "tp_size",
                "transfer_mode",
            ]
        );
        assert_eq!(value["remote_block_ids"], serde_json::json!([[1, 2]]));
        assert_eq!(value["remote_blocks_expiry_time"], serde_json::Value::Null);
        assert_eq!(value["transfer_mode"], "pull");
        assert_eq!(value["remote_num_tokens"], 300);
        let flat: KvTransferParams = serde_json::from_str(
            r#"{"do_remote_prefill": true, "remote_block_ids": [7, 8], "remote_host": "h",
                "remote_port": 1, "remote_request_id": "r"}"#,
        )
        .unwrap();
        assert_eq!(
            flat.remote_prefill().unwrap().unwrap().block_ids,
            vec![7, 8]
        );
    }
}
