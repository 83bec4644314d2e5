//! Drives an in-process engine over real HTTP/1.1 and h2c connections.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvmesh_engine_sim::{EngineHandle, KvEvent, Medium, SimConfig, spawn, spawn_engines};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Proto {
    H1,
    H2,
}

struct Reply {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

async fn request(
    proto: Proto,
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Option<Value>,
    headers: &[(&str, &str)],
) -> Reply {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let io = TokioIo::new(stream);
    let mut builder = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let payload = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let req = builder
        .header("content-type", "application/json")
        .body(Full::new(payload))
        .expect("request");
    let res = match proto {
        Proto::H1 => {
            let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .expect("h1 handshake");
            tokio::spawn(conn);
            sender.send_request(req).await.expect("h1 response")
        }
        Proto::H2 => {
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                    .await
                    .expect("h2 handshake");
            tokio::spawn(conn);
            sender.send_request(req).await.expect("h2 response")
        }
    };
    let status = res.status();
    let headers = res.headers().clone();
    let body = res.into_body().collect().await.expect("body").to_bytes();
    Reply {
        status,
        headers,
        body,
    }
}

async fn post(proto: Proto, addr: SocketAddr, path: &str, body: Value) -> Reply {
    request(proto, addr, Method::POST, path, Some(body), &[]).await
}

async fn get(addr: SocketAddr, path: &str) -> Reply {
    request(Proto::H1, addr, Method::GET, path, None, &[]).await
}

async fn engine(config: SimConfig) -> EngineHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    spawn(config, listener).await.expect("spawn")
}

fn fast() -> SimConfig {
    SimConfig {
        no_delay: true,
        block_size: 16,
        ..SimConfig::default()
    }
}

/// Value of an unlabelled-by-reason metric line `name{...} value`.
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(&format!("{name}{{")))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("metric {name} missing"))
}

/// Parses an SSE body into its `data:` payloads.
fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad frame {e:?}"))
                .to_owned()
        })
        .collect()
}

#[tokio::test]
async fn completion_over_http1_and_h2c() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let body = json!({"model": "sim-model", "prompt": "Hello there, engine", "max_tokens": 5});
    let mut texts = Vec::new();
    for proto in [Proto::H1, Proto::H2] {
        let r = post(proto, addr, "/v1/completions", body.clone()).await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        assert_eq!(r.headers["x-engine-id"], addr.to_string().as_str());
        let v = r.json();
        assert_eq!(v["object"], "text_completion");
        assert!(v["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")));
        assert_eq!(v["model"], "sim-model");
        assert_eq!(v["choices"][0]["index"], 0);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 5);
        assert_eq!(v["usage"]["prompt_tokens"], 4);
        assert_eq!(v["usage"]["total_tokens"], 9);
        texts.push(
            v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
        );
    }
    assert_eq!(texts[0], texts[1], "same prompt, same text");
    assert_eq!(texts[0].split(' ').count(), 5);
    engine.stop().await;
}

#[tokio::test]
async fn echo_puts_a_text_prompt_before_the_generated_text_as_vllm_does() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let plain = json!({"prompt": "Hello there, engine", "max_tokens": 4});
    let generated = post(Proto::H1, addr, "/v1/completions", plain.clone())
        .await
        .json()["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_owned();
    let mut echoed = plain.clone();
    echoed["echo"] = json!(true);
    let whole = post(Proto::H1, addr, "/v1/completions", echoed.clone())
        .await
        .json();
    assert_eq!(
        whole["choices"][0]["text"],
        format!("Hello there, engine{generated}")
    );
    assert_eq!(whole["usage"]["completion_tokens"], 4);
    // Streamed: the first chunk carries the prompt and the first token's text.
    echoed["stream"] = json!(true);
    let events = sse_events(
        &post(Proto::H1, addr, "/v1/completions", echoed)
            .await
            .text(),
    );
    let texts: Vec<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(texts.len(), 4, "{texts:?}");
    assert!(texts[0].starts_with("Hello there, engine") && texts[0].len() > 19);
    assert_eq!(texts.concat(), format!("Hello there, engine{generated}"));
    let ids = json!({"prompt": [1, 2, 3], "max_tokens": 2, "echo": true});
    let refused = post(Proto::H1, addr, "/v1/completions", ids).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert_eq!(refused.json()["error"]["param"], "echo");
    engine.stop().await;
}

