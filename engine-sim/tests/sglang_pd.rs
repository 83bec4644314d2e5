//! SGLang's disaggregated serving between two in-process engines over real HTTP
//! (`--disaggregation-mode prefill|decode`), driven as sglang-router's PD mode drives SGLang:
//! both legs at once, each the client's request with `bootstrap_host`, `bootstrap_port` (the
//! prefill engine's bootstrap server) and one `bootstrap_room`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_engine_sim::{
    DisaggregationMode, EngineHandle, KvTransferConfig, SglangDisaggregation, SimConfig, spawn,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;

const BLOCK: usize = 16;
/// KV bytes of one 16-token block of the default shape (Qwen3-8B in bf16).
const PER_BLOCK: f64 = 36.0 * 2.0 * 8.0 * 128.0 * 2.0 * BLOCK as f64;
const LONG: Duration = Duration::from_secs(30);

async fn call(
    addr: SocketAddr,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Bytes) {
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let payload = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let request = Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(payload))
        .expect("request");
    let response = client.request(request).await.expect("response");
    let status = response.status();
    let body = response.into_body().collect().await.expect("body");
    (status, body.to_bytes())
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, bytes) = call(addr, Method::POST, path, Some(body)).await;
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, json)
}

/// The sum of the samples of metric `name` on `addr` whose labels contain `label`.
async fn labelled(addr: SocketAddr, name: &str, label: &str) -> f64 {
    let (_, bytes) = call(addr, Method::GET, "/metrics", None).await;
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The sum of the samples of metric `name` on `addr`.
async fn metric(addr: SocketAddr, name: &str) -> f64 {
    labelled(addr, name, "").await
}

async fn engine(mode: DisaggregationMode, timeout: Duration) -> EngineHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let config = SimConfig {
        no_delay: true,
        block_size: BLOCK,
        prompt_tokens_details: true,
        kv_transfer: KvTransferConfig {
            sglang: SglangDisaggregation {
                mode,
                bootstrap_port: 0,
                bootstrap_timeout: timeout,
                waiting_timeout: timeout,
            },
            ..KvTransferConfig::default()
        },
        ..SimConfig::default()
    };
    spawn(config, listener).await.expect("spawn")
}

/// `request` as either leg: with the prefill engine's bootstrap server and `room`.
fn leg(request: &Value, prefill: &EngineHandle, room: u64) -> Value {
    let mut leg = request.clone();
    leg["bootstrap_host"] = json!("127.0.0.1");
    leg["bootstrap_port"] = json!(prefill.bootstrap_addr().expect("a bootstrap server").port());
    leg["bootstrap_room"] = json!(room);
    leg
}

