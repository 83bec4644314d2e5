//! The in-flight load other proxy replicas put on each instance, as they share it.
//!
//! Each replica's bookings are exact for its own requests but blind to the others'. So every
//! replica shares, a few times a second and whenever it changed, what it has in flight per
//! instance (prefill tokens, blocks, requests: [`SharedLoad`]), numbered; the others add it
//! to their own when scoring. It shares what it learned of each instance's speed too
//! ([`SharedSpeed`]), so that replicas predict the same times: each merges the others'
//! samples with its own. A share replaces that replica's previous one (an older number
//! is ignored), and lasts a TTL: a replica that dies stops sharing and its load disappears
//! when its last share expires. KV blocks need no sharing: every replica reads every
//! engine's KV events.
//!
//! Reads are lock-free (the per-instance totals are swapped in whole on every share).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use tokio::sync::Notify;

use crate::kv::token_cost::TokenCostSums;

/// One replica's in-flight load on one instance, and its learned speed of it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SharedLoad {
    /// Prompt tokens of its requests there still in prefill.
    pub prefill_tokens: u64,
    /// Blocks its requests there hold.
    pub blocks: u64,
    /// Its requests there.
    pub requests: u64,
    /// Its requests there still before their first byte.
    pub prefill_requests: u64,
    /// What its own first tokens taught it of the instance's speed.
    pub speed: SharedSpeed,
}

impl SharedLoad {
    fn add(&mut self, other: &SharedLoad) {
        self.prefill_tokens += other.prefill_tokens;
        self.blocks += other.blocks;
        self.requests += other.requests;
        self.prefill_requests += other.prefill_requests;
        self.speed = self.speed.merged(other.speed);
    }
}

/// A learned speed factor as replicas share it: the mean of its samples' logarithms, and how
/// many samples (0: nothing learned).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SharedSpeed {
    /// The factor's natural logarithm (above 0: slower than the cost model's profile).
    pub ln_factor: f64,
    /// The variance of its samples' logarithms around it (0: unknown or all alike).
    pub ln_variance: f64,
    /// The first tokens it was learned from.
    pub samples: u64,
}

impl SharedSpeed {
    /// Both together: the logarithms weighted by their samples.
    pub fn merged(self, other: SharedSpeed) -> SharedSpeed {
        let samples = self.samples + other.samples;
        if samples == 0 {
            return SharedSpeed::default();
        }
        let (n1, n2) = (self.samples as f64, other.samples as f64);
        let ln_factor = (self.ln_factor * n1 + other.ln_factor * n2) / samples as f64;
        // Pooled: each side's spread around its own mean plus that mean's distance from both's.
        let spread =
            |speed: &SharedSpeed| speed.ln_variance + (speed.ln_factor - ln_factor).powi(2);
        SharedSpeed {
            ln_factor,
            ln_variance: (n1 * spread(&self) + n2 * spread(&other)) / samples as f64,
            samples,
        }
    }
}

/// A proxy's own in-flight load on every instance, as it shares it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OwnLoads {
    /// How many times its load went down (a prefill ended, a request was released or
    /// expired) up to these loads: asks of the decider carry the count they saw, and the
    /// decider waits for a share that shows as many.
    pub eased: u64,
    /// Its load per instance.
    pub loads: HashMap<u64, SharedLoad>,
    /// What its own first tokens taught it of the model's token factor
    /// ([`crate::kv::token_cost`]).
    pub token_cost: TokenCostSums,
}

/// One share of another replica's in-flight load, as it arrived.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReplicaShare {
    /// The share's number, rising: an older one than the last taken is ignored.
    pub seq: u64,
    /// How long it counts.
    pub ttl: Duration,
    /// The replica's load and its easings up to it ([`OwnLoads`]).
    pub own: OwnLoads,
    /// Every ask of the decider up to this number is settled (booked in `own`, or given
    /// up).
    pub decided: u64,
}

