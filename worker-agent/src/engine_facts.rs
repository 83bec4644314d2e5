//! What the instance record says about its engine beyond the flags: the LoRA adapters it
//! serves ([`crate::adapters`]) and its KV cache capacity ([`crate::cache_config`]), read at
//! start and again every health interval, each change rewriting the record. A read that
//! fails keeps what was known.

use std::time::Duration;

use tokio::sync::watch;

use crate::adapters;
use crate::cache_config::{self, CacheConfig};
use crate::config::EngineKind;
use crate::http_client::EngineClient;
use crate::metrics::AgentMetrics;

/// The engine's facts as the record advertises them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct EngineFacts {
    /// LoRA adapters served besides the model, sorted.
    pub(crate) adapters: Vec<String>,
    /// KV cache capacity in blocks (0: unknown).
    pub(crate) total_blocks: u64,
}

/// Where the facts come from, and what the flags fix.
#[derive(Debug, Clone)]
pub(crate) struct FactSource {
    /// The engine.
    pub(crate) engine: EngineClient,
    /// Its kind (where it states its cache configuration).
    pub(crate) kind: EngineKind,
    /// `--total-blocks` (0: take the engine's).
    pub(crate) total_blocks_flag: u64,
    /// Counters.
    pub(crate) metrics: AgentMetrics,
}

impl FactSource {
    /// One read, on top of what was `known`: the adapters and cache configuration the engine
    /// states, each kept as known when it cannot be read. Also returns the cache configuration
    /// read, if any.
    pub(crate) async fn read(
        &self,
        known: &EngineFacts,
        timeout: Duration,
    ) -> (EngineFacts, Option<CacheConfig>) {
        let adapters = adapters::fetch(&self.engine, timeout).await;
        let cache = cache_config::fetch(&self.engine, self.kind, timeout).await;
        if let Some(adapters) = &adapters {
            self.metrics
                .adapters
                .set(i64::try_from(adapters.len()).unwrap_or(i64::MAX));
        }
        let total_blocks = match (self.total_blocks_flag, cache.and_then(|c| c.total_blocks)) {
            (0, Some(learned)) => learned,
            (0, None) => known.total_blocks,
            (flag, _) => flag,
        };
        let facts = EngineFacts {
            adapters: adapters.unwrap_or_else(|| known.adapters.clone()),
            total_blocks,
        };
        (facts, cache)
    }

    /// Reads the facts every `interval` until aborted, publishing each change on `facts`;
    /// warns when the engine's block size differs from `block_size` (its cache was rebuilt
    /// with another one: its events will not translate).
    pub(crate) async fn run(
        self,
        interval: Duration,
        block_size: usize,
        facts: watch::Sender<EngineFacts>,
    ) {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let timeout = interval.max(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let known = facts.borrow().clone();
            let (now, cache) = self.read(&known, timeout).await;
            if let Some(engine) = cache.and_then(|c| c.block_size)
                && engine != block_size
            {
                tracing::error!(
                    engine,
                    agent = block_size,
                    "the engine's KV block size changed: restart the agent"
                );
            }
            facts.send_if_modified(|known| {
                if *known == now {
                    return false;
                }
                tracing::info!(adapters = ?now.adapters, total_blocks = now.total_blocks, "the engine's facts changed");
                *known = now;
                true
            });
        }
    }
}
