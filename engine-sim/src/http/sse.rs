//! Server-sent events: `data: {json}\n\n` frames (or `event: NAME\ndata: {json}\n\n` ones)
//! built from scheduler events, ending with `data: [DONE]\n\n` unless the format has no such
//! marker.

use std::task::{Context, Poll};

use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use tokio::sync::mpsc::UnboundedReceiver;

use crate::scheduler::SeqEvent;

/// At most this many queued events are coalesced into one body frame.
const MAX_EVENTS_PER_FRAME: usize = 64;

/// Turns the events of one request into SSE frames.
pub(crate) trait StreamFormatter: Send + std::fmt::Debug {
    /// Appends the frames for one event.
    fn event(&mut self, event: SeqEvent, out: &mut BytesMut);
    /// Appends the closing frames once every sequence finished (before `[DONE]`).
    fn finish(&mut self, out: &mut BytesMut);
    /// Whether the stream ends with `data: [DONE]` (the OpenAI Responses API has none).
    fn done_marker(&self) -> bool {
        true
    }
}

/// Appends `data: <json>\n\n`.
pub(crate) fn write_data<T: Serialize>(out: &mut BytesMut, value: &T) {
    out.put_slice(b"data: ");
    let mut w = out.writer();
    // Serializing our response structs into memory cannot fail.
    let _ = serde_json::to_writer(&mut w, value);
    let out = w.into_inner();
    out.put_slice(b"\n\n");
}

/// Appends `event: <name>\ndata: <json>\n\n`.
pub(crate) fn write_event<T: Serialize>(out: &mut BytesMut, name: &str, value: &T) {
    out.put_slice(b"event: ");
    out.put_slice(name.as_bytes());
    out.put_slice(b"\n");
    write_data(out, value);
}

/// Appends `data: <raw bytes>\n\n`.
pub(crate) fn write_raw(out: &mut BytesMut, json: &[u8]) {
    out.put_slice(b"data: ");
    out.put_slice(json);
    out.put_slice(b"\n\n");
}

/// A streaming body fed by the scheduler.
#[derive(Debug)]
pub(crate) struct SseBody {
    rx: UnboundedReceiver<SeqEvent>,
    formatter: Box<dyn StreamFormatter>,
    remaining: usize,
    done: bool,
    buf: BytesMut,
}

impl SseBody {
    /// A stream over the events of `sequences` sequences.
    pub(crate) fn new(
        rx: UnboundedReceiver<SeqEvent>,
        sequences: usize,
        formatter: Box<dyn StreamFormatter>,
    ) -> Self {
        Self {
            rx,
            formatter,
            remaining: sequences,
            done: false,
            buf: BytesMut::with_capacity(512),
        }
    }

    /// Whether `[DONE]` (or the end of a broken stream) was produced.
    pub(crate) fn is_done(&self) -> bool {
        self.done && self.buf.is_empty()
    }

    /// The next chunk of bytes; `None` at the end.
    pub(crate) fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let mut handled = 0;
        while !self.done && handled < MAX_EVENTS_PER_FRAME {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(event)) => {
                    handled += 1;
                    if matches!(event, SeqEvent::Finished(_) | SeqEvent::Failed { .. }) {
                        self.remaining = self.remaining.saturating_sub(1);
                    }
                    self.formatter.event(event, &mut self.buf);
                    if self.remaining == 0 {
                        self.formatter.finish(&mut self.buf);
                        if self.formatter.done_marker() {
                            self.buf.put_slice(b"data: [DONE]\n\n");
                        }
                        self.done = true;
                    }
                }
                // The engine stopped mid-stream: end the body without [DONE].
                Poll::Ready(None) => self.done = true,
                Poll::Pending => break,
            }
        }
        if !self.buf.is_empty() {
            return Poll::Ready(Some(self.buf.split().freeze()));
        }
        if self.done {
            Poll::Ready(None)
        } else {
            Poll::Pending
        }
    }
}

#[cfg(test)]
mod tests {
    use std::task::Waker;

    use tokio::sync::mpsc;

    use super::*;

    #[derive(Debug)]
    struct Plain;

    impl StreamFormatter for Plain {
        fn event(&mut self, event: SeqEvent, out: &mut BytesMut) {
            let text = match event {
                SeqEvent::Delta { text, .. } => text,
                SeqEvent::Finished(o) => o.text,
                SeqEvent::Failed { message, .. } => message,
            };
            write_data(out, &text);
        }

        fn finish(&mut self, out: &mut BytesMut) {
            write_raw(out, b"\"end\"");
        }
    }

    fn outcome(text: &str) -> SeqEvent {
        SeqEvent::Finished(crate::scheduler::SeqOutcome {
            index: 0,
            text: text.into(),
            finish: crate::metrics::Finish::Length,
            stop: None,
            prompt_tokens: 1,
            completion_tokens: 1,
            cached_tokens: 0,
            held_blocks: Vec::new(),
        })
    }

    #[test]
    fn frames_events_and_terminates_with_done() {
        let (tx, rx) = mpsc::unbounded_channel();
        let mut body = SseBody::new(rx, 1, Box::new(Plain));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(body.poll_chunk(&mut cx).is_pending());
        let _ = tx.send(SeqEvent::Delta {
            index: 0,
            text: "a".into(),
        });
        let _ = tx.send(outcome("b"));
        let chunk = match body.poll_chunk(&mut cx) {
            Poll::Ready(Some(c)) => c,
            other => panic!("expected a chunk, got {other:?}"),
        };
        assert_eq!(
            &chunk[..],
            b"data: \"a\"\n\ndata: \"b\"\n\ndata: \"end\"\n\ndata: [DONE]\n\n"
        );
        assert!(body.is_done());
        assert!(matches!(body.poll_chunk(&mut cx), Poll::Ready(None)));
    }

    #[test]
    fn engine_going_away_ends_the_stream() {
        let (tx, rx) = mpsc::unbounded_channel::<SeqEvent>();
        let mut body = SseBody::new(rx, 1, Box::new(Plain));
        drop(tx);
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(body.poll_chunk(&mut cx), Poll::Ready(None)));
    }
}
