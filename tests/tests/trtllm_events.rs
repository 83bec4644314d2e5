//! TensorRT-LLM's KV cache events end to end (issue 32): `etcd`, `nats-server`, the real
//! `kvmesh-agent --engine-kind trtllm` and `kvmesh-proxy` with `policy: kv`, beside a fake
//! trtllm-serve in this test: a small HTTP server that answers each `POST /kv_cache_events`
//! with the next answer of `tests/fixtures/trtllm/` (bodies TensorRT-LLM's own serializer
//! wrote; its README says how) and `[]` once they are used up, and serves `/health`,
//! `/v1/models` and `/prometheus/metrics` (trtllm-serve's gauge names) for the agent.
//!
//! The fixtures go out in the order their engines produced them, a group at a time; after each
//! group the proxy's index must hold exactly the blocks the events leave stored
//! (`kvmesh_index_blocks`, and `POST /debug/route` naming which prompts it holds):
//! an engine's lifetime (partial blocks dropped, an eviction, a block stored again), its
//! restart (`event_id` back to 0), an engine whose full queue dropped events (the gap: the
//! proxy marks the instance's events incomplete, `kvmesh_route_kv_events_incomplete`, as the
//! agent's load reports say, and scores it by its predictions alone: `/debug/route` reports
//! none of the blocks its index holds), a restart with two attention windows (only the
//! largest followed; the view whole again, the index used again), and two attention-DP
//! ranks.
//!
//! Readiness comes from `LISTENING`/`READY` lines and from metrics and `/debug/route` polled
//! against a deadline.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use kvmesh_e2e::cluster::{MODEL, start_proxy};
use kvmesh_e2e::control_plane::{Servers, await_metric, metric};
use kvmesh_e2e::{HttpClient, ScratchDir, Spawned};
use tokio::net::TcpListener;

/// TensorRT-LLM's `tokens_per_block` in every fixture.
const BLOCK_SIZE: usize = 32;
/// Deadline for state the proxy reaches through the control plane.
const CONVERGE: Duration = Duration::from_secs(15);

/// The fake trtllm-serve's state: the answers not polled yet, oldest first.
#[derive(Default)]
struct Queue(Mutex<VecDeque<Bytes>>);

impl Queue {
    fn push(&self, body: Bytes) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(body);
    }

    fn pop(&self) -> Option<Bytes> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).pop_front()
    }

    fn is_empty(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).is_empty()
    }
}

/// trtllm-serve's Prometheus gauges (`/prometheus/metrics`, names from its `MetricsCollector`).
const METRICS: &str = "# TYPE trtllm_num_requests_running gauge\n\
    trtllm_num_requests_running{engine_type=\"undefined\",model_name=\"undefined\"} 0.0\n\
    # TYPE trtllm_num_requests_waiting gauge\n\
    trtllm_num_requests_waiting{engine_type=\"undefined\",model_name=\"undefined\"} 0.0\n\
    # TYPE trtllm_kv_cache_utilization gauge\n\
    trtllm_kv_cache_utilization{engine_type=\"undefined\",model_name=\"undefined\"} 0.01\n\
    # TYPE trtllm_kv_cache_tokens_per_block gauge\n\
    trtllm_kv_cache_tokens_per_block{engine_type=\"undefined\",model_name=\"undefined\"} 32.0\n\
    # TYPE trtllm_kv_cache_max_blocks gauge\n\
    trtllm_kv_cache_max_blocks{engine_type=\"undefined\",model_name=\"undefined\"} 2048.0\n";

fn answer(queue: &Queue, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let (status, body): (StatusCode, Bytes) = match (req.method(), req.uri().path()) {
        (&Method::POST, "/kv_cache_events") => (
            StatusCode::OK,
            queue.pop().unwrap_or_else(|| Bytes::from_static(b"[]")),
        ),
        (&Method::GET, "/health") => (StatusCode::OK, Bytes::new()),
        (&Method::GET, "/v1/models") => (
            StatusCode::OK,
            Bytes::from(
                serde_json::json!({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "tensorrt_llm"}]})
                    .to_string(),
            ),
        ),
        (&Method::GET, "/prometheus/metrics") => (StatusCode::OK, Bytes::from_static(METRICS.as_bytes())),
        _ => (StatusCode::NOT_FOUND, Bytes::from_static(b"{\"detail\":\"Not Found\"}")),
    };
    let mut response = Response::new(Full::new(body));
    *response.status_mut() = status;
    response
}

