//! Cache tiers end to end (issue 32): `etcd`, `nats-server`, two `kvmesh-engine-sim` engines
//! with small device caches, one of them keeping what it stores in host memory too
//! (`--offload-blocks`, as vLLM's `OffloadingConnector` does, with its events), an agent
//! beside each, and two `kvmesh-proxy` replicas with `policy: kv` that differ only in
//! `kv.tier_weights.host`.
//!
//! A prompt is computed on the offloading engine, then pushed out of its device cache by
//! other prompts: the engine holds it in host memory only. The other engine computes the
//! prompt's first half. Through the agents, both proxies' indexes see the host-memory blocks
//! (`host_blocks`) apart from the device ones (`overlap_blocks`). At the default weight
//! (0.75) the host prefix, 0.75 × 5 blocks, is worth more than the other engine's 3 device
//! blocks, and the proxy sends the prompt there: the engine loads it back and answers with all
//! 5 blocks in `cached_tokens`. At 0.25 it is worth less, and the other proxy would send it
//! to the device prefix.
//!
//! Readiness comes from `LISTENING`/`READY` lines, metrics and the admin `/debug/route`, each
//! polled against a deadline.

use std::time::Duration;

use http::Method;
use kvmesh_e2e::cluster::{MODEL, start_proxy};
use kvmesh_e2e::control_plane::{
    BLOCK_SIZE, Engine, Servers, agent_args, await_explained, await_metric, control_proxy_config,
    metric, prompt_tokens, start_event_engines_with, token_prompt,
};
use kvmesh_e2e::{HttpClient, ScratchDir, Spawned};

/// Deadline for state that travels through the control plane.
const CONVERGE: Duration = Duration::from_secs(15);
const LEASE_TTL: Duration = Duration::from_secs(10);
const DRAIN: Duration = Duration::from_millis(500);
/// Device cache of each engine, in blocks: four 6-block prompts push a fifth out.
const DEVICE_BLOCKS: &str = "16";
/// The offloading engine's host memory, in blocks: all of this test's prompts fit.
const HOST_BLOCKS: &str = "64";

/// Sends a 1-token completion of `prompt` to `url` (an engine's or a proxy's); returns its
/// `x-kvmesh-route` (empty from an engine) and `cached_tokens`.
async fn complete(client: &HttpClient, url: &str, prompt: &[u32]) -> anyhow::Result<(String, u64)> {
    let response = client
        .call(
            Method::POST,
            &format!("{url}/v1/completions"),
            &[("content-type", "application/json")],
            token_prompt(prompt, 1).to_string(),
        )
        .await?;
    anyhow::ensure!(response.status == 200, "{url} answered {}", response.status);
    let route = response.header("x-kvmesh-route").unwrap_or("").to_string();
    let cached = response.json()?["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no cached_tokens in the usage"))?;
    Ok((route, cached))
}

