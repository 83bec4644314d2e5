//! Data-parallel ranks end to end (issue 32): `etcd`, `nats-server`, one `kvmesh-engine-sim`
//! serving two data-parallel ranks behind one port (as vLLM's `--data-parallel-size 2`: a KV
//! cache, a scheduler and a KV event socket at the port plus the rank each), `kvmesh-agent
//! --dp-ranks 2` beside it, and `kvmesh-proxy` with `policy: kv` over etcd and NATS.
//!
//! A conversation's first turn goes out with no rank (nothing is cached): the engine's own
//! balancer places it, and its per-rank metrics (`engine="<rank>"`) say where. Once that
//! rank's KV events have reached the proxy's index, the next turn carries
//! `X-data-parallel-rank` for that rank: the route explanation names it (`rank=R`), the engine
//! runs it there and serves the first turn's blocks from that rank's cache. A fresh prompt
//! goes out with no rank again.
//!
//! Readiness comes from `LISTENING`/`READY` lines and from metrics and the admin
//! `/debug/route` polled against a deadline.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use http::Method;
use kvmesh_e2e::cluster::{MODEL, start_engines, start_proxy};
use kvmesh_e2e::control_plane::{
    BLOCK_SIZE, Engine, Servers, agent_args, await_metric, control_proxy_config, metric,
    prompt_tokens, token_prompt,
};
use kvmesh_e2e::{HttpClient, ScratchDir, Spawned};

/// Data-parallel ranks of the engine.
const RANKS: u16 = 2;
/// Deadline for state the proxy reaches through the control plane.
const CONVERGE: Duration = Duration::from_secs(15);
const LEASE_TTL: Duration = Duration::from_secs(10);
const DRAIN: Duration = Duration::from_millis(500);

/// A port `p` with `p + 1` free as well (both released again).
fn free_pair() -> Option<u16> {
    let first = TcpListener::bind("127.0.0.1:0").ok()?;
    let port = first.local_addr().ok()?.port();
    let _second = TcpListener::bind(("127.0.0.1", port.checked_add(1)?)).ok()?;
    Some(port)
}

