//! Per-engine state shared by every connection.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use http::HeaderValue;

use crate::config::SimConfig;
use crate::lora::LoraRegistry;
use crate::metrics::EngineMetrics;
use crate::scheduler::SchedulerHandle;
use crate::tokenizer::Tokenizer;
use crate::zmq_events::FaultControl;

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
    next_id: AtomicU64,
    id_salt: u64,
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
        kv_faults: Option<Arc<FaultControl>>,
    ) -> Self {
        let addr_text = addr.to_string();
        let engine_id = HeaderValue::from_str(&addr_text)
            .unwrap_or_else(|_| HeaderValue::from_static("unknown"));
        let started = unix_now();
        let id_salt = crate::hashing::content_seed(&[u32::from(addr.port()), started as u32]);
        Self {
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
        }
    }

    /// A fresh id: `prefix` (separator included, e.g. `chatcmpl-`) and 32 hex digits.
    pub(crate) fn response_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}{:016x}{n:016x}", self.id_salt)
    }
}
