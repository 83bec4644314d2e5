//! The agent finds the engine's KV event publishers itself (issue 32): `etcd`, `nats-server`,
//! one `kvmesh-engine-sim` with two data-parallel ranks whose KV event and replay sockets bind
//! `tcp://*:0` (a free port each, not the port-plus-rank rule's, and `*` a bind address),
//! `kvmesh-agent` started with neither `--kv-events-endpoint` nor `--dp-ranks`, and
//! `kvmesh-proxy` with `policy: kv` over etcd and NATS.
//!
//! The agent reads the engine's `GET /kv_event_sources` (vLLM's shape; engine-sim's answer is
//! held to vLLM's in `engine-sim/tests/kv_event_sources.rs`), connects to each rank's sockets
//! on the engine's host and registers two ranks. A prompt sent to rank 1 and another to rank 0
//! straight to the engine both reach the proxy's index, and the proxy routes the first one's
//! continuation to rank 1 (`X-data-parallel-rank`, named in its route explanation).
//!
//! Readiness comes from `LISTENING`/`READY` lines and from metrics polled against a deadline.

use std::time::Duration;

use http::Method;
use kvmesh_e2e::cluster::{MODEL, start_engines, start_proxy};
use kvmesh_e2e::control_plane::{
    BLOCK_SIZE, Servers, await_metric, control_proxy_config, prompt_tokens, token_prompt,
};
use kvmesh_e2e::{HttpClient, ScratchDir, Spawned};

/// Deadline for state the proxy reaches through the control plane.
const CONVERGE: Duration = Duration::from_secs(15);

/// Sends a token-id completion of `prompt` to `url` (an engine or the proxy), to data-parallel
/// rank `rank` when given; returns the route explanation header.
async fn complete(
    client: &HttpClient,
    url: &str,
    prompt: &[u32],
    rank: Option<u32>,
) -> anyhow::Result<String> {
    let rank = rank.map(|r| r.to_string());
    let mut headers = vec![("content-type", "application/json")];
    headers.extend(rank.as_deref().map(|r| ("X-data-parallel-rank", r)));
    let response = client
        .call(
            Method::POST,
            &format!("{url}/v1/completions"),
            &headers,
            token_prompt(prompt, 1).to_string(),
        )
        .await?;
    anyhow::ensure!(response.status == 200, "answered {}", response.status);
    Ok(response.header("x-kvmesh-route").unwrap_or("").to_string())
}

#[tokio::test]
async fn an_agent_without_endpoints_asks_the_engine_where_its_ranks_publish() -> anyhow::Result<()>
{
    let scratch = ScratchDir::new("kv-event-sources")?;
    let servers = Servers::start(&scratch).await?;
    let sim = start_engines(
        &scratch,
        1,
        &[
            "--no-delay",
            "--block-size",
            &BLOCK_SIZE.to_string(),
            "--dp-ranks",
            "2",
            "--kv-events-endpoint",
            "tcp://*:0",
            "--kv-events-replay-endpoint",
            "tcp://*:0",
        ],
    )?;
    let engine = format!("http://{}", sim.addr("engine-0"));
    let _agent = Spawned::start(
        "kvmesh-agent",
        &[
            "--engine-url",
            &engine,
            "--model",
            MODEL,
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
    let proxy = start_proxy(&scratch, &control_proxy_config(&servers, ""))?;
    let client = HttpClient::default();
    let metrics = format!("{}/metrics", proxy.url("admin"));
    let instances = format!("kvmesh_discovery_instances{{model=\"{MODEL}\"}}");
    await_metric(&client, &metrics, &instances, |v| v == 1.0, CONVERGE).await?;

    // Rank 1 caches 4 blocks, rank 0 another prompt's 2: both reach the index.
    let on_rank1 = prompt_tokens(1, 4);
    complete(&client, &engine, &on_rank1, Some(1)).await?;
    complete(&client, &engine, &prompt_tokens(2, 2), Some(0)).await?;
    let blocks = format!("kvmesh_index_blocks{{instance=\"{engine}\",model=\"{MODEL}\"}}");
    await_metric(&client, &metrics, &blocks, |v| v == 6.0, CONVERGE).await?;

    // The record has two ranks: the continuation goes to the rank that cached its prefix.
    let mut continuation = on_rank1.clone();
    continuation.extend(prompt_tokens(3, 1));
    let route = complete(&client, &proxy.url("main"), &continuation, None).await?;
    assert!(
        route.contains("reported_blocks=4; rank=1"),
        "the proxy sent rank 1: {route}"
    );
    Ok(())
}