/// The latest share of one replica.
#[derive(Debug)]
struct Share {
    seq: u64,
    until: Instant,
    own: OwnLoads,
}

/// The live shares summed up.
#[derive(Debug, Default)]
struct Totals {
    /// Per instance, the sum over the live shares.
    loads: HashMap<u64, SharedLoad>,
    /// Every speed sample of every live share, of every instance: the other replicas' view
    /// of the whole fleet's speed.
    fleet: SharedSpeed,
    /// Every live share's token-cost sums together.
    token_cost: TokenCostSums,
    /// The lowest id of a replica with a live share.
    lowest: Option<u64>,
    /// Replicas with a live share.
    live: u64,
}

/// Every other replica's shared load.
#[derive(Debug, Default)]
pub(crate) struct ReplicaLoads {
    shares: Mutex<HashMap<u64, Share>>,
    totals: ArcSwap<Totals>,
    /// Woken whenever a share is taken.
    taken: Notify,
}

impl ReplicaLoads {
    /// Replica `replica`'s `share`, arriving at `now`. Returns `None` when it is not taken
    /// (older than the last one), else the blocks the replica freed since its last live
    /// share, per instance (where it holds fewer now).
    pub(crate) fn apply(
        &self,
        replica: u64,
        share: ReplicaShare,
        now: Instant,
    ) -> Option<Vec<(u64, u64)>> {
        let mut shares = self.shares.lock().unwrap_or_else(PoisonError::into_inner);
        let last = shares.get(&replica);
        if last.is_some_and(|last| last.seq >= share.seq) {
            return None;
        }
        let freed = last
            .filter(|last| last.until > now)
            .map(|last| {
                last.own
                    .loads
                    .iter()
                    .filter_map(|(&instance, before)| {
                        let after = share.own.loads.get(&instance).map_or(0, |load| load.blocks);
                        (before.blocks > after).then(|| (instance, before.blocks - after))
                    })
                    .collect()
            })
            .unwrap_or_default();
        shares.insert(
            replica,
            Share {
                seq: share.seq,
                until: now + share.ttl,
                own: share.own,
            },
        );
        self.publish(&mut shares, now);
        drop(shares);
        self.taken.notify_waiters();
        Some(freed)
    }

    /// Whether the share of `replica` taken last shows at least `eased` easings of its load.
    pub(crate) fn shows(&self, replica: u64, eased: u64) -> bool {
        let shares = self.shares.lock().unwrap_or_else(PoisonError::into_inner);
        shares
            .get(&replica)
            .is_some_and(|share| share.own.eased >= eased)
    }

