//! The pod's KV-transfer budget: decode legs (requests carrying a remote prefill's
//! `kv_transfer_params`) are admitted while the bytes their transfers move stay within
//! `max_in_flight_bytes` and a token bucket of `rate` bytes/s (bursting to
//! `max_in_flight_bytes`), smallest transfer first, except that one waiting longer than
//! `max_wait` goes next whatever its size, so none starves. A transfer holds its bytes until
//! the engine's first token (the KV has arrived), the request's end, or — with a
//! `hold_factor` — `hold_factor × bytes / rate` after its admission, when the link at the
//! paced rate must have moved it (the first token also waits for the engine's queue, which
//! is not the link's).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use prometheus::{Histogram, IntCounter, IntGauge};
use tokio::sync::Notify;
use tokio::time::Instant;

/// The budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PacerSettings {
    /// Bytes in transfer at once (a single larger transfer still goes, alone).
    pub max_in_flight_bytes: u64,
    /// Bytes per second the pod's link is given to transfers.
    pub rate_bytes_per_sec: f64,
    /// Longest a transfer waits before it goes next regardless of its size.
    pub max_wait: Duration,
    /// A transfer counts as done this many times `bytes / rate` after its admission, if
    /// the first token has not come back by then (0: only the first token ends it).
    pub hold_factor: f64,
}

impl PacerSettings {
    /// Bytes in flight at once when pacing is on and no budget is given (the agent paces
    /// only when asked: `--pace-max-inflight-bytes`).
    pub const DEFAULT_MAX_IN_FLIGHT_BYTES: u64 = 4 << 30;
    /// The age bound by default.
    pub const DEFAULT_MAX_WAIT: Duration = Duration::from_millis(250);
    /// The hold factor by default: a transfer is done once the link at the paced rate must
    /// have moved it, or at its first token if that comes sooner.
    pub const DEFAULT_HOLD_FACTOR: f64 = 1.0;

    /// The default budget over a link of `rate_bytes_per_sec`, for pacing that is on.
    pub fn with_rate(rate_bytes_per_sec: f64) -> Self {
        Self {
            max_in_flight_bytes: Self::DEFAULT_MAX_IN_FLIGHT_BYTES,
            rate_bytes_per_sec,
            max_wait: Self::DEFAULT_MAX_WAIT,
            hold_factor: Self::DEFAULT_HOLD_FACTOR,
        }
    }
}

/// The pacer's metric handles.
#[derive(Debug, Clone)]
pub struct PacerMetrics {
    /// Bytes of admitted transfers not yet done.
    pub in_flight_bytes: IntGauge,
    /// Transfers waiting.
    pub queued: IntGauge,
    /// Time from arrival to admission.
    pub wait_seconds: Histogram,
    /// Transfers admitted.
    pub admitted: IntCounter,
    /// The paced rate, bytes per second (given, measured on the GPU, or the default).
    pub rate_bytes_per_second: IntGauge,
}

#[derive(Debug)]
struct Waiting {
    bytes: u64,
    arrived: Instant,
}

/// An admitted transfer's bytes, held until it is done.
#[derive(Debug)]
struct Hold {
    bytes: u64,
    /// When it counts as done anyway (`None`: only its first token ends it).
    until: Option<Instant>,
}

#[derive(Debug)]
struct Budget {
    in_flight: u64,
    /// Admitted transfers not done, by permit number.
    holds: BTreeMap<u64, Hold>,
    next_hold: u64,
    tokens: f64,
    refilled: Instant,
    /// Waiting transfers by arrival number.
    queue: BTreeMap<u64, Waiting>,
    next_ticket: u64,
}

/// Admits transfers within the budget.
#[derive(Debug)]
pub struct Pacer {
    settings: PacerSettings,
    budget: Mutex<Budget>,
    changed: Notify,
    metrics: PacerMetrics,
}

/// A transfer's share of the budget, given back when dropped (or [`Permit::done`]).
#[derive(Debug)]
pub struct Permit {
    pacer: Arc<Pacer>,
    hold: u64,
}

impl Permit {
    /// The transfer is done (the first token came back): its bytes go back to the budget.
    pub fn done(self) {}
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.pacer.release(self.hold);
    }
}

