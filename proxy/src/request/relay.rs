//! Relaying the engine's response to the client as it arrives (phase 7 of
//! [`crate::request`]), for every front end.
//!
//! Non-SSE bodies pass through chunk for chunk. SSE bodies are scanned on the
//! way (time to first token, inter-token gaps) and cut at event boundaries: a
//! chunk is forwarded up to its last complete event and an incomplete tail is
//! held until the event completes. Engines write whole events, so in practice
//! every chunk is forwarded as-is without a copy; the hold-back guarantees that
//! when an engine dies mid-stream the client never sees half an event before
//! the proxy's error event.
//!
//! A stream that may migrate ([`Migration`]) has its events read on the way (the
//! transcript); when its engine breaks off, the relay ends with [`RelayEnd::Broken`] instead
//! of an error event, and the spine continues the stream on another instance, whose relay
//! writes into the same client answer.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::time::Instant;

use kvmesh_config::LimitsConfig;
use kvmesh_route::kv::Booking;
use kvmesh_wire::sse::SseScanner;
use kvmesh_wire::usage::TokenCount;

use crate::edge::auth::CompletionMeter;
use crate::engines::instance::{Departure, Instance};
use crate::engines::upstream_session::UpstreamSession;
use crate::metrics::failure::FailureKind;
use crate::metrics::families::ModelMetrics;
use crate::metrics::token_timing::TokenTiming;
use crate::openai::api_error::error_json;
use crate::openai::headers::{ClientFraming, ProxyHeaders};
use crate::request::frontend::{Frontend, Unrelayable};
use crate::request::migrate::Migration;
use crate::request::pick::Pick;
use crate::request::record::Record;

/// Largest incomplete SSE event held back before it is forwarded anyway.
const MAX_HELD_BYTES: usize = 1 << 20;

/// Longest gap between two chunks of a stream whose instance vanished from discovery (not
/// drained) before it continues on another instance: an engine whose agent's registry lease
/// lapsed under load keeps streaming, one that died falls silent.
pub(crate) const VANISHED_STALL: Duration = Duration::from_secs(5);

/// What the relay needs to know about the request.
pub(crate) struct RelayContext<'a> {
    /// When the request head arrived (time-to-first-token origin).
    pub(crate) started: Instant,
    /// Longest gap allowed between two upstream body chunks.
    pub(crate) idle_timeout: Duration,
    /// Longest the client may take to accept one piece ([`to_client`]).
    pub(crate) write_timeout: Duration,
    /// The response is `text/event-stream`.
    pub(crate) event_stream: bool,
    /// How the client-side body is framed.
    pub(crate) framing: ClientFraming,
    /// Where timings go.
    pub(crate) metrics: &'a ModelMetrics,
    /// `policy: kv` load of the request, whose prefill ends with the first body chunk.
    pub(crate) booking: Option<&'a Booking<'a>>,
    /// Charges completion tokens to the API key as the body passes.
    pub(crate) meter: Option<&'a CompletionMeter>,
    /// The instance answering: a stream that may migrate leaves it when discovery does.
    pub(crate) instance: &'a Instance,
}

/// How a relay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RelayEnd {
    /// The whole body reached the client; the upstream session can be reused.
    Complete,
    /// The engine broke off or stalled mid-body. `clean`: the client got an SSE
    /// error event and a proper end of body; otherwise its connection (h1) or
    /// stream (h2) must be cut.
    UpstreamFailed {
        /// What went wrong.
        kind: FailureKind,
        /// Whether the body was ended with an error event.
        clean: bool,
    },
    /// The client went away (or wrote when it should not have).
    ClientGone,
    /// The engine broke off a stream that may migrate: nothing was written for the break,
    /// the client's answer stays open for a continuation.
    Broken(FailureKind),
    /// A continuation finished its choice of a stream of several, another one is to go on:
    /// the engine's answer is whole, the client's stays open.
    ChoiceDone,
}