/// `field` of engine `engine`'s entry in an explanation.
fn explained(explanation: &serde_json::Value, engine: &Engine, field: &str) -> u64 {
    explanation["instances"]
        .as_array()
        .and_then(|all| all.iter().find(|entry| entry["instance"] == engine.url))
        .and_then(|entry| entry[field].as_u64())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_in_host_memory_draws_its_prompt_at_the_host_weight() -> anyhow::Result<()> {
    let scratch = ScratchDir::new("kv-tiers")?;
    let servers = Servers::start(&scratch).await?;
    let small = [
        "--num-gpu-blocks",
        DEVICE_BLOCKS,
        "--enable-prompt-tokens-details",
    ];
    let (_offloading_sim, offloading) = start_event_engines_with(
        &scratch,
        1,
        &[&small[..], &["--offload-blocks", HOST_BLOCKS]].concat(),
    )?;
    let (_plain_sim, plain) = start_event_engines_with(&scratch, 1, &small)?;
    let (offloading, plain) = (&offloading[0], &plain[0]);
    let agents = [offloading, plain]
        .into_iter()
        .map(|engine| {
            Spawned::start(
                "kvmesh-agent",
                &agent_args(&servers, engine, LEASE_TTL, DRAIN),
                scratch.path(),
            )
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let default_weights = start_proxy(&scratch, &control_proxy_config(&servers, ""))?;
    let low_host_weight = start_proxy(
        &scratch,
        &control_proxy_config(&servers, "").replace(
            &format!("      block_size: {BLOCK_SIZE}\n"),
            &format!("      block_size: {BLOCK_SIZE}\n      tier_weights: {{host: 0.25}}\n"),
        ),
    )?;
    let client = HttpClient::default();
    for proxy in [&default_weights, &low_host_weight] {
        let metrics = format!("{}/metrics", proxy.url("admin"));
        let instances = format!("kvmesh_discovery_instances{{model=\"{MODEL}\"}}");
        await_metric(&client, &metrics, &instances, |v| v == 2.0, CONVERGE).await?;
        let live = format!("kvmesh_kv_index_source{{mode=\"events\",model=\"{MODEL}\"}}");
        await_metric(&client, &metrics, &live, |v| v == 1.0, CONVERGE).await?;
    }

    // The prompt (6 blocks; an engine serves at most 5 from cache, as vLLM computes the last
    // prompt token) on the offloading engine, then four others that push it out of its
    // device cache: it stays in host memory alone.
    let prompt = prompt_tokens(7, 6);
    let (_, cached) = complete(&client, &offloading.url, &prompt).await?;
    assert_eq!(cached, 0);
    for seed in 20..24 {
        complete(&client, &offloading.url, &prompt_tokens(seed, 6)).await?;
    }
    // The other engine computes its first 3 blocks (and the 4th's first token).
    let (_, cached) = complete(&client, &plain.url, &prompt[..3 * BLOCK_SIZE + 1]).await?;
    assert_eq!(cached, 0);
    let agent_text = client
        .get(&format!("{}/metrics", agents[0].url("agent")))
        .await?;
    let offloaded = metric(
        &String::from_utf8_lossy(&agent_text.body),
        "kvmesh_agent_offloaded_blocks{tier=\"host\"}",
    );
    assert_eq!(offloaded, Some(30.0), "five 6-block prompts in host memory");

    // Both proxies see the prompt's 6 blocks in the offloading engine's host memory and none
    // on its device, and 3 on the other engine's device; and both engines idle (a load report
    // scraped while one of the requests above ran counts its blocks until the next report).
    let placed = |explanation: &serde_json::Value| {
        explained(explanation, offloading, "host_blocks") == 6
            && explained(explanation, offloading, "overlap_blocks") == 0
            && explained(explanation, plain, "overlap_blocks") == 3
            && explained(explanation, offloading, "active_blocks") == 0
            && explained(explanation, plain, "active_blocks") == 0
    };
    let request = token_prompt(&prompt, 1);
    let at_default = await_explained(&client, &default_weights, &request, None, placed).await?;
    let at_low = await_explained(&client, &low_host_weight, &request, None, placed).await?;
    assert_eq!(at_default["tier_weights"]["host"], 0.75);
    assert_eq!(at_low["tier_weights"]["host"], 0.25);
    // 0.75 × 6 host blocks beat 3 device blocks; 0.25 × 6 do not.
    assert_eq!(
        at_default["chosen"],
        offloading.url.as_str(),
        "{at_default}"
    );
    assert_eq!(at_low["chosen"], plain.url.as_str(), "{at_low}");

    // Sent through the default proxy, the prompt goes to the offloading engine, which loads
    // its 5 cacheable blocks back from host memory.
    let (route, cached) = complete(&client, &default_weights.url("main"), &prompt).await?;
    assert!(
        route.starts_with(&format!("instance={};", offloading.url)),
        "{route}"
    );
    assert_eq!(cached, 5 * BLOCK_SIZE as u64, "{route}");
    Ok(())
}
