//! Per-engine state shared by every connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use http::HeaderValue;

use crate::config::SimConfig;
use crate::kv_transfer::link::Link;
use crate::kv_transfer::pull::Puller;
use crate::lora::LoraRegistry;
use crate::metrics::EngineMetrics;
use crate::scheduler::SchedulerHandle;
use crate::tokenizer::Tokenizer;
use crate::zmq_events::FaultControl;

/// `traceparent` values kept for `GET /sim/traceparents`.
const TRACEPARENTS_KEPT: usize = 64;

/// What handlers need: configuration, tokenizer, LoRA adapters, scheduler and metrics.
#[derive(Debug)]
pub(crate) struct EngineState {
    /// The engine's knobs.
    pub config: SimConfig,
    /// Prompt tokenizer.
    pub tokenizer: Tokenizer,
    /// The loaded LoRA adapters.
    pub loras: LoraRegistry,
    /// Metrics shared with the scheduler.
    pub metrics: Arc<EngineMetrics>,
    /// The scheduler task.
    pub scheduler: SchedulerHandle,
    /// The bound address, as text.
    pub addr: String,
    /// `x-engine-id` header value (the bound address).
    pub engine_id: HeaderValue,
    /// Unix seconds at start.
    pub started: u64,
    /// Fault injection into the ZMQ KV event publisher, when publishing is on.
    pub kv_faults: Option<Arc<FaultControl>>,
    /// Pulls remote prefills' KV (decode legs).
    pub puller: Puller,
    /// Where decode engines read the blocks this engine holds: `(host, port)`.
    pub side_channel: (String, u16),
    next_id: AtomicU64,
    id_salt: u64,
    /// The `traceparent` of the last generation requests, oldest first (a test hook).
    traceparents: Mutex<VecDeque<String>>,
}

/// What an engine has beside its scheduler: fault injection into its KV event publisher
/// (when publishing is on) and its inbound KV transfer link.
#[derive(Debug)]
pub(crate) struct SideChannels {
    /// Fault injection into the ZMQ KV event publisher.
    pub kv_faults: Option<Arc<FaultControl>>,
    /// The inbound KV link.
    pub link: Arc<Link>,
}

/// Current Unix time in seconds.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

impl EngineState {
    /// State for an engine bound to `addr`.
    pub(crate) fn new(
        config: SimConfig,
        tokenizer: Tokenizer,
        loras: LoraRegistry,
        metrics: Arc<EngineMetrics>,
        scheduler: SchedulerHandle,
        addr: SocketAddr,
        side: SideChannels,
    ) -> Self {
        let SideChannels { kv_faults, link } = side;
        let addr_text = addr.to_string();
        let engine_id = HeaderValue::from_str(&addr_text)
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        let started = unix_now();
        let id_salt = crate::hashing::content_seed(&[u32::from(addr.port()), started as u32]);
        let transfer = &config.kv_transfer;
        let bytes_per_block = transfer.shape.bytes_per_token() * config.block_size as u64;
        let host = match &transfer.side_channel_host {
            Some(host) => host.clone(),
            None if addr.ip().is_unspecified() => "127.0.0.1".to_owned(),
            None => addr.ip().to_string(),
        };
        Self {
            puller: Puller::new(link, bytes_per_block),
            side_channel: (host, addr.port()),
            config,
            tokenizer,
            loras,
            metrics,
            scheduler,
            addr: addr_text,
            engine_id,
            started,
            kv_faults,
            next_id: AtomicU64::new(0),
            id_salt,
            traceparents: Mutex::new(VecDeque::with_capacity(TRACEPARENTS_KEPT)),
        }
    }

    /// A fresh id: `prefix` (separator included, e.g. `chatcmpl-`) and 32 hex digits.
    pub(crate) fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}{:016x}{n:016x}", self.id_salt)
    }

    /// Keeps a generation request's `traceparent` (the last 64 are kept).
    pub(crate) fn saw_traceparent(&self, value: &str) {
        let mut kept = self
            .traceparents
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if kept.len() == TRACEPARENTS_KEPT {
            kept.pop_front();
        }
        kept.push_back(value.to_owned());
    }

    /// The `traceparent` values kept, oldest first.
    pub(crate) fn traceparents(&self) -> Vec<String> {
        let kept = self
            .traceparents
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        kept.iter().cloned().collect()
    }
}