/// Starts the client's answer to the engine response `engine` from `pick` (a continuation of
/// `migration`'s stream: goes on with the answer already started), then relays its body
/// within `limits.idle_timeout` between pieces, each taken by the client within
/// `limits.write_timeout`.
pub(crate) async fn relay<F: Frontend>(
    frontend: &mut F,
    engine: &mut UpstreamSession,
    pick: &Pick<'_>,
    record: &mut Record,
    metrics: &ModelMetrics,
    limits: &LimitsConfig,
    migration: Option<&mut Migration>,
) -> RelayEnd {
    let continued = migration.as_ref().and_then(|m| m.framing());
    let framing = match continued {
        Some(framing) => framing,
        None => {
            let ours = ProxyHeaders {
                instance: pick.instance.instance_header(),
                request_id: &record.request_id,
                route: pick.route.as_ref(),
            };
            match frontend.start_response(engine, ours).await {
                Ok(framing) => framing,
                Err(Unrelayable::ClientGone) => return RelayEnd::ClientGone,
                Err(Unrelayable::EngineHead) => {
                    return RelayEnd::UpstreamFailed {
                        kind: FailureKind::Reset,
                        clean: false,
                    };
                }
            }
        }
    };
    let ctx = RelayContext {
        started: record.started,
        idle_timeout: limits.idle_timeout,
        write_timeout: limits.write_timeout,
        event_stream: engine.is_event_stream(),
        framing,
        metrics,
        booking: pick.booking.as_ref(),
        meter: record.meter.as_ref(),
        instance: &pick.instance,
    };
    let Some(migration) = migration else {
        return relay_body(frontend, engine, &ctx, &mut record.tokens, None).await;
    };
    if continued.is_some() && (engine.status() != Some(200) || !ctx.event_stream) {
        // The continuation was refused: the stream ends as an unmigrated one would.
        let timing = EventTiming::default();
        return fail(
            frontend,
            &ctx,
            Some(&timing),
            &mut BytesMut::new(),
            FailureKind::Reset,
        )
        .await;
    }
    migration.started(framing);
    if continued.is_some()
        && !to_client(
            &ctx,
            frontend.write_body(migration_note(record.migrations, migration, pick), false),
        )
        .await
    {
        return RelayEnd::ClientGone;
    }
    relay_body(frontend, engine, &ctx, &mut record.tokens, Some(migration)).await
}

/// The explanation of a continuation, for a client whose `x-kvmesh-route` header left before
/// the break: an SSE comment (which clients skip), `: x-kvmesh-route migration=N; `, the
/// choice it carries when the stream has several (`choice=I; `), and the continuation's route
/// (or `instance=URL` without `policy: kv`).
fn migration_note(migrations: u32, migration: &Migration, pick: &Pick<'_>) -> Bytes {
    let choice = migration
        .choice_carried()
        .map(|index| format!("choice={index}; "))
        .unwrap_or_default();
    let route = pick.route.as_ref().and_then(|route| route.to_str().ok());
    let note = match route {
        Some(route) => format!(": x-kvmesh-route migration={migrations}; {choice}{route}\n\n"),
        None => format!(
            ": x-kvmesh-route migration={migrations}; {choice}instance={}\n\n",
            pick.instance.url()
        ),
    };
    Bytes::from(note)
}