impl Pacer {
    /// A pacer with `settings`, its bucket full.
    pub fn new(settings: PacerSettings, metrics: PacerMetrics) -> Self {
        metrics
            .rate_bytes_per_second
            .set(settings.rate_bytes_per_sec as i64);
        Self {
            settings,
            budget: Mutex::new(Budget {
                in_flight: 0,
                holds: BTreeMap::new(),
                next_hold: 0,
                tokens: settings.max_in_flight_bytes as f64,
                refilled: Instant::now(),
                queue: BTreeMap::new(),
                next_ticket: 0,
            }),
            changed: Notify::new(),
            metrics,
        }
    }

    /// Waits until a transfer of `bytes` fits the budget, then holds it. Dropping the
    /// future while it waits gives its place up.
    pub async fn admit(self: &Arc<Self>, bytes: u64) -> Permit {
        let arrived = Instant::now();
        let ticket = {
            let mut budget = self.lock();
            let ticket = budget.next_ticket;
            budget.next_ticket += 1;
            budget.queue.insert(ticket, Waiting { bytes, arrived });
            ticket
        };
        let mut place = InLine {
            pacer: self.as_ref(),
            ticket,
            admitted: false,
        };
        self.metrics.queued.inc();
        let hold = loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match self.try_admit(ticket, Instant::now()) {
                Ok(hold) => break hold,
                Err(Some(wait)) => {
                    tokio::select! {
                        () = &mut notified => {}
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                Err(None) => notified.await,
            }
        };
        place.admitted = true;
        self.metrics.admitted.inc();
        self.metrics
            .wait_seconds
            .observe(arrived.elapsed().as_secs_f64());
        // Another may fit behind it (the next in line changed).
        self.changed.notify_waiters();
        Permit {
            pacer: Arc::clone(self),
            hold,
        }
    }

    /// Admits `ticket` if it is next in line and fits (its hold's number); else how long
    /// until the bucket could hold it or a hold ends (`None`: wait for a release or an
    /// arrival).
    fn try_admit(&self, ticket: u64, now: Instant) -> Result<u64, Option<Duration>> {
        let mut budget = self.lock();
        let ended: Vec<u64> = budget
            .holds
            .iter()
            .filter(|(_, hold)| hold.until.is_some_and(|until| until <= now))
            .map(|(&number, _)| number)
            .collect();
        if !ended.is_empty() {
            for number in ended {
                self.end_hold(&mut budget, number);
            }
            // Room freed without a release: the others look again.
            self.changed.notify_waiters();
        }
        let rate = self.settings.rate_bytes_per_sec;
        let full = self.settings.max_in_flight_bytes as f64;
        let refill = now.saturating_duration_since(budget.refilled).as_secs_f64() * rate;
        budget.tokens = (budget.tokens + refill).min(full);
        budget.refilled = now;
        if next_in_line(&budget.queue, now, self.settings.max_wait) != Some(ticket) {
            // Once it has waited `max_wait` it may be next by age: nothing else tells it.
            let aged = budget.queue[&ticket].arrived + self.settings.max_wait;
            return Err((aged > now).then(|| aged - now));
        }
        let bytes = budget.queue[&ticket].bytes;
        let fits_flight = budget.in_flight == 0
            || budget.in_flight.saturating_add(bytes) <= self.settings.max_in_flight_bytes;
        if !fits_flight {
            let next_end = budget.holds.values().filter_map(|hold| hold.until).min();
            return Err(next_end.map(|until| until.saturating_duration_since(now)));
        }
        // A transfer larger than the bucket goes once the bucket is full, and leaves it in
        // debt.
        let needed = (bytes as f64).min(full);
        if budget.tokens < needed {
            let missing = needed - budget.tokens;
            return Err(Some(Duration::from_secs_f64(missing / rate.max(1.0))));
        }
        budget.tokens -= bytes as f64;
        budget.in_flight += bytes;
        budget.queue.remove(&ticket);
        let factor = self.settings.hold_factor;
        let until = (factor > 0.0)
            .then(|| now + Duration::from_secs_f64(factor * bytes as f64 / rate.max(1.0)));
        let number = budget.next_hold;
        budget.next_hold += 1;
        budget.holds.insert(number, Hold { bytes, until });
        self.metrics.in_flight_bytes.add(bytes as i64);
        Ok(number)
    }

    /// Gives hold `number`'s bytes back, unless it already ended.
    fn release(&self, number: u64) {
        let ended = {
            let mut budget = self.lock();
            self.end_hold(&mut budget, number)
        };
        if ended {
            self.changed.notify_waiters();
        }
    }

    /// Ends hold `number` in `budget` (false: it had ended).
    fn end_hold(&self, budget: &mut Budget, number: u64) -> bool {
        let Some(hold) = budget.holds.remove(&number) else {
            return false;
        };
        budget.in_flight = budget.in_flight.saturating_sub(hold.bytes);
        self.metrics.in_flight_bytes.sub(hold.bytes as i64);
        true
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Budget> {
        self.budget.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The ticket that goes next: the oldest one once it has waited `max_wait`, else the
/// smallest (the earliest of equal sizes).
/// A transfer's place in line while it waits.
struct InLine<'a> {
    pacer: &'a Pacer,
    ticket: u64,
    admitted: bool,
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        self.pacer.metrics.queued.dec();
        if !self.admitted {
            self.pacer.lock().queue.remove(&self.ticket);
            self.pacer.changed.notify_waiters();
        }
    }
}

fn next_in_line(queue: &BTreeMap<u64, Waiting>, now: Instant, max_wait: Duration) -> Option<u64> {
    let (&oldest, first) = queue.iter().next()?;
    if now.saturating_duration_since(first.arrived) >= max_wait {
        return Some(oldest);
    }
    queue
        .iter()
        .min_by_key(|(ticket, waiting)| (waiting.bytes, **ticket))
        .map(|(&ticket, _)| ticket)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use prometheus::{HistogramOpts, Opts};

    use super::*;

    fn pacer(max_in_flight_bytes: u64, rate_bytes_per_sec: f64, max_wait: Duration) -> Arc<Pacer> {
        paced(PacerSettings {
            max_in_flight_bytes,
            rate_bytes_per_sec,
            max_wait,
            hold_factor: 0.0,
        })
    }

    fn paced(settings: PacerSettings) -> Arc<Pacer> {
        let metrics = PacerMetrics {
            in_flight_bytes: IntGauge::new("in_flight", "h").unwrap(),
            queued: IntGauge::new("queued", "h").unwrap(),
            wait_seconds: Histogram::with_opts(HistogramOpts::new("wait", "h")).unwrap(),
            admitted: IntCounter::with_opts(Opts::new("admitted", "h")).unwrap(),
            rate_bytes_per_second: IntGauge::new("rate", "h").unwrap(),
        };
        Arc::new(Pacer::new(settings, metrics))
    }

    /// Returns once `n` transfers wait in line (the spawned ones got there).
    async fn queued(pacer: &Pacer, n: i64) {
        while pacer.metrics.queued.get() < n {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_burst_never_exceeds_the_bytes_in_flight() {
        let pacer = pacer(1_000, 1e12, Duration::from_secs(10));
        let held = Arc::new(AtomicU64::new(0));
        let most = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for i in 0..50u64 {
            let (pacer, held, most) = (pacer.clone(), held.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                let bytes = 100 + (i * 37) % 400;
                let permit = pacer.admit(bytes).await;
                let now = held.fetch_add(bytes, Ordering::SeqCst) + bytes;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(1 + i % 7)).await;
                held.fetch_sub(bytes, Ordering::SeqCst);
                permit.done();
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert!(most.load(Ordering::SeqCst) <= 1_000, "{most:?}");
        assert_eq!(pacer.metrics.admitted.get(), 50);
        assert_eq!(
            (
                pacer.metrics.queued.get(),
                pacer.metrics.in_flight_bytes.get()
            ),
            (0, 0)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_small_transfer_is_not_stuck_behind_a_large_one() {
        let pacer = pacer(100, 1e12, Duration::from_secs(10));
        let first = pacer.admit(90).await;
        let large = tokio::spawn({
            let pacer = pacer.clone();
            async move {
                pacer.admit(80).await.done();
                Instant::now()
            }
        });
        queued(&pacer, 1).await;
        // 90 + 5 fits; 90 + 80 does not: the small one goes first although it came later.
        let small = tokio::time::timeout(Duration::from_millis(1), pacer.admit(5)).await;
        assert!(
            small.is_ok(),
            "the small transfer waited behind the large one"
        );
        drop(small);
        tokio::time::sleep(Duration::from_millis(20)).await;
        let released = Instant::now();
        first.done();
        assert!(
            large.await.unwrap() >= released,
            "the large one went before there was room"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_transfer_waiting_past_the_age_bound_goes_next() {
        let pacer = pacer(100, 1e12, Duration::from_millis(50));
        let first = pacer.admit(90).await;
        let large = tokio::spawn({
            let pacer = pacer.clone();
            async move { pacer.admit(80).await.done() }
        });
        queued(&pacer, 1).await;
        tokio::time::sleep(Duration::from_millis(60)).await;
        // The large one has waited past the bound: it is next, and the small one waits too.
        let small = tokio::time::timeout(Duration::from_millis(10), pacer.admit(5)).await;
        assert!(
            small.is_err(),
            "the small one jumped a transfer past its age bound"
        );
        first.done();
        large.await.unwrap();
        let small = tokio::time::timeout(Duration::from_millis(1), pacer.admit(5)).await;
        assert!(small.is_ok());
    }

    #[tokio::test(start_paused = true)]
    async fn the_rate_spaces_transfers_out_once_the_bucket_is_spent() {
        let pacer = pacer(1_000, 10_000.0, Duration::from_secs(10));
        let start = Instant::now();
        pacer.admit(1_000).await.done();
        assert!(
            start.elapsed() < Duration::from_millis(1),
            "a full bucket admits at once"
        );
        pacer.admit(500).await.done();
        let waited = start.elapsed();
        // 500 bytes at 10,000 B/s: 50 ms.
        assert!(
            waited >= Duration::from_millis(49) && waited < Duration::from_millis(60),
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_transfer_counts_as_done_once_the_paced_link_must_have_moved_it() {
        let pacer = paced(PacerSettings {
            max_in_flight_bytes: 100,
            rate_bytes_per_sec: 1_000.0,
            max_wait: Duration::from_secs(10),
            hold_factor: 1.0,
        });
        let start = Instant::now();
        // 100 bytes at 1,000 B/s: on the link for 100 ms; its first token never comes.
        let first = pacer.admit(100).await;
        let second = pacer.admit(50).await;
        let waited = start.elapsed();
        assert!(
            waited >= Duration::from_millis(100) && waited < Duration::from_millis(110),
            "{waited:?}"
        );
        assert_eq!(pacer.metrics.in_flight_bytes.get(), 50);
        // Its permit ending later gives nothing back twice.
        first.done();
        assert_eq!(pacer.metrics.in_flight_bytes.get(), 50);
        second.done();
        assert_eq!(pacer.metrics.in_flight_bytes.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_turns_next_by_age_while_room_frees_silently_is_admitted() {
        // Nobody gives a permit back: only the link bound frees room.
        let pacer = paced(PacerSettings {
            max_in_flight_bytes: 100,
            rate_bytes_per_sec: 10_000.0,
            max_wait: Duration::from_millis(5),
            hold_factor: 1.0,
        });
        // 100 bytes at 10,000 B/s: the first transfer holds the budget for 10 ms.
        let first = pacer.admit(100).await;
        let old = tokio::spawn({
            let pacer = pacer.clone();
            async move { pacer.admit(90).await }
        });
        queued(&pacer, 1).await;
        let small = tokio::spawn({
            let pacer = pacer.clone();
            async move { pacer.admit(5).await }
        });
        queued(&pacer, 2).await;
        // One that comes and goes makes the others look again while the small one is next:
        // the old one then waits behind it, and only its age makes it next (at 5 ms).
        let gone = tokio::time::timeout(Duration::from_millis(1), pacer.admit(1)).await;
        assert!(gone.is_err());
        let both = async { (old.await.unwrap(), small.await.unwrap()) };
        let admitted = tokio::time::timeout(Duration::from_secs(1), both)
            .await
            .expect("a waiter was never woken");
        drop((first, admitted));
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_that_leaves_gives_its_place_up() {
        // An age bound of 1 ms: a waiter left in line would soon block every other one.
        let pacer = pacer(100, 1e12, Duration::from_millis(1));
        let first = pacer.admit(60).await;
        let gone = tokio::time::timeout(Duration::from_millis(5), pacer.admit(50)).await;
        assert!(gone.is_err());
        assert_eq!(pacer.metrics.queued.get(), 0);
        // A larger one behind it is not blocked by the one that left.
        let next = tokio::time::timeout(Duration::from_millis(5), pacer.admit(40)).await;
        assert!(next.is_ok());
        drop((first, next));
        assert_eq!(pacer.metrics.in_flight_bytes.get(), 0);
    }
}
