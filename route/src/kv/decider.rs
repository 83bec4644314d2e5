//! One decider per model across proxy replicas (docs/control-plane.md, "NATS: replicas").
//!
//! Replicas that each route part of a burst at the same moment all see the same cheapest
//! instances and pile onto them: none sees another's choice until it is shared, a
//! millisecond or more later. So the live replica with the lowest id (live: its load shares
//! arrive) decides for every replica of a model. The others prepare a request as before
//! (tokenize, hash, look up), ask it, and book its answer themselves ([`KvRouter::ask_decider`]);
//! the decider runs the same choice over its own view, books the request itself until the
//! asker's load share shows it settled ([`KvRouter::decide_for`]), and so routes the burst in
//! one order, as one proxy would. Before deciding, it waits a few milliseconds at most for the
//! asker's share showing the load the asker shed before asking ([`KvRouter::await_share`]),
//! which travels beside the ask, not in line with it. A replica whose own choice would stand
//! against an unseen request like it from every other replica does not ask
//! ([`KvRouter::decisive`]): the decider would choose the same. An asker that gets no answer within
//! `kv.decider_timeout` routes alone and asks nobody for [`crate::kv::QUIET_AFTER_TIMEOUT`];
//! a replica that knows of no lower live replica routes alone.
//!
//! The router knows nothing of NATS: asks go out through the channel
//! [`KvRouter::serve_asks`] returns, and the proxy's control plane carries them.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use crate::candidates::CandidateSet;
use crate::kv::asks::{DecideAsk, REMOTE_BOOKING_TTL, RemoteBooking, SHARE_WAIT, Steer};
use crate::kv::decision::{Choice, Decision, KvRequest};
use crate::kv::router::KvRouter;
use crate::metrics::{AskOutcome, RouteStage};
use crate::prepare::{PromptBlocks, RouteInput};

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

    /// Asks the model's decider to route `request` to one of the eligible `candidates`.
    /// `None`: route it here alone (this replica decides, no prompt, no answer in time, or
    /// this replica's own choice is decisive: [`Self::decisive`]).
    pub async fn ask_decider<S: CandidateSet + Sync + ?Sized>(
        &self,
        candidates: &S,
        request: &KvRequest,
    ) -> Option<Steer> {
        let asks = self.asks();
        let (replica, outbox) = asks.outbox.get()?;
        let replicas = self.replica_loads();
        let decider = replicas.lowest().filter(|&id| id < *replica)?;
        let RouteInput::Tokens(prompt) = &request.input else {
            return None;
        };
        if asks.is_quiet(Instant::now()) {
            self.metrics().count_ask(AskOutcome::Skipped);
            return None;
        }
        if self.decisive(candidates, request, replicas.live()) {
            self.metrics().count_ask(AskOutcome::Decisive);
            return None;
        }
        let candidates = (0..candidates.len())
            .filter(|&index| candidates.is_eligible(index))
            .map(|index| candidates.id(index))
            .collect();
        let (answer, answered) = oneshot::channel();
        let seq = asks.open();
        let ask = DecideAsk {
            decider,
            seq,
            eased: self.own_eased(),
            prompt: Arc::clone(prompt),
            candidates,
            session: request.session.clone(),
            settings: self.settings(),
            answer,
        };
        let sent = Instant::now();
        let outcome = match outbox.send(ask) {
            Err(_) => Err(AskOutcome::Unavailable),
            Ok(()) => {
                let answer = tokio::time::timeout(self.decider_timeout(), answered).await;
                self.metrics()
                    .observe_stage(RouteStage::Ask, sent.elapsed());
                match answer {
                    Ok(Ok(Some(steer))) => Ok(steer),
                    Ok(Ok(None)) => Err(AskOutcome::Declined),
                    Ok(Err(_)) => Err(AskOutcome::Unavailable),
                    Err(_) => {
                        asks.quiet(Instant::now());
                        Err(AskOutcome::Timeout)
                    }
                }
            }
        };
        // Settled before it is booked: the booking's own load share follows at once.
        asks.settle(seq);
        self.metrics()
            .count_ask(outcome.err().unwrap_or(AskOutcome::Chosen));
        outcome.ok()
    }

    /// Before deciding replica `replica`'s ask, which saw its load go down `eased` times:
    /// waits until a load share of it showing as many is taken, at most [`SHARE_WAIT`] (and
    /// a quarter of `kv.decider_timeout`). Otherwise a conversation's next turn, asked the
    /// moment the last answer ended, would find that answer still counted on the instance
    /// holding its blocks, and go elsewhere. Returns whether the share was shown.
    pub async fn await_share(&self, replica: u64, eased: u64) -> bool {
        let replicas = self.replica_loads();
        if replicas.shows(replica, eased) {
            return true;
        }
        let wait = SHARE_WAIT.min(self.decider_timeout() / 4);
        let shown = replicas.caught_up(replica, eased, wait).await;
        self.metrics().count_share_wait(shown);
        shown
    }

    /// Routes replica `replica`'s request number `seq` as this model's decider: chooses among
    /// `candidates` for `prompt` (in `session`), records the prediction, and books it here
    /// until `replica`'s load share settles it ([`Self::settle_remote`]) or
    /// [`REMOTE_BOOKING_TTL`] passes. `None`: no instance could be chosen, or the asker's
    /// `kv` settings (their fingerprint, `settings`) are not this replica's.
    pub fn decide_for<S: CandidateSet + ?Sized>(
        &self,
        candidates: &S,
        prompt: Arc<PromptBlocks>,
        session: Option<Arc<str>>,
        (replica, seq, settings): (u64, u64, u64),
    ) -> Option<Steer> {
        if settings != self.settings() {
            tracing::debug!(
                replica,
                "a replica with other kv settings asked this one to decide: it routes alone"
            );
            return None;
        }
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
        session_bound: decision.affinity,
    }
}