#[tokio::test]
async fn multiple_prompts_give_one_choice_each() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    for prompt in [json!(["a b", "c d e"]), json!([[1, 2, 3], [4, 5]])] {
        let r = post(
            Proto::H1,
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.text());
        let v = r.json();
        let choices = v["choices"].as_array().expect("choices");
        assert_eq!(choices.len(), 2);
        assert_eq!(
            (choices[0]["index"].clone(), choices[1]["index"].clone()),
            (json!(0), json!(1))
        );
        assert_eq!(v["usage"]["prompt_tokens"], 5);
        assert_eq!(v["usage"]["completion_tokens"], 4);
    }
    engine.stop().await;
}

#[tokio::test]
async fn n_gives_each_prompt_its_choices_with_the_prompt_counted_once() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let ask = |body: Value| post(Proto::H1, addr, "/v1/completions", body);
    let one = ask(json!({"prompt": "a b", "max_tokens": 4})).await.json();
    let r = ask(json!({"prompt": ["a b", "c d e"], "n": 2, "max_tokens": 4})).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let v = r.json();
    let texts: Vec<&str> = v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .enumerate()
        .map(|(i, c)| {
            assert_eq!(c["index"], i);
            c["text"].as_str().unwrap()
        })
        .collect();
    assert_eq!(texts.len(), 4, "two choices per prompt");
    assert_eq!(
        texts[0], one["choices"][0]["text"],
        "choice 0 is what n: 1 writes"
    );
    assert_ne!(texts[0], texts[1], "each choice its own words");
    assert_eq!(v["usage"]["prompt_tokens"], 5, "each prompt once");
    assert_eq!(v["usage"]["completion_tokens"], 16);

    // Streamed chat: each choice opens with its role, and ends with its finish.
    let r = post(
        Proto::H1,
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 2,
               "stream": true, "stream_options": {"include_usage": true}}),
    )
    .await;
    let events = sse_events(&r.text());
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for index in 0..3 {
        let mine: Vec<&Value> = chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().unwrap())
            .filter(|c| c["index"] == index)
            .collect();
        assert_eq!(mine[0]["delta"]["role"], "assistant", "choice {index}");
        assert_eq!(
            mine.len(),
            3,
            "choice {index}: role, a token, the last token"
        );
        assert!(!mine[2]["finish_reason"].is_null());
    }
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], 6, "{usage}");
    for bad in [0, 17] {
        let r = ask(json!({"prompt": "a", "n": bad})).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "n {bad}");
        assert_eq!(r.json()["error"]["param"], "n");
    }
    engine.stop().await;
}

#[tokio::test]
async fn chat_streams_over_h2c_with_usage() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let body = json!({
        "model": "sim-model",
        "messages": [{"role": "user", "content": "Tell me something"}],
        "max_completion_tokens": 4,
        "stream": true,
        "stream_options": {"include_usage": true}
    });
    for proto in [Proto::H2, Proto::H1] {
        let r = post(proto, addr, "/v1/chat/completions", body.clone()).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.headers["content-type"], "text/event-stream");
        assert!(r.headers.contains_key("x-engine-id"));
        let events = sse_events(&r.text());
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).expect("chunk json"))
            .collect();
        assert!(
            chunks
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk")
        );
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let usage = chunks.last().expect("usage chunk");
        assert_eq!(usage["choices"].as_array().map(Vec::len), Some(0));
        assert_eq!(usage["usage"]["completion_tokens"], 4);
        let content_chunks = &chunks[1..chunks.len() - 1];
        let last = content_chunks.last().expect("content");
        assert_eq!(last["choices"][0]["finish_reason"], "length");
        assert!(
            content_chunks[..content_chunks.len() - 1]
                .iter()
                .all(|c| c["choices"][0]["finish_reason"].is_null())
        );
        let text: String = content_chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text.split(' ').count(), 4);

        // The same request without streaming yields the same text.
        let mut plain = body.clone();
        plain["stream"] = json!(false);
        plain.as_object_mut().map(|o| o.remove("stream_options"));
        let v = post(proto, addr, "/v1/chat/completions", plain)
            .await
            .json();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], text.as_str());
    }
    engine.stop().await;
}