/// Starts the fake trtllm-serve on a free loopback port.
async fn fake_trtllm(queue: Arc<Queue>) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let queue = queue.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let response = answer(&queue, &req);
                    async move { Ok::<_, Infallible>(response) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

fn fixture(name: &str) -> anyhow::Result<Bytes> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/trtllm")
        .join(name);
    Ok(Bytes::from(
        std::fs::read(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?,
    ))
}

/// The proxy config: [`MODEL`] with `policy: kv` over etcd's instances and NATS's events, in
/// TensorRT-LLM's 32-token blocks.
fn proxy_config(servers: &Servers) -> String {
    format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\n\
         models:\n  - name: {MODEL}\n    policy: kv\n    kv:\n      block_size: {BLOCK_SIZE}\n    backends: []\n\
         discovery:\n  kind: etcd\n  endpoint: {}\n  initial_sync_timeout: 5s\n\
         events:\n  kind: nats\n  url: {}\n  resync_timeout: 1s\n",
        servers.etcd.url(),
        servers.nats.url()
    )
}

/// Token ids `first..first + 32` of each block in `firsts`, and one more token (a partial
/// block, not counted): a prompt whose cached prefix is those blocks.
fn prompt(firsts: &[u32]) -> Vec<u32> {
    let mut tokens: Vec<u32> = firsts
        .iter()
        .flat_map(|&first| first..first + BLOCK_SIZE as u32)
        .collect();
    tokens.push(1);
    tokens
}

struct Cluster {
    client: HttpClient,
    proxy: Spawned,
    agent: Spawned,
    queue: Arc<Queue>,
    engine: String,
}

