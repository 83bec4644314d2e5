//! Timing of one streamed response, event by event.

use std::time::Instant;

use crate::sse::DataEvent;

/// What has been seen of a stream so far.
#[derive(Debug, Clone, Copy)]
pub struct StreamProgress {
    /// When the first content event arrived.
    pub first_content: Option<Instant>,
    last_content: Option<Instant>,
    /// Content events seen.
    pub content_events: u64,
    /// Completion tokens reported by a usage chunk, if any.
    pub reported_tokens: Option<u64>,
    /// Prompt tokens reported by a usage chunk, if any.
    pub prompt_tokens: Option<u64>,
    /// Prompt tokens the engine reported served from its prefix cache, if any.
    pub cached_tokens: Option<u64>,
    /// The `[DONE]` line arrived.
    pub done: bool,
    /// An error object arrived.
    pub error: bool,
}

impl Default for StreamProgress {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamProgress {
    /// Nothing seen yet.
    pub fn new() -> Self {
        Self {
            first_content: None,
            last_content: None,
            content_events: 0,
            reported_tokens: None,
            prompt_tokens: None,
            cached_tokens: None,
            done: false,
            error: false,
        }
    }

    /// Notes `event`, received at `now`; pushes the gap since the previous content event (µs)
    /// onto `itl_micros`.
    pub fn observe(&mut self, event: DataEvent, now: Instant, itl_micros: &mut Vec<u64>) {
        if event.content {
            if let Some(previous) = self.last_content {
                let gap = now.saturating_duration_since(previous).as_micros();
                itl_micros.push(u64::try_from(gap).unwrap_or(u64::MAX));
            }
            self.first_content.get_or_insert(now);
            self.last_content = Some(now);
            self.content_events += 1;
        }
        if let Some(tokens) = event.completion_tokens {
            self.reported_tokens = Some(tokens);
        }
        if event.prompt_tokens.is_some() {
            self.prompt_tokens = event.prompt_tokens;
            self.cached_tokens = event.cached_tokens;
        }
        self.done |= event.done;
        self.error |= event.error;
    }

    /// Generated tokens: the usage report when there is one, else one per content event.
    pub fn output_tokens(&self) -> u64 {
        self.reported_tokens.unwrap_or(self.content_events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn content() -> DataEvent {
        DataEvent {
            content: true,
            ..DataEvent::default()
        }
    }

    #[test]
    fn gaps_are_between_content_events_only() {
        let t0 = Instant::now();
        let mut p = StreamProgress::new();
        let mut gaps = Vec::new();
        p.observe(DataEvent::default(), t0, &mut gaps);
        p.observe(content(), t0 + Duration::from_micros(100), &mut gaps);
        p.observe(content(), t0 + Duration::from_micros(350), &mut gaps);
        p.observe(
            DataEvent::default(),
            t0 + Duration::from_micros(400),
            &mut gaps,
        );
        p.observe(content(), t0 + Duration::from_micros(1000), &mut gaps);
        assert_eq!(gaps, vec![250, 650]);
        assert_eq!(p.first_content, Some(t0 + Duration::from_micros(100)));
        assert_eq!(p.output_tokens(), 3);
        assert!(!p.done);
    }

    #[test]
    fn usage_overrides_the_event_count() {
        let t0 = Instant::now();
        let mut p = StreamProgress::new();
        let mut gaps = Vec::new();
        p.observe(content(), t0, &mut gaps);
        let usage = DataEvent {
            completion_tokens: Some(16),
            prompt_tokens: Some(100),
            cached_tokens: Some(96),
            ..DataEvent::default()
        };
        p.observe(usage, t0, &mut gaps);
        let done = DataEvent {
            done: true,
            ..DataEvent::default()
        };
        p.observe(done, t0, &mut gaps);
        assert_eq!(p.output_tokens(), 16);
        assert_eq!((p.prompt_tokens, p.cached_tokens), (Some(100), Some(96)));
        assert!(p.done);
        assert!(!p.error);
    }
}
