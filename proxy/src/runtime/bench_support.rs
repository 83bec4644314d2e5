//! The `policy: kv` routing decision without a network, for the proxy's benchmarks
//! (`benches/route.rs`); the relay's per-piece work in [`relay`]. Not a stable API.

pub mod relay;

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvmesh_config::{BackendUrl, KvRoutingConfig, Protocol, Role};
use kvmesh_route::kv::{Choice, KvRouter};
use kvmesh_route::prepare::RouteInput;
use kvmesh_route::{Candidates, Excluded};

use crate::edge::error::ProxyError;
use crate::engines::instance::{Instance, PeerSettings};
use crate::metrics::families::Metrics;
use crate::openai::route::Route;

/// Time spent in each stage of one routing decision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StageSplit {
    /// Prompt tokens of the request (0 when it had none).
    pub prompt_tokens: usize,
    /// Parsing the body (chat: and rendering its template).
    pub template: Duration,
    /// Tokenizing the prompt.
    pub tokenize: Duration,
    /// Hashing its blocks.
    pub hash: Duration,
    /// Looking the blocks up in the index.
    pub lookup: Duration,
    /// Reading loads, costing, selecting.
    pub score: Duration,
    /// Booking the load and recording the prediction.
    pub commit: Duration,
}

impl StageSplit {
    /// The whole decision.
    pub fn total(&self) -> Duration {
        self.template + self.tokenize + self.hash + self.lookup + self.score + self.commit
    }
}

/// A `policy: kv` router over fake instances (`http://127.0.0.1:1`…), never contacted.
#[derive(Debug)]
pub struct RouteBench {
    router: KvRouter,
    instances: Vec<Arc<Instance>>,
}

impl RouteBench {
    /// A router with `config` over `instances` instances; `tokenizer` is a model directory
    /// (loaded with the proxy's segment cache).
    pub fn new(
        config: &KvRoutingConfig,
        tokenizer: Option<&Path>,
        instances: usize,
    ) -> Result<Self, ProxyError> {
        let metrics = Metrics::new()?;
        let settings = PeerSettings {
            connect_timeout: Duration::from_secs(1),
        };
        let instances: Vec<Arc<Instance>> = (0..instances)
            .map(|i| {
                let port = u16::try_from(i + 1).unwrap_or(u16::MAX);
                let address = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port));
                let url = BackendUrl::parse(&format!("http://{address}")).map_err(|error| {
                    ProxyError::KvSettings {
                        model: "bench".to_string(),
                        reason: error.to_string(),
                    }
                })?;
                let handles = metrics.instance("bench", url.as_str());
                Ok(Arc::new(Instance::new(
                    i as u64,
                    url,
                    address,
                    Protocol::Http1,
                    settings,
                    handles,
                    Role::Both,
                )))
            })
            .collect::<Result<_, ProxyError>>()?;
        let tokenizer = tokenizer
            .map(crate::engines::pool_builder::load_tokenizer)
            .transpose()
            .map_err(|reason| ProxyError::Tokenizer {
                model: "bench".to_string(),
                dir: tokenizer
                    .map(|d| d.display().to_string())
                    .unwrap_or_default(),
                reason,
            })?;
        let router = KvRouter::new(config, tokenizer, false, false, metrics.kv("bench")).map_err(
            |error| ProxyError::KvSettings {
                model: "bench".to_string(),
                reason: error.to_string(),
            },
        )?;
        for instance in &instances {
            router.add_instance(instance.id());
        }
        Ok(Self { router, instances })
    }

    /// Routes a chat-completions body the way the request path does — template, tokenize,
    /// hash, lookup, score, then book and record (the booking ends at once) — and returns the
    /// chosen instance with the time of each stage.
    pub fn route_chat(&self, body: &Bytes) -> (Option<usize>, StageSplit) {
        self.route(Route::ChatCompletions, body)
    }

    /// [`RouteBench::route_chat`] for a completions body.
    pub fn route_completion(&self, body: &Bytes) -> (Option<usize>, StageSplit) {
        self.route(Route::Completions, body)
    }

    fn route(&self, route: Route, body: &Bytes) -> (Option<usize>, StageSplit) {
        let Ok(prepared) = self
            .router
            .preparer()
            .prepare(route.prompt_kind(), body, true)
        else {
            return (None, StageSplit::default());
        };
        let times = prepared.times;
        let prompt_tokens = match &prepared.input {
            RouteInput::Tokens(prompt) => prompt.tokens,
            RouteInput::Fallback(_) => 0,
        };
        let mut split = StageSplit {
            prompt_tokens,
            template: times.template.unwrap_or_default(),
            tokenize: times.tokenize.unwrap_or_default(),
            hash: times.hash.unwrap_or_default(),
            ..StageSplit::default()
        };
        let start = Instant::now();
        let request = self.router.lookup(&prepared, start);
        split.lookup = start.elapsed();
        let start = Instant::now();
        let excluded = Excluded::default();
        let choice = self.router.choose(
            &Candidates::new(&self.instances, &excluded, 0),
            &request,
            &mut rand::thread_rng(),
        );
        split.score = start.elapsed();
        let Choice::Picked(decision) = choice else {
            return (None, split);
        };
        let start = Instant::now();
        drop(self.router.commit(&decision, &request, start));
        split.commit = start.elapsed();
        (Some(decision.index), split)
    }
}