/// Waits until the decode engine has joined a room (its transfer is in flight).
async fn joined(decode: SocketAddr) {
    let deadline = tokio::time::Instant::now() + LONG;
    while metric(decode, "kvmesh_sim_kv_transfers_in_flight").await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the decode leg never joined"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn both_legs_meet_in_a_room_and_the_decode_engine_decodes_the_transferred_prompt() {
    let prefill = engine(DisaggregationMode::Prefill, LONG).await;
    let decode = engine(DisaggregationMode::Decode, LONG).await;
    let (p, d) = (prefill.local_addr(), decode.local_addr());
    let request =
        json!({"model": "sim-model", "prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 5});

    let ((status, first), (decode_status, answer)) = tokio::join!(
        post(p, "/v1/completions", leg(&request, &prefill, 42)),
        post(d, "/v1/completions", leg(&request, &prefill, 42)),
    );
    assert_eq!(
        (status, decode_status),
        (StatusCode::OK, StatusCode::OK),
        "{first} {answer}"
    );
    // The prefill engine generated one token, as SGLang's prefill (`FINISH_LENGTH`).
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["usage"]["completion_tokens"], 1);
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    // The decode engine decoded the whole answer, its first word the prefill's token.
    assert_eq!(answer["usage"]["completion_tokens"], 5);
    assert_eq!(answer["usage"]["prompt_tokens"], 100);
    let text = answer["choices"][0]["text"].as_str().expect("text");
    assert!(
        text.starts_with(first["choices"][0]["text"].as_str().unwrap()),
        "{text}"
    );
    // The prefill engine cached nothing of it: the decode engine reports its 0.
    assert_eq!(answer["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The prefill held the prompt's 7 blocks (6 full, one partial) and freed them once the
    // decode engine had them; all 7 crossed the decode engine's link.
    assert_eq!(metric(p, "kvmesh_sim_kv_held_blocks").await, 0.0);
    assert_eq!(
        labelled(d, "kvmesh_sim_kv_transfers_total", "outcome=\"ok\"").await,
        1.0
    );
    assert_eq!(
        metric(d, "kvmesh_sim_kv_transfer_bytes_total").await,
        7.0 * PER_BLOCK
    );
    assert_eq!(metric(p, "vllm:request_success_total").await, 1.0);
    assert_eq!(metric(p, "vllm:generation_tokens_total").await, 1.0);

    // The same prompt again, the decode engine's cache emptied first: the prefill engine hits
    // its 6 full blocks and the decode engine reports that hit (not its own, none), as
    // SGLang's decode engine reports the prefill's cached tokens; all 7 blocks move again.
    let (status, _) = call(d, Method::POST, "/reset_prefix_cache", None).await;
    assert_eq!(status, StatusCode::OK);
    let ((status, first), (decode_status, answer)) = tokio::join!(
        post(p, "/v1/completions", leg(&request, &prefill, 43)),
        post(d, "/v1/completions", leg(&request, &prefill, 43)),
    );
    assert_eq!(
        (status, decode_status),
        (StatusCode::OK, StatusCode::OK),
        "{first} {answer}"
    );
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    assert_eq!(
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );
    assert_eq!(metric(d, "vllm:prefix_cache_hits_total").await, 0.0);
    assert_eq!(
        metric(d, "kvmesh_sim_kv_transfer_bytes_total").await,
        14.0 * PER_BLOCK
    );

    // Once more: the decode engine stored the blocks it received, so only the partial one
    // moves (SGLang's prefill sends only what the decode engine's prefix lacks).
    let ((status, _), (decode_status, answer)) = tokio::join!(
        post(p, "/v1/completions", leg(&request, &prefill, 44)),
        post(d, "/v1/completions", leg(&request, &prefill, 44)),
    );
    assert_eq!(
        (status, decode_status),
        (StatusCode::OK, StatusCode::OK),
        "{answer}"
    );
    assert_eq!(
        metric(d, "kvmesh_sim_kv_transfer_bytes_total").await,
        15.0 * PER_BLOCK
    );
}

#[tokio::test]
async fn the_decode_leg_may_come_first_and_legs_stream_on_every_route() {
    let prefill = engine(DisaggregationMode::Prefill, LONG).await;
    let decode = engine(DisaggregationMode::Decode, LONG).await;
    let (p, d) = (prefill.local_addr(), decode.local_addr());
    let chat = json!({"model": "sim-model", "max_tokens": 4, "stream": true,
                      "messages": [{"role": "user", "content": "word ".repeat(40)}]});
    let generate = json!({"text": "word ".repeat(40), "sampling_params": {"max_new_tokens": 4}});
    for (room, (path, request)) in [("/v1/chat/completions", chat), ("/generate", generate)]
        .into_iter()
        .enumerate()
    {
        let room = room as u64 + 7;
        let decode_leg = tokio::spawn({
            let body = leg(&request, &prefill, room);
            async move { call(d, Method::POST, path, Some(body)).await }
        });
        joined(d).await;
        let (status, first) =
            call(p, Method::POST, path, Some(leg(&request, &prefill, room))).await;
        assert_eq!(status, StatusCode::OK, "{first:?}");
        let (status, body) = decode_leg.await.expect("the decode leg");
        assert_eq!(status, StatusCode::OK, "{body:?}");
        let text = String::from_utf8_lossy(&body);
        if path == "/generate" {
            let answer: Value = serde_json::from_slice(&body).expect("JSON");
            assert_eq!(answer["meta_info"]["completion_tokens"], 4, "{answer}");
            let first: Value = serde_json::from_slice(&first).expect("JSON");
            assert_eq!(first["meta_info"]["completion_tokens"], 1, "{first}");
        } else {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            assert!(String::from_utf8_lossy(&first).ends_with("data: [DONE]\n\n"));
        }
    }
    assert_eq!(
        labelled(d, "kvmesh_sim_kv_transfers_total", "outcome=\"ok\"").await,
        2.0
    );
    assert_eq!(metric(p, "kvmesh_sim_kv_held_blocks").await, 0.0);
}

#[tokio::test]
async fn a_leg_whose_partner_never_comes_fails_as_sglangs_does() {
    let short = Duration::from_millis(200);
    let prefill = engine(DisaggregationMode::Prefill, short).await;
    let decode = engine(DisaggregationMode::Decode, short).await;
    let (p, d) = (prefill.local_addr(), decode.local_addr());
    let request = json!({"model": "sim-model", "prompt": "a lonely leg", "max_tokens": 3});

    // A router that waits for the prefill leg's answer before sending the decode leg: the
    // prefill engine gives up after its bootstrap timeout, having prefilled nothing.
    let (status, error) = post(p, "/v1/completions", leg(&request, &prefill, 1)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{error}");
    let message = error["error"]["message"].as_str().expect("a message");
    assert!(
        message.starts_with("Prefill bootstrap failed for request rank=0 req.rid='cmpl-"),
        "{message}"
    );
    assert!(
        message.contains("KVTransferError(bootstrap_room=1): Request 1 timed out after"),
        "{message}"
    );
    assert!(message.ends_with("in KVPoll.Bootstrapping"), "{message}");
    assert_eq!(metric(p, "vllm:request_success_total").await, 0.0);

    // A decode leg alone waits for its KV until its waiting timeout.
    let (status, error) = post(d, "/v1/completions", leg(&request, &prefill, 2)).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{error}");
    let message = error["error"]["message"].as_str().expect("a message");
    assert!(
        message.starts_with("Decode transfer failed for request rank=0 decode_req.req.rid='cmpl-"),
        "{message}"
    );
    assert!(message.ends_with("in KVPoll.WaitingForInput"), "{message}");

    // No bootstrap server there at all.
    let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let mut lost = leg(&request, &prefill, 3);
    lost["bootstrap_port"] = json!(port);
    let (status, error) = post(d, "/v1/completions", lost).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{error}");
    let message = error["error"]["message"].as_str().expect("a message");
    assert!(
        message.ends_with(&format!(
            "Could not fetch prefill parallel info from bootstrap_addr: 127.0.0.1:{port}"
        )),
        "{message}"
    );
    assert_eq!(
        labelled(d, "kvmesh_sim_kv_transfers_total", "outcome=\"failed\"").await,
        2.0
    );
    assert_eq!(metric(d, "vllm:request_success_total").await, 0.0);
}

#[tokio::test]
async fn requests_without_a_room_are_refused_and_the_bootstrap_server_answers_as_sglangs() {
    let prefill = engine(DisaggregationMode::Prefill, LONG).await;
    let decode = engine(DisaggregationMode::Decode, LONG).await;
    let plain = engine(DisaggregationMode::Null, LONG).await;
    let chat = json!({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]});
    for addr in [prefill.local_addr(), decode.local_addr()] {
        for (path, request, id) in [
            ("/v1/chat/completions", chat.clone(), "chatcmpl-"),
            ("/generate", json!({"text": "hi"}), "sgl-"),
            ("/v1/responses", json!({"input": "hi"}), "resp_"),
        ] {
            let (status, error) = post(addr, path, request).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path}: {error}");
            let message = error["error"]["message"].as_str().expect("a message");
            let refusal = format!(
                "Invalid request: Disaggregated request received without bootstrap room id. req.rid='{id}"
            );
            assert!(message.starts_with(&refusal), "{path}: {message}");
        }
    }
    let (status, _) = post(plain.local_addr(), "/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, StatusCode::OK);
    // A leg takes one prompt and one room.
    let mut batch = leg(
        &json!({"model": "sim-model", "prompt": ["a", "b"]}),
        &prefill,
        5,
    );
    let (status, _) = post(prefill.local_addr(), "/v1/completions", batch.clone()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "a leg takes one prompt");
    batch["bootstrap_room"] = json!([5, 6]);
    let (status, _) = post(prefill.local_addr(), "/v1/completions", batch).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "one room, an integer");

    // SGLang's server arguments name the mode and the bootstrap port.
    let bootstrap = prefill.bootstrap_addr().expect("a bootstrap server");
    let info = |addr| async move {
        let (_, bytes) = call(addr, Method::GET, "/get_server_info", None).await;
        serde_json::from_slice::<Value>(&bytes).expect("JSON")
    };
    let prefill_info = info(prefill.local_addr()).await;
    assert_eq!(prefill_info["disaggregation_mode"], "prefill");
    assert_eq!(
        prefill_info["disaggregation_bootstrap_port"],
        bootstrap.port()
    );
    let decode_info = info(decode.local_addr()).await;
    assert_eq!(decode_info["disaggregation_mode"], "decode");
    assert_eq!(decode_info["disaggregation_bootstrap_port"], 0);
    assert!(
        decode.bootstrap_addr().is_none(),
        "a decode engine serves no bootstrap server"
    );
    let plain_info = info(plain.local_addr()).await;
    assert!(
        plain_info.get("disaggregation_mode").is_none(),
        "{plain_info}"
    );
    assert!(
        plain_info.get("disaggregation_bootstrap_port").is_none(),
        "{plain_info}"
    );

    // The bootstrap server: health, the prefill's layout, one rank's address.
    let (status, body) = call(bootstrap, Method::GET, "/health", None).await;
    assert_eq!((status, &body[..]), (StatusCode::OK, &b"OK"[..]));
    let route = |query: &'static str| async move {
        let (status, body) = call(bootstrap, Method::GET, &format!("/route{query}"), None).await;
        (
            status,
            serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null),
            body,
        )
    };
    let (status, layout, _) =
        route("?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        layout,
        json!({"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
               "page_size": BLOCK, "kv_cache_dtype": "auto", "follow_bootstrap_room": true,
               "enable_dsa_cache_layer_split": false, "prefill_http_port": prefill.local_addr().port()})
    );
    let (status, rank, _) =
        route("?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        rank,
        json!({"rank_ip": "127.0.0.1", "rank_port": bootstrap.port()})
    );
    let (status, _, body) =
        route("?prefill_dp_rank=1&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body:?}");
    let (status, _, body) = route("?prefill_dp_rank=0").await;
    assert_eq!(
        (status, &body[..]),
        (
            StatusCode::BAD_REQUEST,
            &b"Missing inputs for bootstrap server."[..]
        )
    );
    let (status, _) = call(bootstrap, Method::PUT, "/route", Some(json!({}))).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
}
