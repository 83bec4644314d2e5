//! README's run command: `kvmesh-demo` (what `scripts/demo.sh` runs) answers the printed
//! request, explains its route, and routes a prompt whose prefix an engine reported
//! caching (through its in-process agent and event bus) to that engine.
//!
//! Needs the Qwen3 tokenizer fetched by `scripts/fetch-tokenizer.sh` (the demo's default
//! tokenizer directory).

use std::time::{Duration, Instant};

use kvmesh_e2e::{HttpClient, ScratchDir, Spawned};
use serde_json::{Value, json};

/// The demo's model name.
const MODEL: &str = "qwen3";

/// A chat body with a long system prompt (many KV blocks) and `question`.
fn chat_body(question: &str) -> Value {
    let system: String = (0..600)
        .map(|i| format!("rule {i} of the house style is to be precise. "))
        .collect();
    json!({
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
    })
}

/// The `overlap_blocks=` field of an `x-kvmesh-route` header.
fn overlap_blocks(route: &str) -> u64 {
    route
        .split(';')
        .map(str::trim)
        .find_map(|part| part.strip_prefix("overlap_blocks="))
        .unwrap_or_else(|| panic!("overlap_blocks missing from x-kvmesh-route: {route}"))
        .parse()
        .expect("overlap_blocks is a number")
}

