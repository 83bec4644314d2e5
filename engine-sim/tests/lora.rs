//! LoRA adapters over real HTTP/1.1, as vLLM's OpenAI server serves them: loaded at start
//! (`lora_modules`, `--lora-modules`) and at runtime (`/v1/load_lora_adapter`), listed by
//! `/v1/models`, named by a request's `model`, each with a prefix cache of its own.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvmesh_engine_sim::{EngineHandle, KvEvent, KvEventBatch, Lora, LoraModule, SimConfig, spawn};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::broadcast;
use tokio::time::timeout;

const WAIT: Duration = Duration::from_secs(5);

struct Reply {
    status: StatusCode,
    content_type: Option<String>,
    body: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
}

async fn request(addr: SocketAddr, method: Method, path: &str, body: Option<Value>) -> Reply {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let payload = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "sim")
        .header("content-type", "application/json")
        .body(Full::new(payload))
        .expect("request");
    let res = timeout(WAIT, sender.send_request(req))
        .await
        .expect("a response in time")
        .expect("response");
    let status = res.status();
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let body = timeout(WAIT, res.into_body().collect())
        .await
        .expect("the body in time")
        .expect("body")
        .to_bytes();
    Reply {
        status,
        content_type,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> Reply {
    request(addr, Method::POST, path, Some(body)).await
}

/// `/v1/models` as `(id, root, parent)`, in order.
async fn models(addr: SocketAddr) -> Vec<(String, String, Value)> {
    let list = request(addr, Method::GET, "/v1/models", None).await.json();
    list["data"]
        .as_array()
        .expect("data")
        .iter()
        .map(|m| {
            (
                m["id"].as_str().expect("id").to_owned(),
                m["root"].as_str().expect("root").to_owned(),
                m["parent"].clone(),
            )
        })
        .collect()
}

/// A one-token completion of `prompt` for `model`; returns the response JSON.
async fn complete(addr: SocketAddr, model: &str, prompt: &[u32]) -> Value {
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": model, "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    r.json()
}

fn cached_tokens(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {response}"))
}

/// The `data:` payloads of an SSE body, `[DONE]` excluded.
fn sse_json(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).expect("JSON chunk"))
        .collect()
}

/// Value of the metric line `name{...} value`.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

fn module(name: &str, path: &str) -> LoraModule {
    LoraModule {
        name: name.to_owned(),
        path: path.to_owned(),
    }
}

async fn engine(config: SimConfig) -> EngineHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    spawn(
        SimConfig {
            no_delay: true,
            block_size: 16,
            prompt_tokens_details: true,
            ..config
        },
        listener,
    )
    .await
    .expect("spawn")
}

/// The adapters of the next `BlockStored` events, in order, until `count` were seen.
async fn stored_loras(
    events: &mut broadcast::Receiver<Arc<KvEventBatch>>,
    count: usize,
) -> Vec<Option<Lora>> {
    let mut out = Vec::new();
    while out.len() < count {
        let batch = timeout(WAIT, events.recv())
            .await
            .expect("a KV event batch in time")
            .expect("batch");
        for event in &batch.events {
            if let KvEvent::BlockStored { lora, .. } = event {
                out.push(lora.clone());
            }
        }
    }
    out
}