    /// Waits until a share of `replica` showing at least `eased` easings of its load is
    /// taken, or `wait` passed; returns whether one is.
    pub(crate) async fn caught_up(&self, replica: u64, eased: u64, wait: Duration) -> bool {
        let shown = || self.shows(replica, eased);
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let taken = self.taken.notified();
            tokio::pin!(taken);
            // Registered before the check, so a share taken after it wakes this wait.
            taken.as_mut().enable();
            if shown() {
                return true;
            }
            if tokio::time::timeout_at(deadline, taken).await.is_err() {
                return shown();
            }
        }
    }

    /// Drops the shares expired at `now` (their replicas stopped sharing).
    pub(crate) fn expire(&self, now: Instant) {
        let mut shares = self.shares.lock().unwrap_or_else(PoisonError::into_inner);
        if shares.values().any(|share| share.until <= now) {
            self.publish(&mut shares, now);
        }
    }

    /// Recomputes the totals from the live shares (dropping the expired ones).
    fn publish(&self, shares: &mut HashMap<u64, Share>, now: Instant) {
        shares.retain(|_, share| share.until > now);
        let mut totals = Totals {
            lowest: shares.keys().min().copied(),
            live: shares.len() as u64,
            ..Totals::default()
        };
        for share in shares.values() {
            if share.own.token_cost.is_valid() {
                totals.token_cost = totals.token_cost.merged(share.own.token_cost);
            }
            for (&instance, load) in &share.own.loads {
                totals.loads.entry(instance).or_default().add(load);
                totals.fleet = totals.fleet.merged(load.speed);
            }
        }
        self.totals.store(Arc::new(totals));
    }

    /// The other replicas' load on `instance`.
    pub(crate) fn on(&self, instance: u64) -> SharedLoad {
        self.totals
            .load()
            .loads
            .get(&instance)
            .copied()
            .unwrap_or_default()
    }

    /// The lowest id of the other replicas whose shares are live (`None`: none is).
    pub(crate) fn lowest(&self) -> Option<u64> {
        self.totals.load().lowest
    }

    /// How many other replicas' shares are live.
    pub(crate) fn live(&self) -> u64 {
        self.totals.load().live
    }

    /// The other replicas' speed samples of every instance together.
    pub(crate) fn fleet_speed(&self) -> SharedSpeed {
        self.totals.load().fleet
    }

    /// The other replicas' token-cost sums together.
    pub(crate) fn token_cost(&self) -> TokenCostSums {
        self.totals.load().token_cost
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(2);

    fn load(prefill_tokens: u64, blocks: u64, requests: u64) -> SharedLoad {
        SharedLoad {
            prefill_tokens,
            blocks,
            requests,
            prefill_requests: 0,
            speed: SharedSpeed::default(),
        }
    }

    fn share(seq: u64, loads: HashMap<u64, SharedLoad>) -> ReplicaShare {
        ReplicaShare {
            seq,
            ttl: TTL,
            own: OwnLoads {
                eased: 0,
                loads,
                ..OwnLoads::default()
            },
            decided: 0,
        }
    }

    #[test]
    fn the_live_shares_token_cost_sums_add_up_and_leave_when_they_expire() {
        let replicas = ReplicaLoads::default();
        let now = Instant::now();
        let sums = |weight: f64| TokenCostSums {
            weight,
            share: 0.2 * weight,
            ratio: 1.5 * weight,
            share_squared: 0.05 * weight,
            share_ratio: 0.4 * weight,
        };
        let with = |seq, token_cost, ttl| ReplicaShare {
            ttl,
            own: OwnLoads {
                token_cost,
                ..OwnLoads::default()
            },
            ..share(seq, HashMap::new())
        };
        replicas.apply(1, with(1, sums(10.0), TTL), now);
        replicas.apply(2, with(1, sums(30.0), 2 * TTL), now);
        // Nonsense from a replica counts as nothing learned.
        let broken = TokenCostSums {
            ratio: f64::NAN,
            ..sums(5.0)
        };
        replicas.apply(3, with(1, broken, TTL), now);
        assert_eq!(replicas.token_cost(), sums(10.0).merged(sums(30.0)));
        replicas.expire(now + TTL);
        assert_eq!(replicas.token_cost(), sums(30.0));
    }

    #[test]
    fn a_share_names_the_blocks_its_replica_freed_since_its_last_live_one() {
        let replicas = ReplicaLoads::default();
        let now = Instant::now();
        let two = HashMap::from([(7, load(50, 5, 2)), (8, load(1, 1, 1))]);
        assert_eq!(replicas.apply(2, share(1, two), now), Some(Vec::new()));
        let fewer = HashMap::from([(7, load(0, 2, 1)), (8, load(0, 3, 1))]);
        assert_eq!(
            replicas.apply(2, share(2, fewer), now),
            Some(vec![(7, 3)]),
            "3 fewer on 7; more on 8 frees nothing"
        );
        // After its last share expired, its next one frees nothing: the expired load no
        // longer counted anywhere.
        let later = now + TTL;
        assert_eq!(
            replicas.apply(2, share(3, HashMap::new()), later),
            Some(Vec::new())
        );
    }

    #[test]
    fn shares_add_up_replace_and_expire() {
        let replicas = ReplicaLoads::default();
        let now = Instant::now();
        let first = replicas.apply(1, share(1, HashMap::from([(7, load(100, 10, 1))])), now);
        assert_eq!(
            first,
            Some(Vec::new()),
            "nothing freed before a first share"
        );
        let two = HashMap::from([(7, load(50, 5, 2)), (8, load(1, 1, 1))]);
        assert!(replicas.apply(2, share(1, two), now).is_some());
        assert_eq!(replicas.on(7), load(150, 15, 3));
        assert_eq!(replicas.on(8), load(1, 1, 1));
        assert_eq!(replicas.on(9), SharedLoad::default());
        assert_eq!(replicas.lowest(), Some(1));
        // A newer share replaces the replica's last one; an older one is ignored.
        let later = now + Duration::from_secs(1);
        let freed = replicas.apply(1, share(3, HashMap::new()), later);
        assert_eq!(freed, Some(vec![(7, 10)]), "its 10 blocks on 7 were freed");
        let older = share(2, HashMap::from([(7, load(999, 9, 9))]));
        assert_eq!(replicas.apply(1, older, later), None);
        assert_eq!(replicas.on(7), load(50, 5, 2));
        // Speeds merge weighted by samples: 1 sample of factor e and 3 of factor 1.
        let slow = SharedLoad {
            speed: SharedSpeed {
                ln_factor: 1.0,
                samples: 1,
                ..SharedSpeed::default()
            },
            ..load(0, 0, 0)
        };
        let steady = SharedLoad {
            speed: SharedSpeed {
                ln_factor: 0.0,
                samples: 3,
                ..SharedSpeed::default()
            },
            ..load(0, 0, 0)
        };
        assert!(
            replicas
                .apply(3, share(1, HashMap::from([(8, slow)])), later)
                .is_some()
        );
        assert!(
            replicas
                .apply(4, share(1, HashMap::from([(8, steady)])), later)
                .is_some()
        );
        let merged = replicas.on(8).speed;
        assert_eq!(merged.samples, 4);
        assert!((merged.ln_factor - 0.25).abs() < 1e-12, "{merged:?}");
        // The fleet's speed: every instance's samples of every live share (instance 7's
        // shares carry none).
        assert_eq!(replicas.fleet_speed(), merged);
        // Replica 2 stops sharing (it died): its load goes when its share expires.
        assert_eq!(replicas.lowest(), Some(1));
        replicas.expire(now + TTL);
        assert_eq!(replicas.on(7), SharedLoad::default());
        assert_eq!(
            replicas.lowest(),
            Some(1),
            "replica 1's newer share lives on"
        );
        replicas.expire(later + TTL);
        assert_eq!(replicas.lowest(), None);
        assert_eq!(replicas.on(8).requests, 0);
    }

    #[tokio::test]
    async fn a_wait_for_a_share_ends_when_one_shows_the_easings_or_at_its_deadline() {
        let replicas = Arc::new(ReplicaLoads::default());
        let eased = |seq, eased| ReplicaShare {
            own: OwnLoads {
                eased,
                loads: HashMap::new(),
                ..OwnLoads::default()
            },
            ..share(seq, HashMap::new())
        };
        let long = Duration::from_secs(30);
        // Nothing from replica 1 yet: a short wait ends without it.
        assert!(!replicas.caught_up(1, 1, Duration::from_millis(5)).await);
        assert!(replicas.apply(1, eased(1, 2), Instant::now()).is_some());
        assert!(replicas.caught_up(1, 2, long).await, "shown already");
        // A wait for more ends at the share that shows them, not at an older one.
        let waiting = tokio::spawn({
            let replicas = Arc::clone(&replicas);
            async move { replicas.caught_up(1, 4, long).await }
        });
        tokio::task::yield_now().await;
        assert!(replicas.apply(1, eased(2, 3), Instant::now()).is_some());
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "3 easings are not 4");
        assert!(replicas.apply(1, eased(3, 4), Instant::now()).is_some());
        let done = tokio::time::timeout(long, waiting).await;
        assert!(done.expect("woken").expect("no panic"));
    }
}
