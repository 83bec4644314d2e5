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
use crate::kv_transfer::rooms::Rooms;
use crate::lora::LoraRegistry;
use crate::metrics::EngineMetrics;
use crate::scheduler::{SchedulerGone, SchedulerHandle, SeqRequest};
use crate::tokenizer::Tokenizer;
use crate::zmq_events::FaultControl;

use super::dp_rank::{RankChoice, least_loaded};

/// `traceparent` values kept for `GET /sim/traceparents`.
const TRACEPARENTS_KEPT: usize = 64;

/// What handlers need: configuration, tokenizer, LoRA adapters, and the engine cores
/// (data-parallel ranks) with their schedulers and metrics.
#[derive(Debug)]
pub(crate) struct EngineState {
    /// The engine's knobs.
    pub config: SimConfig,
    /// Prompt tokenizer.
    pub tokenizer: Tokenizer,
    /// The loaded LoRA adapters.
    pub loras: LoraRegistry,
    /// The engine cores, in rank order (one unless `dp_ranks` > 1).
    pub ranks: Box<[Rank]>,
    /// Where vLLM's DP load balancer starts its next scan (it rotates per choice); held
    /// while a request's sequences are placed, so that placing them is atomic.
    pub balancer: Mutex<usize>,
    /// The bound address, as text.
    pub addr: String,
    /// `x-engine-id` header value (the bound address).
    pub engine_id: HeaderValue,
    /// Unix seconds at start.
    pub started: u64,
    /// Where decode engines read the blocks this engine holds: `(host, port)`.
    pub side_channel: (String, u16),
    /// SGLang's bootstrap rooms (a prefill engine's, `--disaggregation-mode prefill`).
    pub rooms: Arc<Rooms>,
    next_id: AtomicU64,
    id_salt: u64,
    /// The `traceparent` of the last generation requests, oldest first (a test hook).
    traceparents: Mutex<VecDeque<String>>,
}

/// One engine core (a data-parallel rank): its scheduler, metrics, KV event faults and
/// inbound KV link.
#[derive(Debug)]
pub(crate) struct Rank {
    /// The scheduler task.
    pub scheduler: SchedulerHandle,
    /// Metrics shared with the scheduler, labelled with the core's index.
    pub metrics: Arc<EngineMetrics>,
    /// Fault injection into the ZMQ KV event publisher, when publishing is on.
    pub kv_faults: Option<Arc<FaultControl>>,
    /// Where its KV event PUB socket and replay socket (if any) listen, when publishing is on.
    pub kv_event_addrs: Option<(SocketAddr, Option<SocketAddr>)>,
    /// Pulls remote prefills' KV (decode legs) over the core's inbound link.
    pub puller: Puller,
}

/// What an engine core is made of, before the state puts it together.
#[derive(Debug)]
pub(crate) struct RankParts {
    /// The scheduler task.
    pub scheduler: SchedulerHandle,
    /// Metrics shared with the scheduler.
    pub metrics: Arc<EngineMetrics>,
    /// Fault injection into the ZMQ KV event publisher.
    pub kv_faults: Option<Arc<FaultControl>>,
    /// Where its KV event sockets listen.
    pub kv_event_addrs: Option<(SocketAddr, Option<SocketAddr>)>,
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
    /// State for an engine bound to `addr` with engine cores `ranks` (rank order).
    pub(crate) fn new(
        config: SimConfig,
        tokenizer: Tokenizer,
        loras: LoraRegistry,
        ranks: Vec<RankParts>,
        addr: SocketAddr,
    ) -> Self {
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
        let ranks = ranks
            .into_iter()
            .map(|parts| Rank {
                scheduler: parts.scheduler,
                metrics: parts.metrics,
                kv_faults: parts.kv_faults,
                kv_event_addrs: parts.kv_event_addrs,
                puller: Puller::new(parts.link, bytes_per_block),
            })
            .collect();
        Self {
            side_channel: (host, addr.port()),
            rooms: Arc::default(),
            config,
            tokenizer,
            loras,
            ranks,
            balancer: Mutex::new(0),
            addr: addr_text,
            engine_id,
            started,
            next_id: AtomicU64::new(0),
            id_salt,
            traceparents: Mutex::new(VecDeque::with_capacity(TRACEPARENTS_KEPT)),
        }
    }

    /// Engine core `rank` (callers pass a rank below `ranks.len()`; rank 0 always exists).
    pub(crate) fn rank(&self, rank: usize) -> &Rank {
        &self.ranks[rank.min(self.ranks.len() - 1)]
    }

    /// Hands `seqs` to the engine core `choice` names, or places each as vLLM's DP load
    /// balancer does.
    pub(crate) fn submit(
        &self,
        seqs: Vec<SeqRequest>,
        choice: RankChoice,
    ) -> Result<(), SchedulerGone> {
        let rank = match choice {
            RankChoice::Fixed(rank) => rank,
            RankChoice::Balanced if self.ranks.len() == 1 => 0,
            RankChoice::Balanced => return self.balance(seqs),
        };
        self.rank(rank).scheduler.submit(seqs)
    }

    /// The core vLLM's DP load balancer would give one more request now (counted as the
    /// balancer counts it only once it is submitted).
    pub(crate) fn balanced_rank(&self) -> usize {
        if self.ranks.len() == 1 {
            return 0;
        }
        let mut start = self.balancer.lock().unwrap_or_else(PoisonError::into_inner);
        let loads: Vec<_> = self
            .ranks
            .iter()
            .map(|r| r.metrics.balancer_load())
            .collect();
        let rank = least_loaded(&loads, *start);
        *start = (*start + 1) % loads.len();
        rank
    }

    /// Places each sequence on the least loaded core, counting those placed before it, and
    /// submits them, all under the balancer's lock.
    fn balance(&self, seqs: Vec<SeqRequest>) -> Result<(), SchedulerGone> {
        let mut start = self.balancer.lock().unwrap_or_else(PoisonError::into_inner);
        let mut loads: Vec<_> = self
            .ranks
            .iter()
            .map(|r| r.metrics.balancer_load())
            .collect();
        let mut groups: Vec<Vec<SeqRequest>> = self.ranks.iter().map(|_| Vec::new()).collect();
        for seq in seqs {
            let rank = least_loaded(&loads, *start);
            *start = (*start + 1) % loads.len();
            loads[rank].in_flight += 1;
            groups[rank].push(seq);
        }
        for (rank, group) in self.ranks.iter().zip(groups) {
            if !group.is_empty() {
                rank.scheduler.submit(group)?;
            }
        }
        Ok(())
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
