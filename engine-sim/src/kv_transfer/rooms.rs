//! SGLang's bootstrap rooms, kept by a prefill engine (`--disaggregation-mode prefill`).
//!
//! Both legs of a request name one `bootstrap_room`. In SGLang the prefill engine's request
//! waits in its bootstrap queue until the decode engine of the room has handshaked
//! (`KVPoll.WaitingForInput`), is then prefilled, and answers once its KV reached the decode
//! engine (`KVPoll.Success`); the decode engine's request waits until that KV arrived
//! (sgl-project/sglang `python/sglang/srt/disaggregation/prefill.py` at 000c2b94,
//! `PrefillBootstrapQueue.pop_bootstrapped` and `process_disagg_prefill_inflight_queue`;
//! `decode.py` at 0035ca42, `DecodePreallocQueue` and `DecodeTransferQueue`). A room here
//! walks the same phases: open → joined (the decode engine came) → prefilled (the KV is held
//! for it) → transferred (it has the KV), or failed when one side left early. Whichever leg
//! comes first opens the room; the other finds it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

/// What the prefill of a room leaves for its decode engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RoomKv {
    /// Blocks the prefill engine holds for the room.
    pub blocks: usize,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, found in the prefill engine's prefix cache (what SGLang's decode engine
    /// reports as its request's `cached_tokens`).
    pub cached_tokens: usize,
}

/// Where a room stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Opened by one leg; the other has not come.
    Open,
    /// The decode engine joined: the prefill may run.
    Joined,
    /// The prefill ran; its KV waits for the decode engine.
    Prefilled(RoomKv),
    /// The decode engine has the KV.
    Transferred,
    /// One side left before the end; why.
    Failed(String),
}

#[derive(Debug)]
struct Room {
    phase: watch::Sender<Phase>,
    /// A prefill leg is in the room.
    prefill: AtomicBool,
    /// A decode engine joined the room.
    decode: AtomicBool,
}

impl Room {
    /// Moves from a phase `from` accepts to `to`; whether it moved.
    fn advance(&self, from: impl Fn(&Phase) -> bool, to: Phase) -> bool {
        self.phase.send_if_modified(|phase| {
            let moves = from(phase);
            if moves {
                *phase = to;
            }
            moves
        })
    }

    /// Waits up to `timeout` for a phase `done` accepts; `None` on timeout.
    async fn wait(&self, timeout: Duration, done: impl Fn(&Phase) -> bool) -> Option<Phase> {
        let mut phase = self.phase.subscribe();
        let waited = tokio::time::timeout(timeout, phase.wait_for(|p| done(p))).await;
        // The sender lives in the room, which outlives this borrow: `wait_for` cannot fail.
        waited.ok().and_then(Result::ok).map(|p| p.clone())
    }
}

/// The rooms of one prefill engine.
#[derive(Debug, Default)]
pub(crate) struct Rooms {
    rooms: Mutex<HashMap<u64, Arc<Room>>>,
}

/// Why a decode engine's join failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum JoinError {
    /// Another decode engine is in the room.
    Taken,
    /// No KV within the deadline.
    TimedOut,
    /// The prefill leg ended without KV; why.
    Failed(String),
}

impl Rooms {
    /// The room `id`, opened when no leg is in it yet.
    fn open(&self, id: u64) -> Arc<Room> {
        let mut rooms = self.rooms.lock().unwrap_or_else(PoisonError::into_inner);
        Arc::clone(rooms.entry(id).or_insert_with(|| {
            Arc::new(Room {
                phase: watch::Sender::new(Phase::Open),
                prefill: AtomicBool::new(false),
                decode: AtomicBool::new(false),
            })
        }))
    }

    /// Forgets room `id` if it still is `room`.
    fn close(&self, id: u64, room: &Arc<Room>) {
        let mut rooms = self.rooms.lock().unwrap_or_else(PoisonError::into_inner);
        if rooms.get(&id).is_some_and(|open| Arc::ptr_eq(open, room)) {
            rooms.remove(&id);
        }
    }