#[tokio::test]
async fn completion_stream_and_stop_strings() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let full = post(
        Proto::H1,
        addr,
        "/v1/completions",
        json!({"prompt": [5, 6, 7], "max_tokens": 8}),
    )
    .await
    .json();
    let full = full["choices"][0]["text"]
        .as_str()
        .expect("text")
        .to_owned();
    let words: Vec<&str> = full.split(' ').collect();
    let stop = format!("{} {}", words[2], words[3]);
    let body = json!({"prompt": [5, 6, 7], "max_tokens": 8, "stream": true, "stop": [stop]});
    let r = post(Proto::H1, addr, "/v1/completions", body).await;
    let events = sse_events(&r.text());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("json"))
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert!(
        full.starts_with(&text) && !text.contains(&stop),
        "{text:?} vs {full:?}"
    );
    let last = chunks.last().expect("last");
    assert_eq!(last["choices"][0]["finish_reason"], "stop");
    assert_eq!(last["choices"][0]["stop_reason"], stop.as_str());
    assert!(last.get("usage").is_none());
    engine.stop().await;
}

#[tokio::test]
async fn repeated_prompt_registers_prefix_cache_hits() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let metrics = |t: &str| {
        (
            metric(t, "vllm:prefix_cache_queries_total"),
            metric(t, "vllm:prefix_cache_hits_total"),
        )
    };
    // 40 tokens with block size 16: two full blocks are reusable.
    let prompt: Vec<u32> = (1000..1040).collect();
    let before = metrics(&get(addr, "/metrics").await.text());
    for proto in [Proto::H1, Proto::H2] {
        let r = post(
            proto,
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(r.status, StatusCode::OK);
    }
    let after = metrics(&get(addr, "/metrics").await.text());
    assert_eq!(after.0 - before.0, 80.0);
    assert_eq!(after.1 - before.1, 32.0);

    // An exact multiple of the block size hits one block less.
    let prompt: Vec<u32> = (2000..2048).collect();
    for _ in 0..2 {
        post(
            Proto::H1,
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await;
    }
    let last = metrics(&get(addr, "/metrics").await.text());
    assert_eq!(last.1 - after.1, 32.0);

    let text = get(addr, "/metrics").await.text();
    assert_eq!(metric(&text, "vllm:num_requests_running"), 0.0);
    assert_eq!(metric(&text, "vllm:num_requests_waiting"), 0.0);
    assert_eq!(metric(&text, "vllm:prompt_tokens_total"), 80.0 + 96.0);
    assert_eq!(metric(&text, "vllm:generation_tokens_total"), 4.0 + 2.0);
    assert_eq!(metric(&text, "vllm:time_to_first_token_seconds_count"), 4.0);
    assert!(text.contains("vllm:request_success_total{engine=\"0\",model_name=\"sim-model\",finished_reason=\"length\"} 4"));

    // Resetting the cache removes the hits.
    let r = request(
        Proto::H1,
        addr,
        Method::POST,
        "/reset_prefix_cache",
        None,
        &[],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    post(
        Proto::H1,
        addr,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    let reset = metrics(&get(addr, "/metrics").await.text());
    assert_eq!(reset.1, last.1);
    engine.stop().await;
}

#[tokio::test]
async fn usage_reports_cached_prompt_tokens_when_asked() {
    // 40 token ids with block size 16: the second time, two full blocks (32 tokens) hit.
    let prompt: Vec<u32> = (2000..2040).collect();
    let sim = engine(SimConfig {
        prompt_tokens_details: true,
        ..fast()
    })
    .await;
    let addr = sim.local_addr();
    let mut cached = Vec::new();
    for _ in 0..2 {
        let v = post(
            Proto::H1,
            addr,
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1}),
        )
        .await
        .json();
        assert_eq!(v["usage"]["prompt_tokens"], 40);
        cached.push(v["usage"]["prompt_tokens_details"]["cached_tokens"].clone());
    }
    assert_eq!(cached, [json!(0), json!(32)]);
    let r = post(
        Proto::H1,
        addr,
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 2, "stream": true,
               "stream_options": {"include_usage": true}}),
    )
    .await;
    let usage: Vec<Value> = sse_events(&r.text())
        .iter()
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str::<Value>(data).expect("json event"))
        .filter(|event| !event["usage"].is_null())
        .map(|event| event["usage"].clone())
        .collect();
    assert_eq!(usage.len(), 1, "{usage:?}");
    assert_eq!(usage[0]["prompt_tokens_details"]["cached_tokens"], 32);
    sim.stop().await;

    // Without the flag (vLLM's default) the field is absent.
    let sim = engine(fast()).await;
    let v = post(
        Proto::H1,
        sim.local_addr(),
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await
    .json();
    assert_eq!(v["usage"]["prompt_tokens"], 40);
    assert!(v["usage"].get("prompt_tokens_details").is_none(), "{v}");
    sim.stop().await;
}

