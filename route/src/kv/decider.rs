//! One decider per model across proxy replicas (docs/control-plane.md, "NATS: replicas").
//!
//! Replicas that each route part of a burst at the same moment all see the same cheapest
//! instances and pile onto them: none sees another's choice until it is shared, a
//! millisecond or more later. So the live replica with the lowest id (live: its load shares
//! arrive) decides for every replica of a model. The others prepare a request as before
//! (tokenize, hash, look up), ask it, and book its answer themselves ([`KvRouter::ask_decider`]);
//! the decider runs the same choice over its own view, books the request itself until the
//! asker's load share shows it settled ([`KvRouter::decide_for`]), and so routes the burst in
//! one order, as one proxy would. An asker that gets no answer within `kv.decider_timeout`
//! routes alone and asks nobody for [`QUIET_AFTER_TIMEOUT`]; a replica that knows of no
//! lower live replica routes alone.
//!
//! The router knows nothing of NATS: asks go out through the channel
//! [`KvRouter::serve_asks`] returns, and the proxy's control plane carries them.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::candidates::CandidateSet;
use crate::kv::decision::{Choice, Decision, KvRequest};
use crate::kv::router::KvRouter;
use crate::metrics::AskOutcome;
use crate::prepare::{PromptBlocks, RouteInput};

/// After an ask timed out, this replica routes alone this long before asking again.
pub const QUIET_AFTER_TIMEOUT: Duration = Duration::from_secs(1);

/// How long the decider keeps a booking made for another replica whose load share never
/// settled it (the asker died, or its shares were lost): a few of its load heartbeats.
pub const REMOTE_BOOKING_TTL: Duration = Duration::from_secs(5);

/// The instance a decider chose for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Steer {
    /// The instance's id.
    pub instance: u64,
    /// The data-parallel rank to send it to, when the engines' reports name one.
    pub dp_rank: Option<u32>,
}

/// One ask of the model's decider, for the proxy to send (and answer on `answer`; dropping
/// it unanswered counts as unavailable).
#[derive(Debug)]
pub struct DecideAsk {
    /// The decider: its replica id.
    pub decider: u64,
    /// This replica's number for the ask, rising.
    pub seq: u64,
    /// The prompt's blocks.
    pub prompt: Arc<PromptBlocks>,
    /// The instances it may go to (ids).
    pub candidates: Vec<u64>,
    /// Its session key, if any.
    pub session: Option<Arc<str>>,
    /// Where the decider's answer goes: `Some` with its choice, `None` when it declined.
    pub answer: oneshot::Sender<Option<Steer>>,
}

/// The asking side: where asks go, their numbers, and which are settled.
#[derive(Debug, Default)]
pub(crate) struct Asks {
    /// This replica's id, and the proxy's end of the asks (set once sharing starts).
    outbox: OnceLock<(u64, mpsc::UnboundedSender<DecideAsk>)>,
    numbers: Mutex<Numbers>,
    /// Milliseconds since `epoch` until which asks are not sent (after a timeout).
    quiet_until_ms: AtomicU64,
    epoch: OnceLock<Instant>,
}

/// Ask numbers handed out and not yet settled.
#[derive(Debug, Default)]
struct Numbers {
    last: u64,
    open: BTreeSet<u64>,
}

impl Asks {
    /// A new ask's number.
    fn open(&self) -> u64 {
        let mut numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        numbers.last += 1;
        let seq = numbers.last;
        numbers.open.insert(seq);
        seq
    }

    /// Ask `seq` is settled: its answer was taken or given up.
    fn settle(&self, seq: u64) {
        let mut numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        numbers.open.remove(&seq);
    }

    /// The highest number at and below which every ask is settled.
    fn settled(&self) -> u64 {
        let numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        numbers
            .open
            .first()
            .map_or(numbers.last, |&first| first - 1)
    }

    fn millis(&self, now: Instant) -> u64 {
        let epoch = *self.epoch.get_or_init(|| now);
        now.saturating_duration_since(epoch).as_millis() as u64
    }

    fn is_quiet(&self, now: Instant) -> bool {
        self.millis(now) < self.quiet_until_ms.load(Ordering::Relaxed)
    }