    /// Rooms open now.
    #[cfg(test)]
    fn open_rooms(&self) -> usize {
        self.rooms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// A prefill leg enters room `id`; `None` when another prefill leg is in it. The room
    /// closes when the returned seat is dropped.
    pub(crate) fn enter_prefill(self: &Arc<Self>, id: u64) -> Option<PrefillSeat> {
        let room = self.open(id);
        if room.prefill.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(PrefillSeat {
            rooms: Arc::clone(self),
            id,
            room,
        })
    }

    /// A decode engine joins room `id` and waits up to `timeout` for its KV.
    pub(crate) async fn join(&self, id: u64, timeout: Duration) -> Result<RoomKv, JoinError> {
        let room = self.open(id);
        if room.decode.swap(true, Ordering::AcqRel) {
            return Err(JoinError::Taken);
        }
        let guard = JoinGuard {
            rooms: self,
            id,
            room: &room,
        };
        room.advance(|p| *p == Phase::Open, Phase::Joined);
        let waited = room
            .wait(timeout, |p| {
                matches!(p, Phase::Prefilled(_) | Phase::Failed(_))
            })
            .await;
        drop(guard);
        match waited {
            Some(Phase::Prefilled(kv)) => Ok(kv),
            Some(Phase::Failed(why)) => Err(JoinError::Failed(why)),
            _ => Err(JoinError::TimedOut),
        }
    }

    /// The decode engine of room `id` has its KV; whether the room's KV was waiting for it.
    pub(crate) fn transferred(&self, id: u64) -> bool {
        let room = self
            .rooms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&id)
            .cloned();
        room.is_some_and(|room| {
            room.advance(|p| matches!(p, Phase::Prefilled(_)), Phase::Transferred)
        })
    }
}

/// Ends a join: a decode engine that leaves without the KV fails the room (its prefill leg
/// then fails at once, as SGLang's decode engine notifies the prefill engine of an abort);
/// a room no prefill leg is in is forgotten.
struct JoinGuard<'a> {
    rooms: &'a Rooms,
    id: u64,
    room: &'a Arc<Room>,
}

impl Drop for JoinGuard<'_> {
    fn drop(&mut self) {
        self.room.advance(
            |p| matches!(p, Phase::Open | Phase::Joined),
            Phase::Failed("the decode engine left the room".to_owned()),
        );
        if !self.room.prefill.load(Ordering::Acquire) {
            self.rooms.close(self.id, self.room);
        }
    }
}

/// A prefill leg's place in its room; dropping it closes the room (and fails a decode
/// engine still waiting there).
#[derive(Debug)]
pub(crate) struct PrefillSeat {
    rooms: Arc<Rooms>,
    id: u64,
    room: Arc<Room>,
}

impl PrefillSeat {
    /// The room's number.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Waits up to `timeout` for the decode engine to join: `Err(None)` when none came,
    /// `Err(Some(why))` when it left again.
    pub(crate) async fn joined(&self, timeout: Duration) -> Result<(), Option<String>> {
        match self.room.wait(timeout, |p| *p != Phase::Open).await {
            None => Err(None),
            Some(Phase::Failed(why)) => Err(Some(why)),
            Some(_) => Ok(()),
        }
    }

    /// The prefill ran: `kv` waits for the decode engine.
    pub(crate) fn prefilled(&self, kv: RoomKv) {
        self.room
            .advance(|p| *p == Phase::Joined, Phase::Prefilled(kv));
    }

    /// Waits up to `timeout` for the decode engine to have the KV; why not, on failure.
    pub(crate) async fn transferred(&self, timeout: Duration) -> Result<(), String> {
        let done = self
            .room
            .wait(timeout, |p| {
                matches!(p, Phase::Transferred | Phase::Failed(_))
            })
            .await;
        match done {
            Some(Phase::Transferred) => Ok(()),
            Some(Phase::Failed(why)) => Err(why),
            _ => Err(format!(
                "the decode engine did not take the KV within {:.1}s",
                timeout.as_secs_f64()
            )),
        }
    }
}