/// Starts engine-sim with [`RANKS`] ranks whose KV event and replay sockets sit at fixed
/// ports, rank `r` at the port plus `r` (the agent finds them so), retrying when a port found
/// free was taken meanwhile.
fn start_dp_engine(scratch: &ScratchDir) -> anyhow::Result<(Spawned, Engine)> {
    let mut last = None;
    for _ in 0..10 {
        let (Some(events), Some(replay)) = (free_pair(), free_pair()) else {
            continue;
        };
        let (events, replay) = (
            format!("tcp://127.0.0.1:{events}"),
            format!("tcp://127.0.0.1:{replay}"),
        );
        let started = start_engines(
            scratch,
            1,
            &[
                "--no-delay",
                "--block-size",
                &BLOCK_SIZE.to_string(),
                "--dp-ranks",
                &RANKS.to_string(),
                "--enable-prompt-tokens-details",
                "--kv-events-endpoint",
                &events,
                "--kv-events-replay-endpoint",
                &replay,
            ],
        );
        match started {
            Ok(sim) => {
                let url = format!("http://{}", sim.addr("engine-0"));
                anyhow::ensure!(
                    format!("tcp://{}", sim.addr("kv-events-0-dp1")) == rank_endpoint(&events, 1),
                    "rank 1 publishes at the port plus 1"
                );
                return Ok((
                    sim,
                    Engine {
                        url,
                        events,
                        replay,
                    },
                ));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no free pairs of consecutive ports")))
}

/// `endpoint` with its port raised by `rank`.
fn rank_endpoint(endpoint: &str, rank: u16) -> String {
    let (host, port) = endpoint.rsplit_once(':').expect("tcp://HOST:PORT");
    let port: u16 = port.parse().expect("a port");
    format!("{host}:{}", port + rank)
}

/// Requests each rank finished so far (`vllm:request_success_total{engine="<rank>"}`).
async fn finished_per_rank(client: &HttpClient, engine: &Engine) -> anyhow::Result<Vec<f64>> {
    let text = client.get(&format!("{}/metrics", engine.url)).await?;
    let text = String::from_utf8_lossy(&text.body);
    Ok((0..RANKS)
        .map(|rank| {
            ["length", "stop"]
                .iter()
                .filter_map(|reason| {
                    metric(
                        &text,
                        &format!(
                            "vllm:request_success_total{{engine=\"{rank}\",model_name=\"{MODEL}\",finished_reason=\"{reason}\"}}"
                        ),
                    )
                })
                .sum()
        })
        .collect())
}

/// What one completion through the proxy gave.
struct Routed {
    /// `x-kvmesh-route`.
    route: String,
    /// The rank that ran it, by the engine's per-rank metrics.
    rank: usize,
    /// `usage.prompt_tokens_details.cached_tokens`.
    cached_tokens: u64,
}

/// Sends a token-id completion of `prompt` through `proxy` and finds the rank that ran it.
async fn complete(
    client: &HttpClient,
    proxy: &Spawned,
    engine: &Engine,
    prompt: &[u32],
) -> anyhow::Result<Routed> {
    let before = finished_per_rank(client, engine).await?;
    let url = format!("{}/v1/completions", proxy.url("main"));
    let response = client
        .call(
            Method::POST,
            &url,
            &[("content-type", "application/json")],
            token_prompt(prompt, 1).to_string(),
        )
        .await?;
    anyhow::ensure!(response.status == 200, "answered {}", response.status);
    let route = response.header("x-kvmesh-route").unwrap_or("").to_string();
    let cached_tokens = response.json()?["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no cached_tokens in the usage"))?;
    let after = finished_per_rank(client, engine).await?;
    let ran: Vec<usize> = (0..before.len())
        .filter(|&r| after[r] > before[r])
        .collect();
    let [rank] = ran[..] else {
        anyhow::bail!("expected one rank to run it, saw {ran:?} ({before:?} -> {after:?})");
    };
    Ok(Routed {
        route,
        rank,
        cached_tokens,
    })
}

#[tokio::test]
async fn the_next_turn_goes_to_the_rank_that_cached_the_first() -> anyhow::Result<()> {
    let scratch = ScratchDir::new("dp-ranks")?;
    let servers = Servers::start(&scratch).await?;
    let (_sim, engine) = start_dp_engine(&scratch)?;
    let mut args = agent_args(&servers, &engine, LEASE_TTL, DRAIN);
    args.extend(["--dp-ranks".to_string(), RANKS.to_string()]);
    let _agent = Spawned::start("kvmesh-agent", &args, scratch.path())?;
    let proxy = start_proxy(&scratch, &control_proxy_config(&servers, ""))?;
    let client = HttpClient::default();
    let metrics = format!("{}/metrics", proxy.url("admin"));
    let instances = format!("kvmesh_discovery_instances{{model=\"{MODEL}\"}}");
    await_metric(&client, &metrics, &instances, |v| v == 1.0, CONVERGE).await?;
    let events_live = format!("kvmesh_kv_index_source{{mode=\"events\",model=\"{MODEL}\"}}");
    await_metric(&client, &metrics, &events_live, |v| v == 1.0, CONVERGE).await?;

    // Another client's prompt first: the engine's balancer (vLLM's: the least loaded rank,
    // ties taken in turn from rank 0) puts it on rank 0, so the conversation lands on rank 1
    // and the rank the proxy sends below is not the one an engine would fall back to.
    let other = complete(&client, &proxy, &engine, &prompt_tokens(1, 4)).await?;
    assert_eq!(other.rank, 0, "{}", other.route);
    assert!(
        !other.route.contains("rank="),
        "nothing cached: {}",
        other.route
    );

    let first_turn = prompt_tokens(2, 4);
    let first = complete(&client, &proxy, &engine, &first_turn).await?;
    assert!(
        !first.route.contains("rank="),
        "nothing of it cached: {}",
        first.route
    );
    assert_eq!(first.cached_tokens, 0);
    assert_eq!(first.rank, 1, "the engine's balancer took turns");

    // The next turn: the conversation so far and two more blocks. Wait until the first
    // turn's blocks, reported by its rank, are in the proxy's index.
    let mut next_turn = first_turn.clone();
    next_turn.extend(prompt_tokens(3, 2));
    let explain = format!("{}/debug/route?route=completions", proxy.url("admin"));
    let deadline = Instant::now() + CONVERGE;
    loop {
        let explained = client
            .post_json(&explain, &token_prompt(&next_turn, 1))
            .await?
            .json()?;
        if explained["instances"][0]["reported_blocks"] == 4 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the first turn's blocks never reached the index: {explained}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let next = complete(&client, &proxy, &engine, &next_turn).await?;
    assert!(
        next.route
            .contains(&format!("reported_blocks=4; rank={}", first.rank)),
        "{}",
        next.route
    );
    assert_eq!(next.rank, first.rank, "the engine ran it on the rank sent");
    assert_eq!(
        next.cached_tokens,
        4 * BLOCK_SIZE as u64,
        "served from that rank's cache"
    );

    // A prompt nobody cached: no rank; the engine chooses.
    let fresh = complete(&client, &proxy, &engine, &prompt_tokens(4, 4)).await?;
    assert!(!fresh.route.contains("rank="), "{}", fresh.route);
    assert_eq!(fresh.cached_tokens, 0);
    Ok(())
}