#[tokio::test]
async fn kv_events_announce_stored_blocks() {
    let engine = engine(fast()).await;
    let mut events = engine.subscribe_kv_events();
    let prompt: Vec<u32> = (0..40).collect();
    post(
        Proto::H1,
        engine.local_addr(),
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 1}),
    )
    .await;
    let batch = tokio::time::timeout(Duration::from_secs(5), events.recv())
        .await
        .expect("event")
        .expect("batch");
    match &batch.events[0] {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora,
            cache_salt,
            medium,
        } => {
            assert_eq!(*medium, Medium::Gpu);
            assert_eq!(block_hashes.len(), 2);
            assert_eq!(*parent_block_hash, None);
            assert_eq!(token_ids[..], prompt[..32]);
            assert_eq!(*block_size, 16);
            assert_eq!(*lora, None, "base-model blocks carry no adapter");
            assert_eq!(*cache_salt, None);
        }
        other => panic!("unexpected {other:?}"),
    }
    engine.stop().await;
}

/// vLLM's `cache_salt`: the prompt is cached apart per salt (`cached_tokens` 0 for another
/// salt or none, all full blocks but the last token's for the same salt), the store of its
/// first block names the salt, and a bad salt is a 400 as in vLLM.
#[tokio::test]
async fn cache_salt_keeps_prompts_apart() {
    let mut cfg = fast();
    cfg.prompt_tokens_details = true;
    let engine = engine(cfg).await;
    let mut events = engine.subscribe_kv_events();
    let prompt: Vec<u32> = (0..40).collect();
    let cached = |salt: Option<&str>| {
        let mut body = json!({"prompt": prompt, "max_tokens": 1});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        let addr = engine.local_addr();
        async move {
            let v = post(Proto::H1, addr, "/v1/completions", body).await.json();
            v["usage"]["prompt_tokens_details"]["cached_tokens"].clone()
        }
    };
    assert_eq!(cached(Some("tenant-a")).await, 0);
    assert_eq!(cached(Some("tenant-b")).await, 0);
    assert_eq!(cached(None).await, 0);
    assert_eq!(cached(Some("tenant-a")).await, 32);
    assert_eq!(cached(None).await, 32);
    let mut salts = Vec::new();
    while salts.len() < 3 {
        let batch = tokio::time::timeout(Duration::from_secs(5), events.recv())
            .await
            .expect("event")
            .expect("batch");
        for event in &batch.events {
            if let KvEvent::BlockStored { cache_salt, .. } = event {
                salts.push(cache_salt.as_deref().map(str::to_owned));
            }
        }
    }
    assert_eq!(
        salts,
        vec![
            Some("tenant-a".to_owned()),
            Some("tenant-b".to_owned()),
            None
        ]
    );
    for bad in [json!(""), json!("a/b"), json!(5)] {
        let res = post(
            Proto::H1,
            engine.local_addr(),
            "/v1/completions",
            json!({"prompt": prompt, "max_tokens": 1, "cache_salt": bad}),
        )
        .await;
        assert_eq!(res.status, 400, "{bad}");
    }
    engine.stop().await;
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let engine = engine(SimConfig {
        max_model_len: 64,
        ..fast()
    })
    .await;
    let addr = engine.local_addr();
    let cases = [
        (
            "/v1/completions",
            json!("not an object"),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/completions",
            json!({"model": "sim-model"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/completions",
            json!({"prompt": ["x", 1]}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/completions",
            json!({"prompt": []}),
            StatusCode::BAD_REQUEST,
        ),
        // A prompt that leaves no room for one token (vLLM 0.32's `input_tokens` error).
        (
            "/v1/completions",
            json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 1}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": []}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "model": "other"}),
            StatusCode::NOT_FOUND,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": "hi"}),
            StatusCode::BAD_REQUEST,
        ),
        (
            "/v1/embeddings",
            json!({"input": []}),
            StatusCode::BAD_REQUEST,
        ),
        ("/v1/nope", json!({}), StatusCode::NOT_FOUND),
    ];
    for (path, body, status) in cases {
        let r = post(Proto::H1, addr, path, body.clone()).await;
        assert_eq!(r.status, status, "{path} {body}: {}", r.text());
        let v = r.json();
        assert_eq!(v["error"]["code"], status.as_u16(), "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
        assert!(v["error"]["type"].is_string());
        assert!(v["error"].get("param").is_some());
        assert!(r.headers.contains_key("x-engine-id"));
    }
    // As vLLM 0.32: the too-long prompt's error names `input_tokens`; a `max_tokens` past the
    // context length is not refused, the sequence stops there.
    let r = post(
        Proto::H1,
        addr,
        "/v1/completions",
        json!({"prompt": (0..64).collect::<Vec<u32>>()}),
    )
    .await;
    assert_eq!(r.json()["error"]["param"], "input_tokens");
    let r = post(
        Proto::H1,
        addr,
        "/v1/completions",
        json!({"prompt": (0..60).collect::<Vec<u32>>(), "max_tokens": 10}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    // Raw invalid JSON.
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let req = Request::post("/v1/chat/completions")
        .header("host", "x")
        .body(Full::new(Bytes::from("{oops")))
        .expect("req");
    let res = sender.send_request(req).await.expect("response");
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);

    let r = request(Proto::H1, addr, Method::GET, "/v1/completions", None, &[]).await;
    assert_eq!(r.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.headers["allow"], "POST");
    engine.stop().await;
}

#[tokio::test]
async fn test_hooks_delay_and_fail() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let started = Instant::now();
    let r = request(
        Proto::H1,
        addr,
        Method::GET,
        "/health",
        None,
        &[("x-sim-delay-ms", "150")],
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_millis(150));
    let r = request(
        Proto::H2,
        addr,
        Method::POST,
        "/v1/completions",
        Some(json!({"prompt": "x"})),
        &[("x-sim-status", "503")],
    )
    .await;
    assert_eq!(r.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(r.json()["error"]["code"], 503);
    engine.stop().await;
}

#[tokio::test]
async fn embeddings_are_deterministic() {
    let engine = engine(SimConfig {
        embedding_dim: 8,
        ..fast()
    })
    .await;
    let addr = engine.local_addr();
    let body = json!({"model": "sim-model", "input": ["alpha beta", "gamma"]});
    let a = post(Proto::H1, addr, "/v1/embeddings", body.clone())
        .await
        .json();
    let b = post(Proto::H2, addr, "/v1/embeddings", body).await.json();
    assert_eq!(a["object"], "list");
    assert_eq!(a["data"], b["data"]);
    assert_eq!(a["data"].as_array().map(Vec::len), Some(2));
    let v: Vec<f64> = a["data"][0]["embedding"]
        .as_array()
        .expect("floats")
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    assert_eq!(v.len(), 8);
    assert!((v.iter().map(|x| x * x).sum::<f64>() - 1.0).abs() < 1e-4);
    assert_eq!(a["usage"]["prompt_tokens"], 3);
    let c = post(
        Proto::H1,
        addr,
        "/v1/embeddings",
        json!({"input": [[1, 2], [3]], "encoding_format": "base64"}),
    )
    .await
    .json();
    assert!(c["data"][1]["embedding"].is_string());
    engine.stop().await;
}

#[tokio::test]
async fn info_endpoints() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let models = get(addr, "/v1/models").await.json();
    assert_eq!(models["data"][0]["id"], "sim-model");
    assert_eq!(models["data"][0]["max_model_len"], 131_072);
    for path in ["/health", "/healthz", "/readiness", "/health_generate"] {
        assert_eq!(get(addr, path).await.status, StatusCode::OK, "{path}");
    }
    for path in [
        "/get_server_info",
        "/server_info",
        "/get_model_info",
        "/model_info",
    ] {
        let v = get(addr, path).await.json();
        assert!(
            v.get("model_path").is_none() && v.get("tokenizer_path").is_none(),
            "{path}: {v}"
        );
        assert_eq!(v["block_size"], 16);
    }
    let metrics = get(addr, "/metrics").await;
    assert!(
        metrics.headers["content-type"]
            .to_str()
            .is_ok_and(|c| c.starts_with("text/plain"))
    );
    for name in [
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_sum",
    ] {
        assert!(metrics.text().contains(name), "{name}");
    }
    engine.stop().await;
}

#[tokio::test]
async fn sglang_generate() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let v = post(
        Proto::H1,
        addr,
        "/generate",
        json!({"text": "hi there", "sampling_params": {"max_new_tokens": 3}}),
    )
    .await
    .json();
    assert_eq!(v["meta_info"]["completion_tokens"], 3);
    assert_eq!(v["meta_info"]["finish_reason"]["type"], "length");
    let r = post(
        Proto::H1,
        addr,
        "/generate",
        json!({"input_ids": [1, 2, 3], "stream": true, "sampling_params": {"max_new_tokens": 3}}),
    )
    .await;
    let events = sse_events(&r.text());
    assert_eq!(events.len(), 4);
    let last: Value = serde_json::from_str(&events[2]).expect("json");
    assert_eq!(last["text"].as_str().map(|t| t.split(' ').count()), Some(3));
    let batch = post(
        Proto::H1,
        addr,
        "/generate",
        json!({"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 1}}),
    )
    .await
    .json();
    assert_eq!(batch.as_array().map(Vec::len), Some(2));
    engine.stop().await;
}

#[tokio::test]
async fn timing_model_paces_tokens() {
    // Real time: prefill(3 tokens) ≈ 16.5 ms plus 4 decode steps of ≈ 5.74 ms each.
    let engine = engine(SimConfig {
        block_size: 16,
        ..SimConfig::default()
    })
    .await;
    let started = Instant::now();
    let r = post(
        Proto::H1,
        engine.local_addr(),
        "/v1/completions",
        json!({"prompt": [1, 2, 3], "max_tokens": 4}),
    )
    .await;
    assert_eq!(r.status, StatusCode::OK);
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(35), "{elapsed:?}");
    let text = get(engine.local_addr(), "/metrics").await.text();
    assert!(metric(&text, "vllm:time_to_first_token_seconds_sum") >= 0.022);
    engine.stop().await;
}

#[tokio::test]
async fn several_engines_on_free_ports() {
    let engines = spawn_engines(&fast(), IpAddr::V4(Ipv4Addr::LOCALHOST), 0, 2)
        .await
        .expect("spawn");
    let (a, b) = (engines[0].local_addr(), engines[1].local_addr());
    assert_ne!(a, b);
    for (i, addr) in [a, b].into_iter().enumerate() {
        let r = get(addr, "/health").await;
        assert_eq!(r.headers["x-engine-id"], addr.to_string().as_str());
        let metrics = get(addr, "/metrics").await.text();
        let label = format!("vllm:num_requests_running{{engine=\"{i}\",model_name=\"sim-model\"}}");
        assert!(metrics.contains(&label), "engine {i}: {metrics}");
    }
    for e in engines {
        e.stop().await;
    }
    assert!(
        TcpStream::connect(a).await.is_err(),
        "stopped engine still accepts"
    );
}

#[tokio::test]
async fn dropped_stream_frees_its_sequence() {
    // Real time: 1,000 tokens would take seconds; the client leaves after the first chunk.
    let engine = engine(SimConfig {
        block_size: 16,
        ..SimConfig::default()
    })
    .await;
    let addr = engine.local_addr();
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    let conn_task = tokio::spawn(conn);
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 1000, "stream": true}).to_string();
    let req = Request::post("/v1/completions")
        .header("host", "sim")
        .body(Full::new(Bytes::from(body)))
        .expect("req");
    let mut res = sender.send_request(req).await.expect("response");
    let first = res
        .body_mut()
        .frame()
        .await
        .expect("a frame")
        .expect("frame ok");
    assert!(first.data_ref().is_some_and(|d| d.starts_with(b"data: ")));
    let running = metric(
        &get(addr, "/metrics").await.text(),
        "vllm:num_requests_running",
    );
    assert_eq!(running, 1.0);
    drop(res);
    drop(sender);
    conn_task.abort();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let text = get(addr, "/metrics").await.text();
        if metric(&text, "vllm:num_requests_running") == 0.0 {
            assert_eq!(metric(&text, "vllm:kv_cache_usage_perc"), 0.0);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sequence still running after the client left"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    engine.stop().await;
}

#[tokio::test]
async fn configured_tokenizer_is_used_and_reported() {
    let dir = std::env::temp_dir().join(format!("kvmesh-sim-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("tokenizer.json");
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 3, "content": "<|im_start|>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<|im_start|>": 3},
                  "unk_token": "[UNK]"}
    });
    std::fs::write(&path, tokenizer.to_string()).expect("write tokenizer");
    let engine = engine(SimConfig {
        tokenizer: Some(path.clone()),
        ..fast()
    })
    .await;
    let addr = engine.local_addr();
    let v = post(
        Proto::H1,
        addr,
        "/v1/completions",
        json!({"prompt": "hello world hello", "max_tokens": 1}),
    )
    .await
    .json();
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    let info = get(addr, "/get_model_info").await.json();
    assert_eq!(info["model_path"], dir.display().to_string().as_str());
    assert_eq!(info["tokenizer_path"], dir.display().to_string().as_str());
    engine.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    let bad = SimConfig {
        tokenizer: Some(dir.join("missing.json")),
        ..fast()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    assert!(spawn(bad, listener).await.is_err());
}

/// Parses an SSE body of named events into `(event name, JSON data)` pairs.
fn named_sse_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("bad frame {e:?}"));
            let data = serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}"));
            (name.to_owned(), data)
        })
        .collect()
}