/// Relays the body; on `Complete` the client body is finished. With `migration`, the
/// stream's events pass through it, and a break ends the relay as [`RelayEnd::Broken`] when
/// the stream may continue elsewhere.
pub(crate) async fn relay_body<F: Frontend>(
    frontend: &mut F,
    upstream: &mut UpstreamSession,
    ctx: &RelayContext<'_>,
    tokens: &mut TokenCount,
    mut migration: Option<&mut Migration>,
) -> RelayEnd {
    let continuing = migration.as_ref().is_some_and(|m| m.continuing());
    let mut events = ctx.event_stream.then(|| EventTiming::new(continuing));
    let mut held = BytesMut::new();
    let mut prefill = ctx.booking;
    // What the engine had already sent after the last piece (looked at to end the client's
    // body with that piece when nothing follows).
    let mut next = None;
    let left = ctx.instance.left();
    tokio::pin!(left);
    // The instance's record vanished from discovery while its engine may still stream.
    let mut vanished = false;
    loop {
        let idle_timeout = if vanished {
            ctx.idle_timeout.min(VANISHED_STALL)
        } else {
            ctx.idle_timeout
        };
        // A piece already buffered is taken without arming the idle timer.
        let read = match next.take().or_else(|| upstream.take_buffered()) {
            Some(read) => Ok(read),
            None => tokio::select! {
                biased;
                read = upstream.read_body_within(idle_timeout) => read,
                () = frontend.gone() => return RelayEnd::ClientGone,
                // Discovery removed the instance: its streams go on elsewhere while they
                // can, at once when it drained, once they stall when it vanished.
                departure = &mut left, if !vanished && migration.as_ref().is_some_and(|m| m.may_continue()) => {
                    match departure {
                        Departure::Drained => return RelayEnd::Broken(FailureKind::Left),
                        Departure::Vanished => {
                            vanished = true;
                            continue;
                        }
                    }
                }
            },
        };
        let chunk = match read {
            Err(_) | Ok(Err(_)) => {
                let kind = match read {
                    Err(_) if vanished => FailureKind::Left,
                    Err(_) => FailureKind::Timeout,
                    _ => FailureKind::Reset,
                };
                if migration.as_mut().is_some_and(|m| m.may_continue()) {
                    return RelayEnd::Broken(kind);
                }
                return fail(frontend, ctx, events.as_ref(), &mut held, kind).await;
            }
            Ok(Ok(None)) => break,
            Ok(Ok(Some(chunk))) => chunk,
        };
        if let Some(booking) = prefill.take() {
            booking.prefill_done(ctx.event_stream);
        }
        let mut out = match events.as_mut() {
            Some(timing) => {
                let boundary = timing.observe(&chunk, ctx);
                hold_back(&mut held, chunk, boundary)
            }
            None => Some(chunk),
        };
        // The transcript reads every event already: what it counted is not counted again.
        let mut text_events = None;
        if let Some(migration) = migration.as_mut()
            && let Some(whole) = out.take()
        {
            let passed = migration.pass(whole);
            if passed.broken && migration.may_continue() {
                if !passed.forward.is_empty()
                    && !to_client(ctx, frontend.write_body(passed.forward, false)).await
                {
                    return RelayEnd::ClientGone;
                }
                return RelayEnd::Broken(FailureKind::Reset);
            }
            text_events = Some(passed.text_events);
            out = Some(passed.forward);
        }
        if let Some(out) = out.as_ref() {
            count(tokens, ctx, out, text_events);
        }
        next = upstream.take_buffered();
        let last = matches!(next, Some(Ok(None))) && held.is_empty();
        if let (true, Some(booking)) = (last, ctx.booking) {
            booking.release();
        }
        if last && migration.as_ref().is_some_and(|m| m.another_choice()) {
            return choice_done(frontend, ctx, out).await;
        }
        if (out.is_some() || last)
            && !to_client(ctx, frontend.write_body(out.unwrap_or_default(), last)).await
        {
            return RelayEnd::ClientGone;
        }
        if last {
            return RelayEnd::Complete;
        }
    }
    // An event the engine never finished with a blank line still reaches the client, and
    // is charged like the rest.
    let rest = held.split().freeze();
    if !rest.is_empty() {
        count(tokens, ctx, &rest, None);
    }
    if let Some(booking) = ctx.booking {
        booking.release();
    }
    if migration.is_some_and(|m| m.another_choice()) {
        return choice_done(frontend, ctx, Some(rest)).await;
    }
    if !to_client(ctx, frontend.write_body(rest, true)).await {
        return RelayEnd::ClientGone;
    }
    RelayEnd::Complete
}