/// Waits (10 s at most) until `POST /debug/route` at `explain_url` shows part of `body`'s
/// prompt cached: on instance `on`, or on any instance when `None`.
async fn wait_until_cached(
    client: &HttpClient,
    explain_url: &str,
    body: &Value,
    on: Option<&str>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let explained = client.post_json(explain_url, body).await?.json()?;
        let cached = explained["instances"].as_array().is_some_and(|all| {
            all.iter().any(|i| {
                on.is_none_or(|on| i["instance"].as_str() == Some(on))
                    && i["overlap_blocks"].as_u64() > Some(0)
            })
        });
        if cached {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the engine's KV events never reached the index (on {on:?}): {explained}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Starts `kvmesh-demo` with its listeners on free loopback ports and `extra` flags.
fn start_demo(scratch: &ScratchDir, extra: &[&str]) -> anyhow::Result<Spawned> {
    let mut args: Vec<String> = ["--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]
        .map(String::from)
        .to_vec();
    args.extend(extra.iter().map(|arg| arg.to_string()));
    Spawned::start("kvmesh-demo", &args, scratch.path())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_answers_and_routes_a_cached_prefix_to_its_engine() -> anyhow::Result<()> {
    let scratch = ScratchDir::new("demo")?;
    let demo = start_demo(
        &scratch,
        &["--grpc", "127.0.0.1:0", "--speedup-ratio", "100"],
    )?;
    let client = HttpClient::http1();
    let chat_url = format!("{}/v1/chat/completions", demo.url("main"));

    // The request README's curl sends.
    let hello = json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 16,
    });
    let reply = client.post_json(&chat_url, &hello).await?;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json()?;
    assert!(
        body["choices"][0]["message"]["content"].is_string(),
        "{body}"
    );
    assert!(reply.header("x-kvmesh-instance").is_some());
    assert!(reply.header("x-kvmesh-route").is_some());

    // A long prompt: its engine caches the prefix and reports it through its agent.
    let first = client
        .post_json(&chat_url, &chat_body("What is rule 1?"))
        .await?;
    assert_eq!(first.status, 200);
    let first_instance = first
        .header("x-kvmesh-instance")
        .expect("x-kvmesh-instance")
        .to_string();

    // Readiness signal: the admin explanation shows the shared prefix cached somewhere.
    let explain_url = format!("{}/debug/route", demo.url("admin"));
    let next = chat_body("And what is rule 2?");
    wait_until_cached(&client, &explain_url, &next, None).await?;

    let second = client.post_json(&chat_url, &next).await?;
    assert_eq!(second.status, 200);
    let overlap = overlap_blocks(second.header("x-kvmesh-route").expect("x-kvmesh-route"));
    assert!(overlap > 0, "the shared system prompt was not found cached");
    assert_eq!(
        second.header("x-kvmesh-instance"),
        Some(first_instance.as_str()),
        "the request sharing the prefix went elsewhere"
    );
    Ok(())
}

/// Sequential multi-turn chats, each with its own long system prompt, as a user tries the
/// demo: every turn of a conversation goes to the engine that served its first turn and
/// caches it, although that engine's load reports lag behind (a report scraped while the
/// previous turn ran must not count that turn once it ended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_conversations_stay_on_the_engine_that_caches_them() -> anyhow::Result<()> {
    let scratch = ScratchDir::new("demo-turns")?;
    let demo = start_demo(&scratch, &["--speedup-ratio", "20"])?;
    let client = HttpClient::http1();
    let chat_url = format!("{}/v1/chat/completions", demo.url("main"));
    let explain_url = format!("{}/debug/route", demo.url("admin"));
    let mut moved = Vec::new();
    for conversation in 0..12 {
        let system: String = (0..150)
            .map(|i| format!("Conversation {conversation} keeps house rule {i} in mind. "))
            .collect();
        let mut messages = vec![json!({"role": "system", "content": system})];
        let mut home: Option<String> = None;
        for turn in 0..5 {
            messages.push(json!({"role": "user", "content": format!("Question {turn}?")}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 16});
            if let Some(home) = &home {
                // Readiness: the previous turn's blocks reached the index (KV events).
                wait_until_cached(&client, &explain_url, &body, Some(home)).await?;
            }
            let reply = client.post_json(&chat_url, &body).await?;
            assert_eq!(
                reply.status,
                200,
                "{}",
                String::from_utf8_lossy(&reply.body)
            );
            let instance = reply
                .header("x-kvmesh-instance")
                .expect("x-kvmesh-instance")
                .to_string();
            match &home {
                None => home = Some(instance),
                Some(home) if *home != instance => moved.push((
                    conversation,
                    turn,
                    reply
                        .header("x-kvmesh-route")
                        .unwrap_or_default()
                        .to_string(),
                )),
                Some(_) => {}
            }
            let answer = reply.json()?["choices"][0]["message"]["content"].clone();
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    assert!(moved.is_empty(), "turns that left their engine: {moved:?}");
    Ok(())
}

/// `kvmesh-demo --disaggregated`: README's request prefills on a prefill engine and decodes
/// on a decode engine, which pulls the KV; `x-kvmesh-route` names both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_disaggregated_demo_runs_each_request_in_two_legs() -> anyhow::Result<()> {
    let scratch = ScratchDir::new("demo-pd")?;
    let demo = start_demo(
        &scratch,
        &[
            "--grpc",
            "127.0.0.1:0",
            "--speedup-ratio",
            "100",
            "--engines",
            "2",
            "--disaggregated",
        ],
    )?;
    let client = HttpClient::http1();
    let chat_url = format!("{}/v1/chat/completions", demo.url("main"));
    // The agents register both engines with their roles; until both are listed the request
    // has no prefill (or no decode) instance to go to.
    let metrics_url = format!("{}/metrics", demo.url("admin"));
    let series = format!("kvmesh_discovery_instances{{model=\"{MODEL}\"}}");
    kvmesh_e2e::control_plane::await_metric(
        &client,
        &metrics_url,
        &series,
        |v| v == 2.0,
        Duration::from_secs(10),
    )
    .await?;
    for question in ["What is rule 1?", "What is rule 2?"] {
        let reply = client.post_json(&chat_url, &chat_body(question)).await?;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        let route = reply.header("x-kvmesh-route").expect("x-kvmesh-route");
        let (prefill, decode) = route
            .strip_prefix("prefill=http://")
            .and_then(|rest| rest.split_once("; instance=http://"))
            .unwrap_or_else(|| panic!("not two legs: {route}"));
        let prefill = prefill.to_string();
        assert!(
            !decode.starts_with(&prefill),
            "one engine took both legs: {route}"
        );
        assert_eq!(reply.json()?["usage"]["completion_tokens"], 8);
    }
    let metrics = client.get(&metrics_url).await?;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains(&format!(
            "kvmesh_prefill_legs_total{{model=\"{MODEL}\",outcome=\"remote\"}} 2"
        )),
        "{text}"
    );
    // The decode engine's agent, its inbound sidecar, admitted both decode legs into its
    // KV-transfer budget; the prefill engine's agent admitted none.
    let mut admitted = Vec::new();
    for agent in ["agent-0", "agent-1"] {
        let text = client.get(&format!("{}/metrics", demo.url(agent))).await?;
        let text = String::from_utf8_lossy(&text.body);
        admitted.push(
            kvmesh_e2e::control_plane::metric(&text, "kvmesh_agent_kv_transfers_admitted_total")
                .unwrap_or_else(|| panic!("{agent} exports no admissions:\n{text}")),
        );
    }
    admitted.sort_by(f64::total_cmp);
    assert_eq!(admitted, [0.0, 2.0], "decode legs each agent admitted");
    Ok(())
}