#[tokio::test]
async fn responses_api_plain_and_streaming() {
    let engine = engine(fast()).await;
    let addr = engine.local_addr();
    let body = json!({
        "model": "sim-model",
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Tell me something"}]}],
        "max_output_tokens": 4
    });
    let r = post(Proto::H1, addr, "/v1/responses", body.clone()).await;
    assert_eq!(r.status, StatusCode::OK, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().is_some_and(|id| id.starts_with("resp_")));
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["model"], "sim-model");
    assert!(v["created_at"].is_u64());
    assert_eq!(v["instructions"], "Be brief.");
    assert_eq!(v["max_output_tokens"], 4);
    let message = &v["output"][0];
    assert_eq!(v["output"].as_array().map(Vec::len), Some(1));
    assert_eq!(message["type"], "message");
    assert!(
        message["id"]
            .as_str()
            .is_some_and(|id| id.starts_with("msg_"))
    );
    assert_eq!(message["status"], "completed");
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["content"][0]["type"], "output_text");
    assert_eq!(message["content"][0]["annotations"], json!([]));
    let text = message["content"][0]["text"]
        .as_str()
        .expect("text")
        .to_owned();
    assert_eq!(text.split(' ').count(), 4);
    assert_eq!(v["usage"]["output_tokens"], 4);
    let input_tokens = v["usage"]["input_tokens"].as_u64().expect("input tokens");
    assert_eq!(v["usage"]["total_tokens"], input_tokens + 4);

    // Rendered like the equivalent chat: same prompt tokens, same text.
    let chat = post(
        Proto::H1,
        addr,
        "/v1/chat/completions",
        json!({"messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Tell me something"}], "max_tokens": 4}),
    )
    .await
    .json();
    assert_eq!(chat["usage"]["prompt_tokens"], input_tokens);
    assert_eq!(chat["choices"][0]["message"]["content"], text.as_str());

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    for proto in [Proto::H1, Proto::H2] {
        let r = post(proto, addr, "/v1/responses", stream_body.clone()).await;
        assert_eq!(r.status, StatusCode::OK);
        assert_eq!(r.headers["content-type"], "text/event-stream");
        let events = named_sse_events(&r.text());
        let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
        let delta = "response.output_text.delta";
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                delta,
                delta,
                delta,
                delta,
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed"
            ]
        );
        for (i, (name, data)) in events.iter().enumerate() {
            assert_eq!(data["type"], name.as_str());
            assert_eq!(data["sequence_number"], i);
        }
        assert_eq!(events[0].1["response"]["status"], "in_progress");
        let item_id = events[2].1["item"]["id"].clone();
        let streamed: String = events
            .iter()
            .filter(|(n, _)| n == delta)
            .inspect(|(_, d)| assert_eq!(d["item_id"], item_id))
            .filter_map(|(_, d)| d["delta"].as_str())
            .collect();
        assert_eq!(streamed, text);
        assert_eq!(events[8].1["text"], text.as_str());
        let done = &events[11].1["response"];
        assert_eq!(done["status"], "completed");
        assert_eq!(done["output"][0]["content"][0]["text"], text.as_str());
        assert_eq!(done["usage"]["output_tokens"], 4);
        assert_eq!(done["usage"]["input_tokens"], input_tokens);
        assert!(!r.text().contains("[DONE]"));
    }

    // The same scheduler and prefix cache: a long prompt repeated hits the cache.
    let long = "lorem ipsum dolor sit amet ".repeat(20);
    let mut cached = Vec::new();
    for _ in 0..2 {
        let v = post(
            Proto::H1,
            addr,
            "/v1/responses",
            json!({"input": long, "max_output_tokens": 1}),
        )
        .await
        .json();
        cached.push(v["usage"]["input_tokens_details"]["cached_tokens"].clone());
    }
    assert_eq!(cached[0], 0);
    assert!(cached[1].as_u64().is_some_and(|c| c >= 16), "{cached:?}");

    for bad in [
        json!({"input": []}),
        json!({"input": "x", "max_output_tokens": 0}),
        json!({"input": [{"type": "function_call_output", "output": "x"}]}),
        json!({"model": "sim-model"}),
    ] {
        let r = post(Proto::H1, addr, "/v1/responses", bad.clone()).await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{bad}: {}", r.text());
        assert_eq!(r.json()["error"]["code"], 400);
    }
    engine.stop().await;
}