/// Writes `out`, the last piece of a continuation whose choice finished, and leaves the
/// client's answer open for the next choice.
async fn choice_done<F: Frontend>(
    frontend: &mut F,
    ctx: &RelayContext<'_>,
    out: Option<Bytes>,
) -> RelayEnd {
    if let Some(out) = out.filter(|out| !out.is_empty())
        && !to_client(ctx, frontend.write_body(out, false)).await
    {
        return RelayEnd::ClientGone;
    }
    RelayEnd::ChoiceDone
}

/// Counts the tokens of `out`, a piece of the body on its way to the client (SSE: its data
/// events carrying text, `text_events` when the migration transcript counted them), and
/// charges them to the API key when it meters completions.
fn count(tokens: &mut TokenCount, ctx: &RelayContext<'_>, out: &[u8], text_events: Option<u64>) {
    match text_events.filter(|_| ctx.event_stream) {
        Some(events) => tokens.observe_counted(out, events),
        None => tokens.observe(out, ctx.event_stream),
    }
    if let Some(meter) = ctx.meter {
        meter.charge_to(tokens.completion_tokens());
    }
}

/// SSE scanning and timing state.
#[derive(Debug, Default)]
struct EventTiming {
    scanner: SseScanner,
    tokens: TokenTiming,
}

impl EventTiming {
    /// The state of a stream's relay (`continued`: a migrated stream's continuation, whose
    /// first chunk is not the stream's first token).
    fn new(continued: bool) -> Self {
        Self {
            scanner: SseScanner::default(),
            tokens: if continued {
                TokenTiming::continued()
            } else {
                TokenTiming::default()
            },
        }
    }

    /// Records timings for `chunk`, and its data events as generated tokens on the booking;
    /// returns its last event boundary.
    fn observe(&mut self, chunk: &[u8], ctx: &RelayContext<'_>) -> Option<usize> {
        let scan = self.scanner.feed(chunk);
        self.tokens
            .observe(scan.data_events, ctx.started, ctx.metrics);
        if let Some(booking) = ctx.booking {
            booking.generated(scan.data_events as u64);
        }
        scan.last_boundary
    }
}

/// Splits `chunk` at its last event boundary: returns what can be forwarded
/// now and keeps the incomplete rest in `held`.
fn hold_back(held: &mut BytesMut, chunk: Bytes, boundary: Option<usize>) -> Option<Bytes> {
    match boundary {
        Some(end) => {
            let out = if held.is_empty() {
                chunk.slice(..end)
            } else {
                held.extend_from_slice(&chunk[..end]);
                held.split().freeze()
            };
            if end < chunk.len() {
                held.extend_from_slice(&chunk[end..]);
            }
            Some(out)
        }
        None => {
            held.extend_from_slice(&chunk);
            (held.len() > MAX_HELD_BYTES).then(|| held.split().freeze())
        }
    }
}

/// Ends the client's answer after an upstream failure: with an SSE error event when the
/// framing allows one, else as the front end's protocol allows.
async fn fail<F: Frontend>(
    frontend: &mut F,
    ctx: &RelayContext<'_>,
    events: Option<&EventTiming>,
    held: &mut BytesMut,
    kind: FailureKind,
) -> RelayEnd {
    let event = events
        .filter(|_| ctx.framing == ClientFraming::Open)
        .map(|timing| {
            // An event cut short and still held is dropped; one already forwarded
            // (over the hold-back limit) is terminated so the error stands alone.
            let partial_sent = held.is_empty() && timing.scanner.mid_event();
            held.clear();
            error_event(kind, partial_sent)
        });
    let clean = to_client(ctx, frontend.end_broken(kind, event)).await;
    RelayEnd::UpstreamFailed { kind, clean }
}

/// Runs `write`, a write to the client, within `ctx`'s write timeout: a client that takes
/// longer stopped reading, and its answer is cut (`false`: its connection is closed, the
/// engine's request cancelled), counted in `kvmesh_client_write_timeouts_total`.
async fn to_client(ctx: &RelayContext<'_>, write: impl Future<Output = bool>) -> bool {
    within_write_timeout(ctx.write_timeout, ctx.metrics, write).await
}