    fn quiet(&self, now: Instant) {
        let until = self.millis(now) + QUIET_AFTER_TIMEOUT.as_millis() as u64;
        self.quiet_until_ms.store(until, Ordering::Relaxed);
    }
}

/// One booking the decider made for another replica's request.
#[derive(Debug, Clone, Copy)]
struct RemoteBooking {
    replica: u64,
    seq: u64,
    instance: u64,
    id: u64,
    at: Instant,
}

/// The deciding side: bookings made for other replicas' requests, until settled.
#[derive(Debug, Default)]
pub(crate) struct RemoteBookings {
    bookings: Mutex<Vec<RemoteBooking>>,
}

impl RemoteBookings {
    fn add(&self, booking: RemoteBooking) {
        self.bookings
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(booking);
    }

    /// Removes the bookings that `keep` rejects; returns them as (instance, booking id).
    fn take(&self, keep: impl Fn(&RemoteBooking) -> bool) -> Vec<(u64, u64)> {
        let mut bookings = self.bookings.lock().unwrap_or_else(PoisonError::into_inner);
        let mut taken = Vec::new();
        bookings.retain(|booking| {
            let kept = keep(booking);
            if !kept {
                taken.push((booking.instance, booking.id));
            }
            kept
        });
        taken
    }

    /// Replica `replica` settled every ask up to `settled`: their bookings go.
    pub(crate) fn settled(&self, replica: u64, settled: u64) -> Vec<(u64, u64)> {
        self.take(|booking| booking.replica != replica || booking.seq > settled)
    }

    /// The bookings made before `cutoff` go (never settled).
    pub(crate) fn expired(&self, cutoff: Instant) -> Vec<(u64, u64)> {
        self.take(|booking| booking.at >= cutoff)
    }
}

impl KvRouter {
    /// From now on, asks for this model's decider go to the returned receiver, for the proxy
    /// to send; this replica's id is `replica`. `None` when they already do, or when
    /// `kv.decider_timeout` is 0 (every replica routes alone).
    pub fn serve_asks(&self, replica: u64) -> Option<mpsc::UnboundedReceiver<DecideAsk>> {
        if self.decider_timeout().is_zero() {
            return None;
        }
        let (asks, served) = mpsc::unbounded_channel();
        self.asks().outbox.set((replica, asks)).ok()?;
        Some(served)
    }

    /// The highest ask number at and below which this replica settled every ask (its load
    /// share carries it, so that the decider drops what it booked for them).
    pub fn decided(&self) -> u64 {
        self.asks().settled()
    }

    /// Asks the model's decider to route `request` to one of `candidates` (instance ids).
    /// `None`: route it here alone (this replica decides, no prompt, no answer in time).
    pub async fn ask_decider(&self, candidates: Vec<u64>, request: &KvRequest) -> Option<Steer> {
        let asks = self.asks();
        let (replica, outbox) = asks.outbox.get()?;
        let decider = self.replica_loads().lowest().filter(|&id| id < *replica)?;
        let RouteInput::Tokens(prompt) = &request.input else {
            return None;
        };
        let now = Instant::now();
        if asks.is_quiet(now) {
            return None;
        }
        let (answer, answered) = oneshot::channel();
        let seq = asks.open();
        let ask = DecideAsk {
            decider,
            seq,
            prompt: Arc::clone(prompt),
            candidates,
            session: request.session.clone(),
            answer,
        };
        let outcome = match outbox.send(ask) {
            Err(_) => Err(AskOutcome::Unavailable),
            Ok(()) => match tokio::time::timeout(self.decider_timeout(), answered).await {
                Ok(Ok(Some(steer))) => Ok(steer),
                Ok(Ok(None)) => Err(AskOutcome::Declined),
                Ok(Err(_)) => Err(AskOutcome::Unavailable),
                Err(_) => {
                    asks.quiet(Instant::now());
                    Err(AskOutcome::Timeout)
                }
            },
        };
        // Settled before it is booked: the booking's own load share follows at once.
        asks.settle(seq);
        self.metrics()
            .count_ask(outcome.err().unwrap_or(AskOutcome::Chosen));
        outcome.ok()
    }

