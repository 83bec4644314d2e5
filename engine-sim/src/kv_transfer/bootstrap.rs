//! SGLang's bootstrap server, as the simulator speaks it (`--disaggregation-mode`).
//!
//! An SGLang prefill engine runs an HTTP bootstrap server on
//! `--disaggregation-bootstrap-port` (default 8998): its ranks register there (`PUT /route`)
//! and a decode engine asks it for the prefill's parallel layout (`GET /route` with every
//! rank `-1`) and for the ZMQ address of the rank to handshake with; the handshake, the KV
//! (RDMA) and the completion notice then go between the ranks directly
//! (sgl-project/sglang `python/sglang/srt/disaggregation/common/conn.py` at 0094505d,
//! `CommonKVBootstrapServer` and `CommonKVReceiver`). The simulator serves `GET /route` and
//! `GET /health` as SGLang's server does and carries the handshake over the same port:
//! [`JOIN_PATH`] (the decode engine joins the room and waits for its KV, as SGLang's decode
//! engine sends its destination to the prefill rank and waits for `KVPoll.Success`) and
//! [`DONE_PATH`] (it has the KV: the prefill engine frees its blocks and answers its leg).
//! The bytes cross the decode engine's inbound link, priced by the same link model as vLLM's
//! protocol ([`super::link`]).

use std::time::Duration;

use http::StatusCode;
use serde::{Deserialize, Serialize};

use super::pull::Puller;
use super::rooms::RoomKv;
use crate::metrics::EngineMetrics;

/// A decode engine joins a room and waits for its KV (the simulator's handshake).
pub(crate) const JOIN_PATH: &str = "/sim/bootstrap/join";
/// A decode engine has a room's KV (the simulator's completion notice).
pub(crate) const DONE_PATH: &str = "/sim/bootstrap/done";

/// What a prefill engine holds a room's blocks under (its scheduler's hold).
pub(crate) fn hold_id(room: u64) -> String {
    format!("bootstrap_room-{room}")
}

/// How much longer than the wait it asked for a decode engine gives a join's answer.
const JOIN_GRACE: Duration = Duration::from_secs(1);

/// The body of a join.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct JoinRequest {
    /// The room.
    pub bootstrap_room: u64,
    /// How long the decode engine waits for the KV, in milliseconds.
    pub wait_ms: u64,
}

/// The body of a completion notice.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct DoneRequest {
    /// The room.
    pub bootstrap_room: u64,
}

/// `GET /route` with every rank `-1`: the prefill engine's layout, SGLang's
/// `PrefillServerInfo` fields (`common/conn.py` at 0094505d).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct PrefillServerInfo {
    /// Attention tensor-parallel size (1: the simulator has no tensor parallelism).
    pub attn_tp_size: u32,
    /// Attention context-parallel size (1).
    pub attn_cp_size: u32,
    /// Data-parallel ranks.
    pub dp_size: usize,
    /// Pipeline-parallel size (1).
    pub pp_size: u32,
    /// Tokens per KV page (the block size).
    pub page_size: usize,
    /// The KV cache's dtype (`auto`, SGLang's default `--kv-cache-dtype`).
    pub kv_cache_dtype: String,
    /// SGLang's default `load_balance_method`, `follow_bootstrap_room` (true). The
    /// simulator's rooms span its data-parallel ranks: any rank may run a room's prefill.
    pub follow_bootstrap_room: bool,
    /// DeepSeek sparse attention's layer split (off).
    pub enable_dsa_cache_layer_split: bool,
    /// The prefill engine's HTTP port.
    pub prefill_http_port: u16,
}

/// `GET /route` for one rank: where it handshakes (SGLang's `PrefillRankInfo`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct PrefillRankInfo {
    /// The rank's host.
    pub rank_ip: String,
    /// Its handshake port (the bootstrap port here).
    pub rank_port: u16,
}

/// Why a decode engine did not get a room's KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ReceiveError {
    /// The bootstrap server could not be asked.
    Unreachable(String),
    /// No KV within the waiting timeout.
    TimedOut,
    /// The room failed (the prefill leg ended, another decode engine is in it); why.
    Failed(String),
}

/// The decode side of a room: joins room `room` on the bootstrap server at `address`, waits
/// up to `waiting` for its KV, moves the bytes of the blocks past this engine's first
/// `cached` over its inbound link, then tells the prefill engine it has them. Counted as a
/// transfer in `metrics`.
pub(crate) async fn receive(
    puller: &Puller,
    address: &str,
    room: u64,
    cached: usize,
    waiting: Duration,
    metrics: &EngineMetrics,
) -> Result<RoomKv, ReceiveError> {
    metrics.transfer_started();
    let kv = match join(puller, address, room, waiting).await {
        Ok(kv) => kv,
        Err(error) => {
            metrics.transfer_failed();
            return Err(error);
        }
    };
    puller.carry(kv.blocks, cached, metrics).await;
    // The KV is here: a prefill engine that cannot be told frees its blocks when its hold
    // expires, and its leg fails then.
    let done = DoneRequest {
        bootstrap_room: room,
    };
    match puller.post(address, DONE_PATH, &done).await {
        Ok((StatusCode::OK, _)) => {}
        Ok((status, body)) => {
            tracing::warn!(%address, room, %status, body = %String::from_utf8_lossy(&body), "completion notice refused");
        }
        Err(error) => tracing::warn!(%address, room, %error, "completion notice not sent"),
    }
    Ok(kv)
}

async fn join(
    puller: &Puller,
    address: &str,
    room: u64,
    waiting: Duration,
) -> Result<RoomKv, ReceiveError> {
    let request = JoinRequest {
        bootstrap_room: room,
        wait_ms: u64::try_from(waiting.as_millis()).unwrap_or(u64::MAX),
    };
    let answer = tokio::time::timeout(
        waiting.saturating_add(JOIN_GRACE),
        puller.post(address, JOIN_PATH, &request),
    )
    .await
    .map_err(|_| ReceiveError::TimedOut)?;
    let (status, body) = answer.map_err(ReceiveError::Unreachable)?;
    match status {
        StatusCode::OK => serde_json::from_slice(&body)
            .map_err(|e| ReceiveError::Unreachable(format!("a join answer that is not KV: {e}"))),
        StatusCode::GATEWAY_TIMEOUT => Err(ReceiveError::TimedOut),
        _ => Err(ReceiveError::Failed(error_message(&body))),
    }
}

/// The `error.message` of an error body, else the body as text.
fn error_message(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}