/// [`to_client`] with the timeout and metrics given.
async fn within_write_timeout(
    limit: Duration,
    metrics: &ModelMetrics,
    write: impl Future<Output = bool>,
) -> bool {
    match tokio::time::timeout(limit, write).await {
        Ok(written) => written,
        Err(_) => {
            metrics.client_write_timeouts.inc();
            false
        }
    }
}

/// Ends a stream that broke off and cannot continue with an error event, taken by the
/// client within `write_timeout`; returns whether the answer ended cleanly.
pub(crate) async fn end_broken<F: Frontend>(
    frontend: &mut F,
    kind: FailureKind,
    record: &mut Record,
    write_timeout: Duration,
) -> bool {
    record.upstream_failure = Some(kind);
    let write = frontend.end_broken(kind, Some(error_event(kind, false)));
    match record.pool.as_deref() {
        Some(pool) => within_write_timeout(write_timeout, pool.metrics(), write).await,
        None => write.await,
    }
}

/// `data: {"error":{...}}` followed by a blank line.
fn error_event(kind: FailureKind, terminate_partial: bool) -> Bytes {
    let (message, kind, code) = match kind {
        FailureKind::Timeout => (
            "the engine stopped sending within the idle timeout",
            "timeout",
            "upstream_timeout",
        ),
        FailureKind::Left => (
            "the engine instance left service discovery mid-stream",
            "upstream_error",
            "upstream_left",
        ),
        _ => (
            "the engine connection broke mid-stream",
            "upstream_error",
            "upstream_disconnected",
        ),
    };
    let mut event = Vec::with_capacity(160);
    if terminate_partial {
        event.extend_from_slice(b"\n\n");
    }
    event.extend_from_slice(b"data: ");
    event.extend_from_slice(&error_json(message, kind, None, code));
    event.extend_from_slice(b"\n\n");
    Bytes::from(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_events_pass_without_copy() {
        let mut held = BytesMut::new();
        let chunk = Bytes::from_static(b"data: a\n\ndata: b\n\n");
        let out = hold_back(&mut held, chunk.clone(), Some(chunk.len())).unwrap();
        assert_eq!(out.as_ptr(), chunk.as_ptr());
        assert!(held.is_empty());
    }

    #[test]
    fn incomplete_tails_are_held_until_complete() {
        let mut held = BytesMut::new();
        let first = Bytes::from_static(b"data: a\n\ndata: b");
        assert_eq!(
            hold_back(&mut held, first, Some(9)).unwrap(),
            Bytes::from_static(b"data: a\n\n")
        );
        assert_eq!(&held[..], b"data: b");
        assert_eq!(hold_back(&mut held, Bytes::from_static(b"cd"), None), None);
        let out = hold_back(&mut held, Bytes::from_static(b"\n\ndata: c"), Some(2)).unwrap();
        assert_eq!(out, Bytes::from_static(b"data: bcd\n\n"));
        assert_eq!(&held[..], b"data: c");
    }

    #[test]
    fn oversized_events_are_forwarded_anyway() {
        let mut held = BytesMut::new();
        let big = Bytes::from(vec![b'x'; MAX_HELD_BYTES + 1]);
        let out = hold_back(&mut held, big, None).unwrap();
        assert_eq!(out.len(), MAX_HELD_BYTES + 1);
        assert!(held.is_empty());
    }

    #[test]
    fn error_events_are_one_json_event() {
        let event = error_event(FailureKind::Reset, false);
        let text = std::str::from_utf8(&event).unwrap();
        let json = text
            .strip_prefix("data: ")
            .and_then(|rest| rest.strip_suffix("\n\n"))
            .unwrap();
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        assert_eq!(value["error"]["code"], "upstream_disconnected");
        let timeout = error_event(FailureKind::Timeout, true);
        assert!(timeout.starts_with(b"\n\ndata: {\"error\""));
    }
}
