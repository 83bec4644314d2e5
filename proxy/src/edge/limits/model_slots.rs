//! Per-model concurrency limits: at most `max_in_flight` requests of a model
//! are forwarded at once; up to `queue_size` more wait, first come first
//! served, for at most `queue_timeout`; the rest are answered 503.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use kvmesh_config::{ConcurrencyConfig, Config};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::timeout;

use crate::edge::edge_metrics::{EdgeMetrics, ModelLimitMetrics};

/// Why a request got no slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotRejection {
    /// Every slot is taken and the queue is full.
    QueueFull,
    /// No slot became free within the queue timeout.
    QueueTimeout,
}

impl SlotRejection {
    /// For the error message.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Self::QueueFull => "its concurrency limit is reached and its queue is full",
            Self::QueueTimeout => "no slot under its concurrency limit became free in time",
        }
    }
}

/// One model's slots and queue.
#[derive(Debug)]
pub(crate) struct ModelSlots {
    settings: ConcurrencyConfig,
    slots: Arc<Semaphore>,
    waiting: AtomicU32,
    metrics: ModelLimitMetrics,
}

/// Keeps a queue place (and the depth gauge) taken while alive.
struct QueuePlace<'a>(&'a ModelSlots);

impl Drop for QueuePlace<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.queue_depth.dec();
    }
}

impl ModelSlots {
    /// Slots for a model limited to `max` requests in flight.
    fn new(settings: &ConcurrencyConfig, max: u32, metrics: ModelLimitMetrics) -> Self {
        Self {
            settings: settings.clone(),
            slots: Arc::new(Semaphore::new(max as usize)),
            waiting: AtomicU32::new(0),
            metrics,
        }
    }

    /// A slot, at once or after waiting in the queue; released when the permit drops.
    pub(crate) async fn acquire(&self) -> Result<OwnedSemaphorePermit, SlotRejection> {
        if let Ok(permit) = Arc::clone(&self.slots).try_acquire_owned() {
            return Ok(permit);
        }
        let queued = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.settings.queue_size).then_some(n + 1)
            });
        if queued.is_err() {
            self.metrics.queue_full.inc();
            return Err(SlotRejection::QueueFull);
        }
        self.metrics.queue_depth.inc();
        let _place = QueuePlace(self);
        match timeout(
            self.settings.queue_timeout,
            Arc::clone(&self.slots).acquire_owned(),
        )
        .await
        {
            Ok(Ok(permit)) => Ok(permit),
            // The semaphore is never closed; treat it like a timeout all the same.
            Ok(Err(_)) | Err(_) => {
                self.metrics.queue_timeout.inc();
                Err(SlotRejection::QueueTimeout)
            }
        }
    }

    /// Seconds a rejected client should wait: the queue timeout, at least 1.
    pub(crate) fn retry_after_secs(&self) -> u64 {
        self.settings.queue_timeout.as_secs().max(1)
    }
}

/// The concurrency limits of every model that has one, by canonical name.
#[derive(Debug, Default)]
pub(crate) struct ConcurrencyLimits {
    by_model: HashMap<String, Arc<ModelSlots>>,
}

impl ConcurrencyLimits {
    /// The limits of `config`. A model whose settings are unchanged from
    /// `previous` keeps its slots, so requests in flight across a reload still count.
    pub(crate) fn new(config: &Config, metrics: &EdgeMetrics, previous: Option<&Self>) -> Self {
        let by_model = config
            .models
            .iter()
            .filter_map(|model| {
                let max = model.concurrency.max_in_flight?;
                let kept = previous
                    .and_then(|previous| previous.by_model.get(&model.name))
                    .filter(|slots| slots.settings == model.concurrency)
                    .map(Arc::clone);
                let slots = kept.unwrap_or_else(|| {
                    let handles = metrics.model_limit(&model.name, max);
                    Arc::new(ModelSlots::new(&model.concurrency, max, handles))
                });
                Some((model.name.clone(), slots))
            })
            .collect();
        Self { by_model }
    }

    /// The slots of the model named `model` (canonical), if it is limited.
    pub(crate) fn get(&self, model: &str) -> Option<&ModelSlots> {
        self.by_model.get(model).map(Arc::as_ref)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::families::Metrics;

    fn config(extra: &str) -> Config {
        let text = format!(
            "models:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:1\n    concurrency:\n{extra}"
        );
        Config::from_yaml_str(&text, "t.yaml").unwrap()
    }

    #[tokio::test]
    async fn slots_queue_then_reject() {
        let metrics = Metrics::new().unwrap();
        let limits = ConcurrencyLimits::new(
            &config("      max_in_flight: 1\n      queue_size: 1\n      queue_timeout: 100ms\n"),
            &metrics.edge,
            None,
        );
        let slots = limits.get("m").unwrap();
        assert!(limits.get("other").is_none());
        let first = slots.acquire().await.unwrap();
        // One waiter fits; it gets the slot when the first request ends.
        let (second, third) = tokio::join!(slots.acquire(), async {
            while slots.waiting.load(Ordering::Acquire) == 0 {
                tokio::task::yield_now().await;
            }
            let full = slots.acquire().await;
            drop(first);
            full
        });
        assert_eq!(third.unwrap_err(), SlotRejection::QueueFull);
        let second = second.unwrap();
        assert_eq!(
            slots.acquire().await.unwrap_err(),
            SlotRejection::QueueTimeout
        );
        drop(second);
        assert!(slots.acquire().await.is_ok());
        assert_eq!(slots.metrics.queue_depth.get(), 0);
        assert_eq!(slots.metrics.queue_full.get(), 1);
        assert_eq!(slots.metrics.queue_timeout.get(), 1);
    }

    #[tokio::test]
    async fn unchanged_models_keep_their_slots_across_a_reload() {
        let metrics = Metrics::new().unwrap();
        let text = "      max_in_flight: 1\n      queue_size: 0\n";
        let first = ConcurrencyLimits::new(&config(text), &metrics.edge, None);
        let held = first.get("m").unwrap().acquire().await.unwrap();
        let kept = ConcurrencyLimits::new(&config(text), &metrics.edge, Some(&first));
        assert_eq!(
            kept.get("m").unwrap().acquire().await.unwrap_err(),
            SlotRejection::QueueFull
        );
        let changed = ConcurrencyLimits::new(
            &config("      max_in_flight: 2\n      queue_size: 0\n"),
            &metrics.edge,
            Some(&kept),
        );
        assert!(changed.get("m").unwrap().acquire().await.is_ok());
        drop(held);
        let unlimited =
            ConcurrencyLimits::new(&config("      queue_size: 0\n"), &metrics.edge, None);
        assert!(unlimited.get("m").is_none());
    }
}
