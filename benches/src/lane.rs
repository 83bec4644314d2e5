//! A lane: one request at a time on its own connection, with its own buffers and recorder.

use std::sync::Arc;
use std::time::Instant;

use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::client::Client;
use crate::connection::Sender;
use crate::error_kind::ErrorKind;
use crate::recorder::{Completed, Recorder};
use crate::scan;
use crate::sse::SseScanner;
use crate::stream_progress::StreamProgress;
use crate::workload::WorkItem;

/// How one request is timed and whether it counts.
#[derive(Debug, Clone, Copy)]
pub struct Attempt {
    /// Latency is measured from here: the send time (closed loop) or the scheduled arrival
    /// (open loop, so queueing in the generator shows up instead of being hidden).
    pub origin: Instant,
    /// Whether the outcome is recorded (false during warm-up).
    pub record: bool,
    /// End of the measurement window: a response not finished by then is abandoned uncounted.
    pub cutoff: Option<Instant>,
}

/// A connection slot with reusable buffers and its own recorder (no shared state per request).
#[derive(Debug)]
pub struct Lane {
    client: Arc<Client>,
    sender: Option<Sender>,
    scanner: SseScanner,
    body: Vec<u8>,
    itl_micros: Vec<u64>,
    recorder: Recorder,
}

impl Lane {
    /// A lane that connects on its first request.
    pub fn new(client: Arc<Client>) -> Self {
        Self {
            client,
            sender: None,
            scanner: SseScanner::new(),
            body: Vec::new(),
            itl_micros: Vec::new(),
            recorder: Recorder::new(),
        }
    }

    /// What this lane measured.
    pub fn recorder(&self) -> &Recorder {
        &self.recorder
    }

    /// Sends `item`, reads the whole response and records the outcome.
    pub async fn run(&mut self, item: &WorkItem, attempt: Attempt) {
        let timeout_at = Instant::now() + self.client.timeout;
        let (limit, hit_cutoff) = match attempt.cutoff {
            Some(cutoff) if cutoff < timeout_at => (cutoff, true),
            _ => (timeout_at, false),
        };
        let result =
            tokio::time::timeout_at(limit.into(), self.exchange(item, attempt.origin)).await;
        let now = Instant::now();
        match result {
            Ok(Ok(completed)) => {
                if attempt.record {
                    self.recorder.record_success(&completed, &self.itl_micros);
                }
            }
            Ok(Err(kind)) => {
                if kind.poisons_connection() {
                    self.sender = None;
                }
                if attempt.record {
                    self.recorder.record_error(kind, now);
                }
            }
            Err(_elapsed) => {
                self.sender = None;
                if attempt.record && !hit_cutoff {
                    self.recorder.record_error(ErrorKind::Timeout, now);
                }
            }
        }
    }

    async fn exchange(&mut self, item: &WorkItem, origin: Instant) -> Result<Completed, ErrorKind> {
        self.itl_micros.clear();
        let request = self.client.request(item);
        let sender = self.ready_sender().await?;
        let response = sender.send(request).await.map_err(|_| ErrorKind::Io)?;
        let status = response.status();
        let mut body = response.into_body();
        if !status.is_success() {
            while let Some(frame) = body.frame().await {
                frame.map_err(|_| ErrorKind::Io)?;
            }
            return Err(ErrorKind::Status(status.as_u16()));
        }
        if item.stream {
            self.read_stream(body, origin).await
        } else {
            self.read_whole(body, origin).await
        }
    }

    async fn ready_sender(&mut self) -> Result<&mut Sender, ErrorKind> {
        let mut current = self.sender.take();
        if let Some(sender) = current.as_mut()
            && sender.ready().await.is_err()
        {
            current = None;
        }
        let sender = match current {
            Some(sender) => sender,
            None => {
                let mut fresh = self
                    .client
                    .connector
                    .connect()
                    .await
                    .map_err(|_| ErrorKind::Connect)?;
                fresh.ready().await.map_err(|_| ErrorKind::Connect)?;
                fresh
            }
        };
        Ok(self.sender.insert(sender))
    }

    async fn read_whole(
        &mut self,
        mut body: Incoming,
        origin: Instant,
    ) -> Result<Completed, ErrorKind> {
        self.body.clear();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| ErrorKind::Io)?;
            if let Some(data) = frame.data_ref() {
                self.body.extend_from_slice(data);
            }
        }
        let finished_at = Instant::now();
        Ok(Completed {
            ttft: None,
            e2e: finished_at.saturating_duration_since(origin),
            output_tokens: scan::completion_tokens(&self.body).unwrap_or(0),
            prompt_tokens: scan::prompt_tokens(&self.body),
            cached_tokens: scan::cached_tokens(&self.body),
            finished_at,
        })
    }

    async fn read_stream(
        &mut self,
        mut body: Incoming,
        origin: Instant,
    ) -> Result<Completed, ErrorKind> {
        let Self {
            scanner,
            itl_micros,
            ..
        } = self;
        scanner.reset();
        let mut progress = StreamProgress::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| ErrorKind::Io)?;
            if let Some(data) = frame.data_ref() {
                let now = Instant::now();
                scanner.feed(data, |event| progress.observe(event, now, itl_micros));
            }
        }
        let finished_at = Instant::now();
        scanner.finish(|event| progress.observe(event, finished_at, itl_micros));
        if progress.error {
            return Err(ErrorKind::StreamError);
        }
        if !progress.done {
            return Err(ErrorKind::IncompleteStream);
        }
        Ok(Completed {
            ttft: progress
                .first_content
                .map(|first| first.saturating_duration_since(origin)),
            e2e: finished_at.saturating_duration_since(origin),
            output_tokens: progress.output_tokens(),
            prompt_tokens: progress.prompt_tokens,
            cached_tokens: progress.cached_tokens,
            finished_at,
        })
    }
}