    /// Routes replica `replica`'s request number `seq` as this model's decider: chooses among
    /// `candidates` for `prompt` (in `session`), records the prediction, and books it here
    /// until `replica`'s load share settles it ([`Self::settle_remote`]) or
    /// [`REMOTE_BOOKING_TTL`] passes. `None`: no instance could be chosen.
    pub fn decide_for<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        prompt: Arc<PromptBlocks>,
        session: Option<Arc<str>>,
        replica: u64,
        seq: u64,
    ) -> Option<Steer> {
        let now = Instant::now();
        let mut request = self.lookup_prompt(prompt, now);
        request.session = session;
        let Choice::Picked(decision) = self.choose(candidates, &request, &mut rand::thread_rng())
        else {
            return None;
        };
        if let Some(id) = self.book(&decision, &request, now) {
            self.remote().add(RemoteBooking {
                replica,
                seq,
                instance: decision.instance_id,
                id,
                at: now,
            });
        }
        self.metrics().decided_for_replicas.inc();
        Some(steer_of(&decision))
    }

    /// Releases what this replica booked as decider for `replica`'s asks up to `settled`.
    pub(crate) fn settle_remote(&self, replica: u64, settled: u64) {
        let released = self.remote().settled(replica, settled);
        self.release_all(&released);
    }

    /// Releases what this replica booked as decider and was never settled by `now`.
    pub(crate) fn expire_remote(&self, now: Instant) {
        if let Some(cutoff) = now.checked_sub(REMOTE_BOOKING_TTL) {
            let released = self.remote().expired(cutoff);
            self.release_all(&released);
        }
    }
}

/// The steer a decision gives.
fn steer_of(decision: &Decision) -> Steer {
    Steer {
        instance: decision.instance_id,
        dp_rank: decision.dp_rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_settle_in_any_order_and_the_mark_waits_for_the_oldest() {
        let asks = Asks::default();
        assert_eq!(asks.settled(), 0);
        let (one, two, three) = (asks.open(), asks.open(), asks.open());
        assert_eq!((one, two, three), (1, 2, 3));
        asks.settle(two);
        assert_eq!(asks.settled(), 0, "ask 1 is still open");
        asks.settle(one);
        assert_eq!(asks.settled(), 2);
        asks.settle(three);
        assert_eq!(asks.settled(), 3);
        assert_eq!(asks.open(), 4);
        assert_eq!(asks.settled(), 3);
    }

    #[test]
    fn remote_bookings_go_when_settled_or_stale() {
        let bookings = RemoteBookings::default();
        let held = |bookings: &RemoteBookings| bookings.bookings.lock().unwrap().len();
        let start = Instant::now();
        let booking = |replica, seq, id, at| RemoteBooking {
            replica,
            seq,
            instance: 9,
            id,
            at,
        };
        bookings.add(booking(1, 1, 10, start));
        bookings.add(booking(1, 2, 11, start));
        bookings.add(booking(2, 1, 12, start));
        bookings.add(booking(1, 3, 13, start + Duration::from_secs(2)));
        assert_eq!(bookings.settled(1, 2), vec![(9, 10), (9, 11)]);
        assert_eq!(bookings.settled(1, 2), vec![], "settled once");
        assert_eq!(held(&bookings), 2);
        assert_eq!(
            bookings.expired(start + Duration::from_secs(1)),
            vec![(9, 12)]
        );
        assert_eq!(bookings.settled(2, 5), vec![]);
        assert_eq!(bookings.settled(1, 3), vec![(9, 13)]);
        assert_eq!(held(&bookings), 0);
    }

    #[test]
    fn quiet_lasts_its_time() {
        let asks = Asks::default();
        let now = Instant::now();
        assert!(!asks.is_quiet(now));
        asks.quiet(now);
        assert!(asks.is_quiet(now + Duration::from_millis(10)));
        assert!(!asks.is_quiet(now + QUIET_AFTER_TIMEOUT + Duration::from_millis(1)));
    }
}
