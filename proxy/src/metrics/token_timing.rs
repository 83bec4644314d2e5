//! Token timings of a streamed response, shared by the HTTP relay and the gRPC
//! listener: time to first token at the first body chunk, inter-token latency between
//! data events.

use tokio::time::Instant;

use crate::metrics::families::ModelMetrics;

/// Timing state of one streamed response.
#[derive(Debug, Default)]
pub(crate) struct TokenTiming {
    seen_first_chunk: bool,
    last_event_at: Option<Instant>,
}

impl TokenTiming {
    /// The timing of a stream continued from another relay (a migration): its first chunk
    /// is not the stream's first token.
    pub(crate) fn continued() -> Self {
        Self {
            seen_first_chunk: true,
            last_event_at: None,
        }
    }

    /// Records a body chunk holding `data_events` data events, for a request that
    /// arrived at `started`.
    pub(crate) fn observe(&mut self, data_events: usize, started: Instant, metrics: &ModelMetrics) {
        let now = Instant::now();
        if !self.seen_first_chunk {
            self.seen_first_chunk = true;
            metrics
                .time_to_first_token
                .observe(now.duration_since(started).as_secs_f64());
        }
        if data_events > 0 {
            if let Some(previous) = self.last_event_at {
                // Events that arrive together share the gap since the last one.
                let gap = now.duration_since(previous).as_secs_f64() / data_events as f64;
                for _ in 0..data_events {
                    metrics.inter_token_latency.observe(gap);
                }
            }
            self.last_event_at = Some(now);
        }
    }
}
