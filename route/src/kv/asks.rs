//! The bookkeeping of one model's decider link ([`super::decider`]): the asker's numbered
//! asks and which are settled, and the bookings the decider holds for other replicas.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::prepare::PromptBlocks;

/// After an ask timed out, this replica routes alone this long before asking again.
pub const QUIET_AFTER_TIMEOUT: Duration = Duration::from_millis(250);

/// The longest the decider holds an ask for the asker's load share that shows the load the
/// asker shed before asking (at most a quarter of `kv.decider_timeout`, too).
pub const SHARE_WAIT: Duration = Duration::from_millis(5);

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
    /// The decider followed the request's session binding (made before this request).
    pub session_bound: bool,
}

/// One ask of the model's decider, for the proxy to send (and answer on `answer`; dropping
/// it unanswered counts as unavailable).
#[derive(Debug)]
pub struct DecideAsk {
    /// The decider: its replica id.
    pub decider: u64,
    /// This replica's number for the ask, rising.
    pub seq: u64,
    /// How many times this replica's load went down before it asked (a first token, a
    /// request's end): the decider decides once its share shows as many.
    pub eased: u64,
    /// The prompt's blocks.
    pub prompt: Arc<PromptBlocks>,
    /// The instances it may go to (ids).
    pub candidates: Vec<u64>,
    /// Its session key, if any.
    pub session: Option<Arc<str>>,
    /// A fingerprint of this replica's `kv` settings for the model: the decider declines
    /// when its own differ (replicas configured apart, or in the middle of a reload).
    pub settings: u64,
    /// Where the decider's answer goes: `Some` with its choice, `None` when it declined.
    pub answer: oneshot::Sender<Option<Steer>>,
}

/// The asking side: where asks go, their numbers, and which are settled.
#[derive(Debug, Default)]
pub(crate) struct Asks {
    /// This replica's id, and the proxy's end of the asks (set once sharing starts).
    pub(super) outbox: OnceLock<(u64, mpsc::UnboundedSender<DecideAsk>)>,
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
    pub(super) fn open(&self) -> u64 {
        let mut numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        numbers.last += 1;
        let seq = numbers.last;
        numbers.open.insert(seq);
        seq
    }

    /// Ask `seq` is settled: its answer was taken or given up.
    pub(super) fn settle(&self, seq: u64) {
        let mut numbers = self.numbers.lock().unwrap_or_else(PoisonError::into_inner);
        numbers.open.remove(&seq);
    }

    /// The highest number at and below which every ask is settled.
    pub(super) fn settled(&self) -> u64 {
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

    pub(super) fn is_quiet(&self, now: Instant) -> bool {
        self.millis(now) < self.quiet_until_ms.load(Ordering::Relaxed)
    }

    pub(super) fn quiet(&self, now: Instant) {
        let until = self.millis(now) + QUIET_AFTER_TIMEOUT.as_millis() as u64;
        self.quiet_until_ms.store(until, Ordering::Relaxed);
    }
}

/// One booking the decider made for another replica's request.
#[derive(Debug, Clone, Copy)]
pub(super) struct RemoteBooking {
    pub(super) replica: u64,
    pub(super) seq: u64,
    pub(super) instance: u64,
    pub(super) id: u64,
    pub(super) at: Instant,
}

/// The deciding side: bookings made for other replicas' requests, until settled.
#[derive(Debug, Default)]
pub(crate) struct RemoteBookings {
    bookings: Mutex<Vec<RemoteBooking>>,
}

impl RemoteBookings {
    pub(super) fn add(&self, booking: RemoteBooking) {
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