impl Drop for PrefillSeat {
    fn drop(&mut self) {
        self.room.advance(
            |p| !matches!(p, Phase::Transferred | Phase::Failed(_)),
            Phase::Failed("the prefill leg ended before its KV was sent".to_owned()),
        );
        self.rooms.close(self.id, &self.room);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KV: RoomKv = RoomKv {
        blocks: 3,
        prompt_tokens: 40,
        cached_tokens: 16,
    };
    const LONG: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn the_prefill_first_then_the_decode_engine() {
        let rooms = Arc::new(Rooms::default());
        let seat = rooms.enter_prefill(7).expect("a free room");
        assert!(rooms.enter_prefill(7).is_none(), "one prefill leg per room");
        let decode = {
            let rooms = Arc::clone(&rooms);
            tokio::spawn(async move { rooms.join(7, LONG).await })
        };
        assert_eq!(seat.joined(LONG).await, Ok(()));
        seat.prefilled(KV);
        assert_eq!(decode.await.unwrap(), Ok(KV));
        assert!(rooms.transferred(7));
        assert!(!rooms.transferred(7), "once");
        assert_eq!(seat.transferred(LONG).await, Ok(()));
        drop(seat);
        assert_eq!(rooms.open_rooms(), 0);
    }

    #[tokio::test]
    async fn the_decode_engine_first_then_the_prefill() {
        let rooms = Arc::new(Rooms::default());
        let decode = {
            let rooms = Arc::clone(&rooms);
            tokio::spawn(async move { rooms.join(9, LONG).await })
        };
        // The join opened the room; the prefill leg finds it joined (or joins the wait).
        let seat = rooms.enter_prefill(9).expect("a free room");
        assert_eq!(seat.joined(LONG).await, Ok(()));
        seat.prefilled(KV);
        assert_eq!(decode.await.unwrap(), Ok(KV));
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_alone_times_out_and_closes_its_room() {
        let rooms = Arc::new(Rooms::default());
        let seat = rooms.enter_prefill(1).expect("a free room");
        assert_eq!(seat.joined(Duration::from_secs(30)).await, Err(None));
        drop(seat);
        assert_eq!(rooms.open_rooms(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_decode_engine_alone_times_out_and_closes_its_room() {
        let rooms = Arc::new(Rooms::default());
        assert_eq!(
            rooms.join(2, Duration::from_secs(30)).await,
            Err(JoinError::TimedOut)
        );
        assert_eq!(rooms.open_rooms(), 0);
    }

    #[tokio::test]
    async fn one_side_leaving_fails_the_other() {
        let rooms = Arc::new(Rooms::default());
        // The prefill leg ends (its client left) while the decode engine waits.
        let seat = rooms.enter_prefill(3).expect("a free room");
        let decode = {
            let rooms = Arc::clone(&rooms);
            tokio::spawn(async move { rooms.join(3, LONG).await })
        };
        assert_eq!(seat.joined(LONG).await, Ok(()));
        drop(seat);
        assert!(matches!(decode.await.unwrap(), Err(JoinError::Failed(_))));
        assert_eq!(rooms.open_rooms(), 0);

        // The decode engine gives up while the prefill runs: the prefill leg fails at once.
        let seat = rooms.enter_prefill(4).expect("a free room");
        let short = rooms.join(4, Duration::from_millis(1));
        assert_eq!(short.await, Err(JoinError::TimedOut));
        seat.prefilled(KV);
        assert!(seat.transferred(LONG).await.is_err());
        assert!(!rooms.transferred(4));
    }

    #[tokio::test]
    async fn a_second_decode_engine_is_refused() {
        let rooms = Arc::new(Rooms::default());
        let seat = rooms.enter_prefill(5).expect("a free room");
        let first = {
            let rooms = Arc::clone(&rooms);
            tokio::spawn(async move { rooms.join(5, LONG).await })
        };
        assert_eq!(seat.joined(LONG).await, Ok(()));
        assert_eq!(rooms.join(5, LONG).await, Err(JoinError::Taken));
        seat.prefilled(KV);
        assert_eq!(first.await.unwrap(), Ok(KV));
    }
}
