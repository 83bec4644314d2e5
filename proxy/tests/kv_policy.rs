//! `policy: kv` through the library entry point, in front of in-test hyper backends, with a
//! small word-level tokenizer written to a temporary directory (no download needed).

// Shared with `tests/proxy.rs`, which uses the parts this file does not.
#[allow(dead_code)]
mod support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Response};
use support::{Backend, Reply, TestProxy, chat, closed_port, error_of, full, send};
use tokio::sync::Notify;

const BLOCK: usize = 4;

/// A tokenizer directory: one id per word `w0`…`w499`, roles, `:` and `</s>`; a template
/// that raises on unknown roles.
struct TokenizerDir(PathBuf);

impl TokenizerDir {
    fn new(label: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("kvmesh-proxy-kv-{}-{label}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut vocab = serde_json::Map::new();
        for (id, word) in ["[UNK]", "</s>", "system", "user", "assistant", ":"]
            .into_iter()
            .enumerate()
        {
            vocab.insert(word.to_string(), id.into());
        }
        for i in 0..500 {
            vocab.insert(format!("w{i}"), (6 + i).into());
        }
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 1, "content": "</s>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        let template = "{% for m in messages %}\
            {% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('Unsupported role: ' + m.role) }}{% endif %}\
            {{ m.role }} : {{ m.content }} {{ eos_token }} {% endfor %}{% if add_generation_prompt %}assistant :{% endif %}";
        let config = serde_json::json!({"eos_token": "</s>", "chat_template": template});
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TokenizerDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A `policy: kv` model `m` over `urls`, with `extra` lines under the model and `kv_extra`
/// under its `kv:` block; health checks off.
fn kv_yaml(urls: &[&str], tokenizer: Option<&Path>, extra: &str, kv_extra: &str) -> String {
    let mut yaml = String::from("models:\n  - name: m\n    policy: kv\n");
    if let Some(dir) = tokenizer {
        yaml.push_str(&format!("    tokenizer: {}\n", dir.display()));
    }
    yaml.push_str(extra);
    yaml.push_str(&format!("    kv:\n      block_size: {BLOCK}\n{kv_extra}"));
    yaml.push_str("    backends:\n");
    for url in urls {
        yaml.push_str(&format!("      - url: {url}\n"));
    }
    yaml.push_str("health_check:\n  enabled: false\n");
    yaml
}

/// `n` words starting at `w{first}`.
fn words(first: usize, n: usize) -> String {
    (first..first + n)
        .map(|i| format!("w{}", i % 500))
        .collect::<Vec<_>>()
        .join(" ")
}

fn chat_body(messages: &[(&str, String)]) -> String {
    let messages: Vec<_> = messages
        .iter()
        .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
        .collect();
    serde_json::json!({"model": "m", "messages": messages}).to_string()
}

/// `key=value` from an `x-kvmesh-route` header.
fn route_field(reply: &Reply, key: &str) -> String {
    let header = reply.header("x-kvmesh-route").expect("x-kvmesh-route");
    header
        .split("; ")
        .find_map(|part| part.strip_prefix(&format!("{key}=")))
        .unwrap_or_else(|| panic!("no {key} in {header:?}"))
        .to_string()
}

async fn explain(admin: std::net::SocketAddr, query: &str, body: &str) -> Reply {
    send(
        admin,
        Method::POST,
        &format!("/debug/route{query}"),
        &[("content-type", "application/json")],
        body.to_string(),
    )
    .await
}

async fn metrics(admin: std::net::SocketAddr) -> String {
    send(admin, Method::GET, "/metrics", &[], Bytes::new())
        .await
        .text()
        .await
        .unwrap()
}

/// A backend that holds every response until `release` is notified.
async fn gated_backend(release: Arc<Notify>) -> Backend {
    Backend::start(move |_| {
        let release = Arc::clone(&release);
        async move {
            release.notified().await;
            Response::builder()
                .header("content-type", "application/json")
                .body(full(r#"{"ok":true}"#))
                .unwrap()
        }
    })
    .await
}

/// Polls the explain endpoint until `done` holds for its JSON.
async fn await_explained(
    admin: std::net::SocketAddr,
    body: &str,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let json = explain(admin, "", body).await.json().await;
        if done(&json) {
            return json;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never reached: {json}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_turns_stick_to_their_instance_and_explain_themselves() {
    let backends = [
        Backend::ok().await,
        Backend::ok().await,
        Backend::ok().await,
    ];
    let urls: Vec<&str> = backends.iter().map(|b| b.url.as_str()).collect();
    let tokenizer = TokenizerDir::new("stick");
    let proxy = TestProxy::start(&kv_yaml(&urls, Some(tokenizer.path()), "", "")).await;

    let system = ("system", words(0, 40));
    let first = chat_body(&[system.clone(), ("user", words(100, 10))]);
    let reply = chat(proxy.main, &first).await;
    assert_eq!(reply.status, 200);
    let instance = reply.header("x-kvmesh-instance").unwrap().to_string();
    assert_eq!(route_field(&reply, "instance"), instance);
    assert_eq!(route_field(&reply, "overlap_blocks"), "0");
    // "system : " + 40 words + " </s> user : " + 10 words + " </s> assistant :" = 58 tokens.
    assert_eq!(
        route_field(&reply, "prompt_blocks"),
        (58 / BLOCK).to_string()
    );
    reply.text().await.unwrap();

    let second = chat_body(&[
        system.clone(),
        ("user", words(100, 10)),
        ("assistant", words(200, 12)),
        ("user", words(300, 6)),
    ]);
    for _ in 0..3 {
        let reply = chat(proxy.main, &second).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.header("x-kvmesh-instance"), Some(instance.as_str()));
        let overlap: usize = route_field(&reply, "overlap_blocks").parse().unwrap();
        assert!(overlap >= 55 / BLOCK, "overlap {overlap}");
        reply.text().await.unwrap();
    }
    // The body reaches the engine untouched.
    let seen: Vec<_> = backends.iter().flat_map(|b| b.requests()).collect();
    assert_eq!(seen.len(), 4);
    assert_eq!(seen[0].body, Bytes::from(first));

    // The explain endpoint scores the next turn the same way and forwards nothing.
    let third = chat_body(&[
        system,
        ("user", words(100, 10)),
        ("assistant", words(200, 12)),
    ]);
    // A booking ends just after the response's last byte, the in-flight count when the
    // request's guard drops after it: wait for both to go.
    await_explained(proxy.admin, &third, |json| {
        json["instances"].as_array().is_some_and(|all| {
            all.iter()
                .all(|i| i["active_requests"] == 0 && i["in_flight"] == 0)
        })
    })
    .await;
    let explained = explain(proxy.admin, "?route=chat_completions", &third).await;
    assert_eq!(explained.status, 200);
    let json = explained.json().await;
    assert_eq!(json["model"], "m");
    assert_eq!(json["route"], "chat_completions");
    assert_eq!(json["chosen"], instance.as_str());
    let instances = json["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 3);
    for entry in instances {
        let cached = entry["overlap_blocks"].as_u64().unwrap();
        if entry["instance"] == instance.as_str() {
            assert!(cached > 10, "{json}");
            assert_eq!(entry["probability"], 1.0);
        } else {
            assert_eq!(cached, 0, "{json}");
        }
        for field in [
            "active_prefill_tokens",
            "active_blocks",
            "cost",
            "busy",
            "eligible",
        ] {
            assert!(entry.get(field).is_some(), "no {field} in {entry}");
        }
    }
    let again = explain(proxy.admin, "", &third).await.json().await;
    assert_eq!(again, json, "explaining changes nothing");
    let seen: usize = backends.iter().map(|b| b.requests().len()).sum();
    assert_eq!(seen, 4);

    let text = metrics(proxy.admin).await;
    for needle in [
        "kvmesh_route_overlap_blocks_count{model=\"m\"} 4",
        "kvmesh_route_decision_seconds_count{model=\"m\",stage=\"template\"} 4",
        "kvmesh_route_decision_seconds_count{model=\"m\",stage=\"tokenize\"} 4",
        "kvmesh_route_decision_seconds_count{model=\"m\",stage=\"hash\"} 4",
        "kvmesh_route_decision_seconds_count{model=\"m\",stage=\"lookup\"} 4",
        "kvmesh_route_decision_seconds_count{model=\"m\",stage=\"score\"} 4",
        &format!("kvmesh_index_blocks{{instance=\"{instance}\",model=\"m\"}} "),
        "kvmesh_index_prunes_total{model=\"m\"} 0",
        "kvmesh_route_busy_rejections_total{model=\"m\"} 0",
        "kvmesh_route_queue_depth{model=\"m\"} 0",
    ] {
        assert!(text.contains(needle), "no {needle} in\n{text}");
    }
    let predicted = text
        .lines()
        .find(|l| l.starts_with(&format!("kvmesh_index_blocks{{instance=\"{instance}\"")))
        .and_then(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .unwrap();
    // The second turn's 82 tokens hold 20 full blocks; the first turn's 14 are their prefix.
    assert_eq!(predicted, 82 / BLOCK as u64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn template_errors_are_400_with_the_template_message() {
    let backend = Backend::ok().await;
    let tokenizer = TokenizerDir::new("raise");
    let proxy = TestProxy::start(&kv_yaml(&[&backend.url], Some(tokenizer.path()), "", "")).await;
    let body = chat_body(&[("critic", words(0, 3))]);
    let reply = chat(proxy.main, &body).await;
    assert_eq!(reply.status, 400);
    let error = error_of(reply).await;
    assert_eq!(error["message"], "Unsupported role: critic");
    assert_eq!(error["code"], "invalid_prompt");
    let missing = chat(proxy.main, r#"{"model":"m"}"#).await;
    assert_eq!(missing.status, 400);
    assert!(backend.requests().is_empty());
    let explained = explain(proxy.admin, "", &body).await;
    assert_eq!(explained.status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn string_prompts_are_forwarded_as_token_ids() {
    let backend = Backend::ok().await;
    let tokenizer = TokenizerDir::new("ids");
    let yaml = kv_yaml(
        &[&backend.url],
        Some(tokenizer.path()),
        "    forward_token_ids: true\n",
        "",
    );
    let proxy = TestProxy::start(&yaml).await;
    let send_completion = |body: &'static str| {
        send(
            proxy.main,
            Method::POST,
            "/v1/completions",
            &[("content-type", "application/json")],
            body,
        )
    };
    let reply =
        send_completion(r#"{"model":"m", "prompt": "w1 w2 w3 w4 w5", "max_tokens": 2}"#).await;
    assert_eq!(reply.status, 200);
    assert_eq!(route_field(&reply, "prompt_blocks"), "1");
    let listed = send_completion(r#"{"model":"m","prompt":["w1 w2","w3"]}"#).await;
    assert_eq!(listed.status, 200);
    let ids = send_completion(r#"{"model":"m","prompt":[7,8,9,10,11]}"#).await;
    assert_eq!(ids.status, 200);
    // The token-id prompt [7..11] equals the tokens of "w1 … w5": it is predicted cached.
    assert_eq!(route_field(&ids, "overlap_blocks"), "1");
    let seen = backend.requests();
    assert_eq!(
        seen[0].body,
        Bytes::from_static(br#"{"model":"m", "prompt": [7,8,9,10,11], "max_tokens": 2}"#)
    );
    assert_eq!(
        seen[0].headers["content-length"],
        seen[0].body.len().to_string()
    );
    assert_eq!(
        seen[1].body,
        Bytes::from_static(br#"{"model":"m","prompt":["w1 w2","w3"]}"#),
        "list prompts are not rewritten"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_without_tokens_are_routed_by_load() {
    let backend = Backend::ok().await;
    let proxy = TestProxy::start(&kv_yaml(&[&backend.url], None, "", "")).await;
    let reply = chat(proxy.main, &chat_body(&[("user", words(0, 8))])).await;
    assert_eq!(reply.status, 200);
    assert_eq!(route_field(&reply, "fallback"), "no_tokenizer");
    let embed = send(
        proxy.main,
        Method::POST,
        "/v1/embeddings",
        &[("content-type", "application/json")],
        r#"{"model":"m","input":"x"}"#,
    )
    .await;
    assert_eq!(embed.status, 200);
    assert_eq!(route_field(&embed, "fallback"), "route");
    let text = metrics(proxy.admin).await;
    for needle in [
        "kvmesh_route_fallbacks_total{model=\"m\",reason=\"no_tokenizer\"} 1",
        "kvmesh_route_fallbacks_total{model=\"m\",reason=\"route\"} 1",
    ] {
        assert!(text.contains(needle), "no {needle} in\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_instances_get_503_with_retry_after() {
    let release = Arc::new(Notify::new());
    let backend = gated_backend(Arc::clone(&release)).await;
    let yaml = kv_yaml(&[&backend.url], None, "", "      busy_prefill_tokens: 5\n");
    let proxy = TestProxy::start(&yaml).await;
    let body = r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10]}"#;
    let main = proxy.main;
    let first =
        tokio::spawn(async move { send(main, Method::POST, "/v1/completions", &[], body).await });
    await_explained(proxy.admin, body, |json| json["all_busy"] == true).await;
    let rejected = send(proxy.main, Method::POST, "/v1/completions", &[], body).await;
    assert_eq!(rejected.status, 503);
    assert_eq!(rejected.header("retry-after"), Some("1"));
    let error = error_of(rejected).await;
    assert_eq!(error["code"], "all_instances_busy");
    release.notify_one();
    assert_eq!(first.await.unwrap().status, 200);
    let text = metrics(proxy.admin).await;
    assert!(
        text.contains("kvmesh_route_busy_rejections_total{model=\"m\"} 1"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_queue_admits_once_load_is_released_or_times_out() {
    let release = Arc::new(Notify::new());
    let backend = gated_backend(Arc::clone(&release)).await;
    let yaml = kv_yaml(
        &[&backend.url],
        None,
        "",
        "      busy_prefill_tokens: 5\n      queue:\n        max_size: 1\n        timeout: 30s\n",
    );
    let proxy = TestProxy::start(&yaml).await;
    let body = r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10]}"#;
    let main = proxy.main;
    let spawn = || {
        tokio::spawn(async move { send(main, Method::POST, "/v1/completions", &[], body).await })
    };
    let first = spawn();
    await_explained(proxy.admin, body, |json| json["all_busy"] == true).await;
    let queued = spawn();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !metrics(proxy.admin)
        .await
        .contains("kvmesh_route_queue_depth{model=\"m\"} 1")
    {
        assert!(tokio::time::Instant::now() < deadline, "never queued");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let full = send(proxy.main, Method::POST, "/v1/completions", &[], body).await;
    assert_eq!(full.status, 503, "the queue holds one request");
    // The first response releases the load; the queued request goes and is held in turn.
    release.notify_one();
    assert_eq!(first.await.unwrap().status, 200);
    await_explained(proxy.admin, body, |json| {
        json["instances"][0]["active_requests"] == 1
    })
    .await;
    release.notify_one();
    assert_eq!(queued.await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_timeout_is_503() {
    let release = Arc::new(Notify::new());
    let backend = gated_backend(Arc::clone(&release)).await;
    let yaml = kv_yaml(
        &[&backend.url],
        None,
        "",
        "      busy_prefill_tokens: 5\n      queue:\n        max_size: 4\n        timeout: 100ms\n",
    );
    let proxy = TestProxy::start(&yaml).await;
    let body = r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10]}"#;
    let main = proxy.main;
    let first =
        tokio::spawn(async move { send(main, Method::POST, "/v1/completions", &[], body).await });
    await_explained(proxy.admin, body, |json| json["all_busy"] == true).await;
    let late = send(proxy.main, Method::POST, "/v1/completions", &[], body).await;
    assert_eq!(late.status, 503);
    assert!(
        error_of(late).await["message"]
            .as_str()
            .unwrap()
            .contains("queue timeout")
    );
    release.notify_one();
    assert_eq!(first.await.unwrap().status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_releases_its_blocks() {
    let release = Arc::new(Notify::new());
    let backend = gated_backend(Arc::clone(&release)).await;
    let proxy = TestProxy::start(&kv_yaml(&[&backend.url], None, "", "")).await;
    let body = r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10]}"#;
    let main = proxy.main;
    let client =
        tokio::spawn(async move { send(main, Method::POST, "/v1/completions", &[], body).await });
    let held = await_explained(proxy.admin, body, |json| {
        json["instances"][0]["active_requests"] == 1
    })
    .await;
    // 2 full blocks and a partial one, and at most its 10 tokens still to prefill.
    assert_eq!(held["instances"][0]["active_blocks"], 3);
    let prefill = held["instances"][0]["active_prefill_tokens"]
        .as_u64()
        .unwrap();
    assert!(prefill <= 10, "{held}");
    // The engine holds it, but past its profiled prefill time (about 23 ms) it is taken to
    // be prefilled: its prefill no longer counts, its blocks do until it ends.
    let prefilled = await_explained(proxy.admin, body, |json| {
        json["instances"][0]["active_prefill_tokens"] == 0
    })
    .await;
    assert_eq!(prefilled["instances"][0]["active_requests"], 1);
    assert_eq!(prefilled["instances"][0]["active_blocks"], 3);
    client.abort();
    let released = await_explained(proxy.admin, body, |json| {
        json["instances"][0]["active_requests"] == 0
    })
    .await;
    assert_eq!(released["instances"][0]["active_blocks"], 0);
    release.notify_one();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_errors_fail_over_to_the_next_instance() {
    let live = Backend::ok().await;
    let refusing = closed_port();
    let dead = format!("http://{}", refusing.addr);
    let proxy = TestProxy::start(&kv_yaml(&[&dead, &live.url], None, "", "")).await;
    for i in 0..10u32 {
        let body = serde_json::json!({"model": "m", "prompt": [i, i + 1, i + 2, i + 3, i + 4]});
        let reply = send(
            proxy.main,
            Method::POST,
            "/v1/completions",
            &[],
            body.to_string(),
        )
        .await;
        assert_eq!(reply.status, 200, "request {i}");
        assert_eq!(reply.header("x-kvmesh-instance"), Some(live.url.as_str()));
        assert_eq!(route_field(&reply, "instance"), live.url);
    }
    assert_eq!(live.requests().len(), 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_explain_endpoint_rejects_what_it_cannot_explain() {
    let backend = Backend::ok().await;
    let yaml = format!(
        "{}  - name: plain\n    backends:\n      - url: {}\n",
        kv_yaml(&[&backend.url], None, "", "").replace("health_check:\n  enabled: false\n", ""),
        backend.url
    );
    let proxy = TestProxy::start(&yaml).await;
    let plain = explain(proxy.admin, "", r#"{"model":"plain","messages":[]}"#).await;
    assert_eq!(plain.status, 400);
    assert_eq!(error_of(plain).await["code"], "not_kv_routed");
    let unknown = explain(proxy.admin, "", r#"{"model":"nope"}"#).await;
    assert_eq!(unknown.status, 404);
    let route = explain(proxy.admin, "?route=embeddings", r#"{"model":"m"}"#).await;
    assert_eq!(route.status, 400);
    let not_json = explain(proxy.admin, "", "{").await;
    assert_eq!(not_json.status, 400);
    let get = send(proxy.admin, Method::GET, "/debug/route", &[], Bytes::new()).await;
    assert_eq!(get.status, 405);
    assert_eq!(get.header("allow"), Some("POST"));
    let completions = explain(
        proxy.admin,
        "?route=completions",
        r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8]}"#,
    )
    .await
    .json()
    .await;
    assert_eq!(completions["route"], "completions");
    assert_eq!(completions["prompt_tokens"], 8);
    assert_eq!(completions["prompt_blocks"], 2);
    assert_eq!(completions["chosen"], backend.url.as_str());
    assert!(backend.requests().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_tokenizer_stops_the_start_with_its_path() {
    let yaml = format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n{}",
        kv_yaml(
            &["http://127.0.0.1:9"],
            Some(Path::new("/nonexistent/tok")),
            "",
            ""
        )
    );
    let config = kvmesh_config::Config::from_yaml_str(&yaml, "t.yaml").unwrap();
    let error = kvmesh_proxy::Proxy::bind(config).await.unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("model \"m\"") && message.contains("/nonexistent/tok"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_tokenize_and_generate_are_routed_by_their_prompt() {
    let backends = [Backend::ok().await, Backend::ok().await];
    let urls: Vec<&str> = backends.iter().map(|b| b.url.as_str()).collect();
    let tokenizer = TokenizerDir::new("engine-routes");
    let proxy = TestProxy::start(&kv_yaml(&urls, Some(tokenizer.path()), "", "")).await;
    let json = [("content-type", "application/json")];
    let system = words(0, 40);
    let question = words(100, 10);
    let first = chat(
        proxy.main,
        &chat_body(&[("system", system.clone()), ("user", question.clone())]),
    )
    .await;
    assert_eq!(first.status, 200);
    let cached_on = first.header("x-kvmesh-instance").unwrap().to_string();
    let blocks = route_field(&first, "prompt_blocks");
    // The same conversation as a responses body renders to the same prompt: its blocks,
    // cached where the chat went.
    let responses = serde_json::json!({"model": "m", "instructions": system, "input": question});
    let reply = send(
        proxy.main,
        Method::POST,
        "/v1/responses",
        &json,
        responses.to_string(),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(route_field(&reply, "prompt_blocks"), blocks);
    assert_eq!(route_field(&reply, "overlap_blocks"), blocks);
    assert_eq!(reply.header("x-kvmesh-instance"), Some(cached_on.as_str()));
    // As a /tokenize body of the chat shape.
    let tokenize = chat_body(&[("system", system.clone()), ("user", question.clone())]);
    let reply = send(proxy.main, Method::POST, "/tokenize", &json, tokenize).await;
    assert_eq!(reply.status, 200);
    assert_eq!(route_field(&reply, "prompt_blocks"), blocks);
    assert_eq!(reply.header("x-kvmesh-instance"), Some(cached_on.as_str()));
    // Token ids of /inference/v1/generate: 10 ids, two full blocks of 4.
    let generate = r#"{"model":"m","token_ids":[9,8,7,6,5,4,3,2,1,0],"sampling_params":{}}"#;
    let reply = send(
        proxy.main,
        Method::POST,
        "/inference/v1/generate",
        &json,
        generate,
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(route_field(&reply, "prompt_blocks"), "2");
    // A responses body continuing an earlier response is routed by load.
    let follow_up = r#"{"model":"m","input":"w1 w2","previous_response_id":"resp_1"}"#;
    let reply = send(proxy.main, Method::POST, "/v1/responses", &json, follow_up).await;
    assert_eq!(reply.status, 200);
    assert_eq!(route_field(&reply, "fallback"), "no_prompt");
}