#[tokio::test]
async fn adapters_load_list_serve_and_keep_their_own_cache() {
    let engine = engine(SimConfig {
        lora_modules: vec![module("sql", "/adapters/sql")],
        ..SimConfig::default()
    })
    .await;
    let addr = engine.local_addr();
    let mut events = engine.subscribe_kv_events();

    // Loaded at start: listed after the base model, the way vLLM lists adapters.
    let list = request(addr, Method::GET, "/v1/models", None).await.json();
    let data = list["data"].as_array().expect("data");
    assert_eq!(data.len(), 2, "{list}");
    assert_eq!(data[0]["id"], "sim-model");
    assert_eq!(data[0]["parent"], Value::Null);
    assert_eq!(
        data[1],
        json!({
            "id": "sql",
            "object": "model",
            "created": data[0]["created"],
            "owned_by": "vllm",
            "root": "/adapters/sql",
            "parent": "sim-model",
            "max_model_len": null,
        })
    );

    // Loaded at runtime.
    let r = post(
        addr,
        "/v1/load_lora_adapter",
        json!({"lora_name": "chat", "lora_path": "/adapters/chat"}),
    )
    .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (
            StatusCode::OK,
            "Success: LoRA adapter 'chat' added successfully."
        )
    );
    assert_eq!(r.content_type.as_deref(), Some("text/plain; charset=utf-8"));
    let parent = json!("sim-model");
    assert_eq!(
        models(addr).await,
        vec![
            ("sim-model".to_owned(), "sim-model".to_owned(), Value::Null),
            ("sql".to_owned(), "/adapters/sql".to_owned(), parent.clone()),
            ("chat".to_owned(), "/adapters/chat".to_owned(), parent),
        ]
    );

    // An adapter serves under its own name, and only its own earlier blocks are cache hits:
    // 40 prompt tokens, blocks of 16, so a repeat hits two blocks (32 tokens).
    let prompt: Vec<u32> = (500..540).collect();
    let first = complete(addr, "sql", &prompt).await;
    assert_eq!(first["model"], "sql");
    assert_eq!(cached_tokens(&first), 0);
    assert_eq!(cached_tokens(&complete(addr, "sql", &prompt).await), 32);
    let base = complete(addr, "sim-model", &prompt).await;
    assert_eq!(base["model"], "sim-model");
    assert_eq!(
        cached_tokens(&base),
        0,
        "only the adapter ran this prompt before"
    );
    assert_eq!(cached_tokens(&complete(addr, "chat", &prompt).await), 0);
    assert_eq!(
        cached_tokens(&complete(addr, "sim-model", &prompt).await),
        32
    );
    let metrics = request(addr, Method::GET, "/metrics", None).await.body;
    assert_eq!(metric(&metrics, "vllm:prefix_cache_queries_total"), 200.0);
    assert_eq!(metric(&metrics, "vllm:prefix_cache_hits_total"), 64.0);

    // The stores name their adapter (vLLM's lora_id counts loads from 1); base blocks none.
    let sql = Lora {
        id: 1,
        name: "sql".into(),
    };
    let chat = Lora {
        id: 2,
        name: "chat".into(),
    };
    assert_eq!(
        stored_loras(&mut events, 3).await,
        vec![Some(sql), None, Some(chat)]
    );

    // Streams and chat echo the adapter too.
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": "chat", "prompt": prompt, "max_tokens": 3, "stream": true,
               "stream_options": {"include_usage": true}}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    let chunks = sse_json(&r.body);
    assert!(chunks.len() >= 2, "{}", r.body);
    assert!(chunks.iter().all(|c| c["model"] == "chat"), "{}", r.body);
    let usage = &chunks.last().expect("usage chunk")["usage"];
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 32);
    let messages = json!([{"role": "user", "content": "Hello adapter"}]);
    let r = post(
        addr,
        "/v1/chat/completions",
        json!({"model": "sql", "messages": messages, "max_tokens": 2}),
    )
    .await;
    assert_eq!(
        (r.status, &r.json()["model"]),
        (StatusCode::OK, &json!("sql"))
    );
    let r = post(
        addr,
        "/v1/chat/completions",
        json!({"model": "sql", "messages": messages, "max_tokens": 2, "stream": true}),
    )
    .await;
    let chunks = sse_json(&r.body);
    assert!(!chunks.is_empty(), "{}", r.body);
    assert!(chunks.iter().all(|c| c["model"] == "sql"), "{}", r.body);

    // Anything else is vLLM's 404.
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": "nope", "prompt": "x"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(
        r.json()["error"]["message"],
        "The model `nope` does not exist."
    );

    // Unloaded: gone from the list and from serving; a second unload is a 404.
    let r = post(
        addr,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "chat"}),
    )
    .await;
    assert_eq!(
        (r.status, r.body.as_str()),
        (
            StatusCode::OK,
            "Success: LoRA adapter 'chat' removed successfully."
        )
    );
    assert_eq!(models(addr).await.len(), 2);
    let r = post(
        addr,
        "/v1/completions",
        json!({"model": "chat", "prompt": "x"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::NOT_FOUND);
    assert_eq!(
        r.json()["error"]["message"],
        "The model `chat` does not exist."
    );
    engine.stop().await;
}

#[tokio::test]
async fn load_and_unload_refusals_are_vllms() {
    let engine = engine(SimConfig {
        enable_lora: true,
        ..SimConfig::default()
    })
    .await;
    let addr = engine.local_addr();
    let load = |body: Value| post(addr, "/v1/load_lora_adapter", body);
    let r = load(json!({"lora_name": "a", "lora_path": "/a"})).await;
    assert_eq!(r.status, StatusCode::OK);
    let cases = [
        (
            load(json!({"lora_name": "a", "lora_path": "/b"})).await,
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "The lora adapter 'a' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.",
        ),
        (
            load(json!({"lora_name": "", "lora_path": "/b"})).await,
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        (
            post(addr, "/v1/unload_lora_adapter", json!({"lora_name": "b"})).await,
            StatusCode::NOT_FOUND,
            "NotFoundError",
            "The lora adapter 'b' cannot be found.",
        ),
        (
            post(addr, "/v1/unload_lora_adapter", json!({"lora_name": ""})).await,
            StatusCode::BAD_REQUEST,
            "InvalidUserInput",
            "'lora_name' needs to be provided to unload a LoRA adapter.",
        ),
    ];
    for (reply, status, kind, message) in cases {
        let v = reply.json();
        assert_eq!(
            (reply.status, &v["error"]["type"], &v["error"]["message"]),
            (status, &json!(kind), &json!(message)),
            "{v}"
        );
        assert_eq!(v["error"]["code"], status.as_u16());
    }
    // A body without the required fields is a 400, as vLLM's validation answers.
    assert_eq!(
        load(json!({"lora_name": "c"})).await.status,
        StatusCode::BAD_REQUEST
    );
    // In place: reloaded from the new path under the same name.
    let r = load(json!({"lora_name": "a", "lora_path": "/a2", "load_inplace": true})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.body);
    assert_eq!(models(addr).await[1].1, "/a2");
    engine.stop().await;

    // Without --enable-lora (and without --lora-modules) nothing loads.
    let engine = self::engine(SimConfig::default()).await;
    let r = post(
        engine.local_addr(),
        "/v1/load_lora_adapter",
        json!({"lora_name": "a", "lora_path": "/a"}),
    )
    .await;
    assert_eq!(r.status, StatusCode::BAD_REQUEST);
    assert_eq!(
        r.json()["error"]["message"],
        "LoRA is not enabled. Start the engine with --enable-lora."
    );
    assert_eq!(models(engine.local_addr()).await.len(), 1);
    engine.stop().await;
}

/// Kills the child process when dropped.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn binary_takes_vllms_lora_modules_forms() {
    let child = Command::new(env!("CARGO_BIN_EXE_kvmesh-engine-sim"))
        .args([
            "--port",
            "0",
            "--no-delay",
            "--lora-modules",
            "sql=/adapters/sql",
            r#"{"name": "chat", "path": "/adapters/chat", "base_model_name": "sim-model"}"#,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the binary");
    let mut running = Running(child);
    let stdout = running.0.stdout.take().expect("stdout");
    let addr = tokio::task::spawn_blocking(move || {
        let mut addr = None;
        for line in BufReader::new(stdout).lines() {
            let line = line.expect("utf-8 line");
            if line == "READY" {
                return addr;
            }
            if let Some(rest) = line.strip_prefix("LISTENING engine-0 ") {
                addr = rest.parse::<SocketAddr>().ok();
            }
        }
        None
    });
    let addr = timeout(Duration::from_secs(30), addr)
        .await
        .expect("READY in time")
        .expect("reader")
        .expect("engine-0 address");
    let ids: Vec<String> = models(addr).await.into_iter().map(|m| m.0).collect();
    assert_eq!(ids, ["sim-model", "sql", "chat"]);
    assert_eq!(complete(addr, "chat", &[1, 2, 3]).await["model"], "chat");
}
