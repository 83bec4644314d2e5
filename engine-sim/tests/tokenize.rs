//! `POST /tokenize` answers as vLLM's does, with the engine's tokenizer.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use kvmesh_engine_sim::{SimConfig, spawn};
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};

async fn tokenize(addr: std::net::SocketAddr, body: Value) -> (StatusCode, Value) {
    let stream = TcpStream::connect(addr).await.expect("connect");
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .expect("handshake");
    tokio::spawn(conn);
    let request = Request::post(format!("http://{addr}/tokenize"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("request");
    let response = sender.send_request(request).await.expect("response");
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, serde_json::from_slice(&body).expect("json"))
}

#[tokio::test]
async fn tokenize_gives_the_ids_generation_uses_in_vllms_shape() {
    let dir = std::env::temp_dir().join(format!("kvmesh-sim-tokenize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("tokenizer.json");
    // Words, the ChatML markers as added tokens, and the newline the template writes.
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [
            {"id": 3, "content": "<|im_start|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true},
            {"id": 4, "content": "<|im_end|>", "single_word": false, "lstrip": false,
             "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "[UNK]",
                  "vocab": {"hello": 0, "world": 1, "[UNK]": 2, "<|im_start|>": 3,
                            "<|im_end|>": 4, "user": 5, "assistant": 6}}
    });
    std::fs::write(&path, tokenizer.to_string()).expect("write tokenizer");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let config = SimConfig {
        no_delay: true,
        tokenizer: Some(path),
        max_model_len: 4096,
        ..SimConfig::default()
    };
    let engine = spawn(config.clone(), listener).await.expect("spawn");
    let addr = engine.local_addr();

    let (status, text) = tokenize(
        addr,
        json!({"model": config.model, "prompt": "hello world nope"}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{text}");
    assert_eq!(
        text,
        json!({"count": 3, "max_model_len": 4096, "tokens": [0, 1, 2], "token_strs": null})
    );

    // A chat, rendered with the generation prompt by default, without it when asked.
    let messages = json!([{"role": "user", "content": "hello"}]);
    let (status, chat) = tokenize(addr, json!({"messages": messages})).await;
    assert_eq!(status, StatusCode::OK, "{chat}");
    assert_eq!(chat["tokens"], json!([3, 5, 0, 4, 3, 6]), "{chat}");
    assert_eq!(chat["count"], 6);
    let (_, closed) = tokenize(
        addr,
        json!({"messages": messages, "add_generation_prompt": false}),
    )
    .await;
    assert_eq!(closed["tokens"], json!([3, 5, 0, 4]), "{closed}");

    // vLLM's refusals: a model it does not serve (404), no prompt (400).
    let (status, error) = tokenize(addr, json!({"model": "other", "prompt": "hello"})).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{error}");
    let (status, error) = tokenize(addr, json!({"model": config.model})).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    engine.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
