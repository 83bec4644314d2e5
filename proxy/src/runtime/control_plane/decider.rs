//! One model's link to its decider (docs/control-plane.md, "One decider per model"): the
//! router's asks go to the decider as NATS requests, and while this replica is the decider
//! it answers the other replicas' asks. Each side runs in its own task, so an ask never waits
//! behind the load shares and decisions the replica publishes.

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::Duration;

use bytes::Bytes;
use kvmesh_control::{
    DecideAnswer, DecideRequest, EventBus, HexU64, InstanceId, Namespace, Subscription,
};
use kvmesh_kv::{BlockHashes, LocalBlockHash, SequenceHash};
use kvmesh_route::kv::{DecideAsk, Steer};
use kvmesh_route::prepare::PromptBlocks;
use kvmesh_route::{Candidates, Excluded};
use tokio::sync::mpsc;

use crate::engines::clock::now_millis;
use crate::engines::pool::ModelPool;
use crate::runtime::control_plane::metrics::{ControlMetrics, Malformed};

/// How long an ask's background request waits for the decider: past `kv.decider_timeout`
/// (at most 1 s) the router has stopped waiting anyway.
const ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// A prompt's local hashes as the replica messages carry them.
pub(crate) fn hex_local(hashes: &BlockHashes) -> Vec<HexU64> {
    hashes.local.iter().map(|h| HexU64(h.0)).collect()
}

/// A prompt's sequence hashes as the replica messages carry them.
pub(crate) fn hex_sequence(hashes: &BlockHashes) -> Vec<HexU64> {
    hashes.sequence.iter().map(|h| HexU64(h.0)).collect()
}

/// A prompt's hashes from a replica message's `local` and `sequence` lists.
pub(crate) fn block_hashes(local: &[HexU64], sequence: &[HexU64]) -> BlockHashes {
    BlockHashes {
        local: local.iter().map(|h| LocalBlockHash(h.0)).collect(),
        sequence: sequence.iter().map(|h| SequenceHash(h.0)).collect(),
    }
}

/// What both sides of one model's decider link need.
#[derive(Clone)]
pub(crate) struct DecideLink {
    pub(crate) bus: Arc<dyn EventBus>,
    pub(crate) namespace: Namespace,
    /// This replica.
    pub(crate) replica: HexU64,
    pub(crate) model: String,
    pub(crate) metrics: ControlMetrics,
}

impl DecideLink {
    /// Starts sending the router's `asks`, and serving the other replicas' asks while `pool`
    /// lives and is not retired.
    pub(crate) async fn start(
        self,
        asks: mpsc::UnboundedReceiver<DecideAsk>,
        pool: Weak<ModelPool>,
    ) {
        let subject = self.namespace.decide_subject(self.replica.0, &self.model);
        match self.bus.serve(&subject).await {
            Ok(served) => {
                tokio::spawn(self.clone().serve(served, pool));
            }
            Err(error) => tracing::warn!(
                %error,
                model = %self.model,
                "cannot decide for the other replicas; they route alone while this one is their decider"
            ),
        }
        tokio::spawn(self.send_asks(asks));
    }

    /// Sends each ask as it comes, each in its own task, until the router is gone.
    async fn send_asks(self, mut asks: mpsc::UnboundedReceiver<DecideAsk>) {
        while let Some(ask) = asks.recv().await {
            tokio::spawn(self.clone().send(ask));
        }
    }

    /// Sends `ask` to the model's decider; its answer (or nothing, once the router stopped
    /// waiting) goes back through the ask.
    async fn send(self, ask: DecideAsk) {
        let request = DecideRequest {
            replica: self.replica,
            seq: ask.seq,
            eased: ask.eased,
            tokens: ask.prompt.tokens as u64,
            block_size: ask.prompt.block_size as u64,
            local: hex_local(&ask.prompt.hashes),
            sequence: hex_sequence(&ask.prompt.hashes),
            candidates: ask.candidates.iter().map(|&id| InstanceId(id)).collect(),
            session: ask.session.as_deref().map(str::to_owned),
            settings: HexU64(ask.settings),
        };
        let subject = self.namespace.decide_subject(ask.decider, &self.model);
        let payload = Bytes::from(request.to_json());
        let answer = match self.bus.request(&subject, payload, ASK_TIMEOUT).await {
            Ok(reply) => match DecideAnswer::from_json(&reply) {
                Ok(answer) => answer,
                Err(error) => {
                    self.metrics.malformed(Malformed::DecideAnswer);
                    tracing::debug!(%error, "malformed decider answer");
                    return;
                }
            },
            Err(error) => {
                tracing::debug!(%error, %subject, "the decider did not answer");
                return;
            }
        };
        let steer = answer.instance_id.map(|instance| Steer {
            instance: instance.0,
            dp_rank: answer.dp_rank,
            session_bound: answer.session_bound,
        });
        // The router may have stopped waiting.
        let _ = ask.answer.send(steer);
    }

    /// Answers the other replicas' asks, one at a time in arrival order, while `pool` lives
    /// and is not retired. Each waits first (a few ms at most) for the asker's load share
    /// that shows the load it shed before asking.
    async fn serve(self, mut served: Subscription, pool: Weak<ModelPool>) {
        while let Some(request) = served.next().await {
            let Some(pool) = pool.upgrade().filter(|pool| !pool.is_retired()) else {
                return;
            };
            let answer = match DecideRequest::from_json(&request.payload) {
                Ok(asked) => {
                    if let Some(router) = pool.balancer().kv_router() {
                        router.await_share(asked.replica.0, asked.eased).await;
                    }
                    self.decide(&pool, asked)
                }
                Err(error) => {
                    self.metrics.malformed(Malformed::DecideRequest);
                    tracing::debug!(%error, "malformed decide request");
                    DecideAnswer::default()
                }
            };
            drop(pool);
            let _ = self
                .bus
                .reply(&request, Bytes::from(answer.to_json()))
                .await;
        }
    }

    /// Decides another replica's request `asked` as the model's decider.
    fn decide(&self, pool: &ModelPool, asked: DecideRequest) -> DecideAnswer {
        let Some(router) = pool.balancer().kv_router() else {
            return DecideAnswer::default();
        };
        let instances = pool.instances();
        let allowed: HashSet<u64> = asked.candidates.iter().map(|id| id.0).collect();
        let excluded = Excluded::matching(&instances, |instance| !allowed.contains(&instance.id()));
        let candidates = Candidates::new(&instances, &excluded, now_millis());
        let prompt = Arc::new(PromptBlocks {
            tokens: usize::try_from(asked.tokens).unwrap_or(usize::MAX),
            hashes: block_hashes(&asked.local, &asked.sequence),
            block_size: usize::try_from(asked.block_size).unwrap_or(usize::MAX),
        });
        let session = asked.session.as_deref().map(Arc::from);
        let asker = (asked.replica.0, asked.seq, asked.settings.0);
        let steer = router.decide_for(&candidates, prompt, session, asker);
        DecideAnswer {
            instance_id: steer.map(|steer| InstanceId(steer.instance)),
            dp_rank: steer.and_then(|steer| steer.dp_rank),
            session_bound: steer.is_some_and(|steer| steer.session_bound),
        }
    }
}