impl Cluster {
    /// Hands the fixtures `names` to the fake engine, waits until the agent polled them all,
    /// then until the proxy's index holds `blocks` blocks of the instance.
    async fn play(&self, names: &[&str], blocks: f64) -> anyhow::Result<()> {
        for name in names {
            self.queue.push(fixture(name)?);
        }
        let deadline = Instant::now() + CONVERGE;
        while !self.queue.is_empty() {
            anyhow::ensure!(Instant::now() < deadline, "the agent stopped polling");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let series = format!(
            "kvmesh_index_blocks{{instance=\"{}\",model=\"{MODEL}\"}}",
            self.engine
        );
        await_metric(
            &self.client,
            &self.metrics_url(),
            &series,
            |v| v == blocks,
            CONVERGE,
        )
        .await
        .map(drop)
    }

    fn metrics_url(&self) -> String {
        format!("{}/metrics", self.proxy.url("admin"))
    }

    /// The blocks of `tokens` the proxy's index holds for the instance (`/debug/route`).
    async fn reported(&self, tokens: &[u32]) -> anyhow::Result<u64> {
        let url = format!("{}/debug/route?route=completions", self.proxy.url("admin"));
        let body = serde_json::json!({"model": MODEL, "prompt": tokens, "max_tokens": 1});
        let explained = self.client.post_json(&url, &body).await?.json()?;
        explained["instances"][0]["reported_blocks"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("no reported_blocks: {explained}"))
    }

    /// Waits until the proxy reports, for each prompt (the first tokens of its blocks), the
    /// blocks given; fails with the last answer after the deadline.
    async fn assert_holds(&self, prompts: &[(&[u32], u64)]) -> anyhow::Result<()> {
        for (firsts, blocks) in prompts {
            let deadline = Instant::now() + CONVERGE;
            loop {
                let reported = self.reported(&prompt(firsts)).await?;
                if reported == *blocks {
                    break;
                }
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "the prompt of blocks {firsts:?}: {reported} blocks reported, not {blocks}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok(())
    }

    /// Waits until the proxy marks the instance's events incomplete (`true`) or whole.
    async fn await_incomplete(&self, incomplete: bool) -> anyhow::Result<()> {
        let series = format!(
            "kvmesh_route_kv_events_incomplete{{instance=\"{}\",model=\"{MODEL}\"}}",
            self.engine
        );
        let want = f64::from(u8::from(incomplete));
        await_metric(
            &self.client,
            &self.metrics_url(),
            &series,
            |v| v == want,
            CONVERGE,
        )
        .await
        .map(drop)
    }

    /// A counter of the agent's own `/metrics`.
    async fn agent_metric(&self, series: &str) -> anyhow::Result<f64> {
        let text = self
            .client
            .get(&format!("{}/metrics", self.agent.url("agent")))
            .await?;
        metric(&String::from_utf8_lossy(&text.body), series)
            .ok_or_else(|| anyhow::anyhow!("the agent has no {series}"))
    }
}

// Two workers: the fake engine answers the agent while `Spawned::start` blocks one waiting for
// its `READY`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_holds_what_trtllm_events_leave_stored() -> anyhow::Result<()> {
    let scratch = ScratchDir::new("trtllm-events")?;
    let servers = Servers::start(&scratch).await?;
    let queue = Arc::new(Queue::default());
    let engine = format!("http://{}", fake_trtllm(queue.clone()).await?);
    let agent = Spawned::start(
        "kvmesh-agent",
        &[
            "--engine-url",
            &engine,
            "--model",
            MODEL,
            "--engine-kind",
            "trtllm",
            "--kv-events-poll-interval",
            "50ms",
            "--dp-ranks",
            "2",
            "--etcd",
            &servers.etcd.url(),
            "--nats",
            &servers.nats.url(),
            "--load-interval",
            "100ms",
            "--health-interval",
            "200ms",
            "--drain",
            "0ms",
        ]
        .map(str::to_owned),
        scratch.path(),
    )?;
    let proxy = start_proxy(&scratch, &proxy_config(&servers))?;
    let cluster = Cluster {
        client: HttpClient::default(),
        proxy,
        agent,
        queue,
        engine,
    };
    let instances = format!("kvmesh_discovery_instances{{model=\"{MODEL}\"}}");
    await_metric(
        &cluster.client,
        &cluster.metrics_url(),
        &instances,
        |v| v == 1.0,
        CONVERGE,
    )
    .await?;
    cluster.await_incomplete(false).await?;

    // An engine's lifetime: A0 A1 (A2 partial), B1 after A0 (B2 partial); A1 and the partial
    // A2 evicted, C0 C1 stored, the partial B2 evicted; nothing; A1 again and D after A0.
    cluster
        .play(
            &[
                "single-01-created.json",
                "single-02-stored.json",
                "single-03-evicted.json",
                "single-04-empty.json",
                "single-05-restored.json",
            ],
            6.0,
        )
        .await?;
    cluster
        .assert_holds(&[
            (&[1000, 1032, 4000], 3),
            (&[1000, 2000], 2),
            (&[3000, 3032], 2),
            (&[1000, 1032, 1064], 2),
        ])
        .await?;
    assert_eq!(
        cluster
            .agent_metric("kvmesh_agent_dropped_total{reason=\"partial_block\"}")
            .await?,
        2.0
    );
    assert_eq!(
        cluster
            .agent_metric("kvmesh_agent_translation_misses_total")
            .await?,
        0.0,
        "the removals of partial blocks are no misses"
    );

    // The engine restarted: its blocks forgotten, E stored.
    cluster.play(&["single-06-restarted.json"], 1.0).await?;
    cluster
        .assert_holds(&[(&[5000], 1), (&[1000, 1032], 0)])
        .await?;
    cluster.await_incomplete(false).await?;

    // Another engine start; then events 1 and 2 dropped by its full queue: F2 and F3 stored
    // after the gap, and the agent's view incomplete, which the proxy learns from its load
    // reports.
    cluster
        .play(
            &["overflow-01-created.json", "overflow-02-dropped.json"],
            2.0,
        )
        .await?;
    cluster.await_incomplete(true).await?;
    // The index holds F2 and F3, but an instance whose view is incomplete is scored by the
    // proxy's predictions alone: none of them is reported.
    cluster.assert_holds(&[(&[6200], 0), (&[6300], 0)]).await?;
    assert_eq!(
        cluster
            .agent_metric("kvmesh_agent_engine_seq_gaps_total")
            .await?,
        1.0
    );
    assert_eq!(
        cluster
            .agent_metric("kvmesh_agent_kv_events_complete")
            .await?,
        0.0
    );

    // A restart with windows 512 and 4096: only 4096's I0 I1; the view whole again.
    cluster.play(&["vswa-01.json"], 2.0).await?;
    cluster.await_incomplete(false).await?;
    cluster
        .assert_holds(&[(&[8000, 8032], 2), (&[6200], 0)])
        .await?;

    // Two attention-DP ranks: rank 0 restarted (G0 G1), rank 1 new (G0; H stored and evicted).
    cluster.play(&["adp-01.json"], 3.0).await?;
    cluster
        .assert_holds(&[(&[7000, 7032], 2), (&[7000, 7500], 1), (&[8000], 0)])
        .await?;
    Ok(())
}
