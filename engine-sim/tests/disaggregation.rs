//! Disaggregated serving between two in-process engines over real HTTP, driven as vLLM's
//! disaggregation proxy (`toy_proxy_server.py`) drives vLLM: the prefill leg with
//! `do_remote_decode`, `max_tokens: 1` and no stream; the decode leg with the prefill's
//! `kv_transfer_params`.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvmesh_engine_sim::{EngineHandle, KvTransferConfig, Role, SimConfig, spawn};
use serde_json::{Value, json};
use tokio::net::TcpListener;

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
    (
        status,
        response
            .into_body()
            .collect()
            .await
            .expect("body")
            .to_bytes(),
    )
}

async fn post(addr: SocketAddr, path: &str, body: Value) -> (StatusCode, Value) {
    let (status, bytes) = call(addr, Method::POST, path, Some(body)).await;
    let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, json)
}

/// Sum of the samples of metric `name` (any labels) on `addr`.
async fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, bytes) = call(addr, Method::GET, "/metrics", None).await;
    String::from_utf8_lossy(&bytes)
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn engine(role: Role, hold_timeout: Duration) -> EngineHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let config = SimConfig {
        no_delay: true,
        block_size: 16,
        kv_transfer: KvTransferConfig {
            role,
            hold_timeout,
            ..KvTransferConfig::default()
        },
        ..SimConfig::default()
    };
    spawn(config, listener).await.expect("spawn")
}

/// The prefill leg of `request` as vLLM's proxy builds it.
fn prefill_leg(request: &Value) -> Value {
    let mut leg = request.clone();
    leg["kv_transfer_params"] = json!({
        "do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null
    });
    leg["stream"] = json!(false);
    leg["max_tokens"] = json!(1);
    leg
}

#[tokio::test]
async fn a_prefill_hands_its_blocks_to_a_decode_that_pulls_them_before_its_first_token() {
    let prefill = engine(Role::Prefill, Duration::from_secs(30)).await;
    let decode = engine(Role::Decode, Duration::from_secs(30)).await;
    let (p, d) = (prefill.local_addr(), decode.local_addr());
    for (path, request) in [
        (
            "/v1/completions",
            json!({"model": "sim-model", "prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 5}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "sim-model", "messages": [{"role": "user", "content": "word ".repeat(60)}],
                   "max_tokens": 5, "stream": true}),
        ),
    ] {
        let (status, answer) = post(p, path, prefill_leg(&request)).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        let params = answer["kv_transfer_params"].clone();
        assert_eq!(params["do_remote_prefill"], true, "{answer}");
        assert_eq!(params["do_remote_decode"], false);
        assert_eq!(params["remote_host"], "127.0.0.1");
        assert_eq!(params["remote_port"], p.port());
        assert_eq!(params["remote_engine_id"], p.to_string());
        let blocks = params["remote_block_ids"][0]
            .as_array()
            .expect("block ids")
            .len();
        assert!(blocks >= 6, "{params}");
        assert_eq!(metric(p, "kvmesh_sim_kv_held_blocks").await, blocks as f64);

        let mut decode_leg = request.clone();
        decode_leg["kv_transfer_params"] = params;
        let bytes_before = metric(d, "kvmesh_sim_kv_transfer_bytes_total").await;
        let (status, body) = call(d, Method::POST, path, Some(decode_leg)).await;
        assert_eq!(status, StatusCode::OK);
        let text = String::from_utf8_lossy(&body);
        if request["stream"] == true {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        } else {
            let answer: Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(answer["usage"]["completion_tokens"], 5);
            // vLLM 0.32 answers `"kv_transfer_params": null` but on a prefill leg.
            assert!(answer["kv_transfer_params"].is_null(), "{answer}");
        }
        // The prefill engine freed what the decode engine read; the bytes crossed the link.
        assert_eq!(metric(p, "kvmesh_sim_kv_held_blocks").await, 0.0);
        let per_block = 36.0 * 2.0 * 8.0 * 128.0 * 2.0 * 16.0;
        let moved = metric(d, "kvmesh_sim_kv_transfer_bytes_total").await - bytes_before;
        assert_eq!(moved, blocks as f64 * per_block);
    }
    assert_eq!(metric(d, "kvmesh_sim_kv_transfers_total").await, 2.0);
    // The decode engine computed only the uncached tail, and stored the pulled blocks: the
    // same prompt again hits them there.
    let request =
        json!({"model": "sim-model", "prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 1});
    let (_, answer) = post(d, "/v1/completions", request).await;
    assert_eq!(answer["usage"]["prompt_tokens"], 100);
    assert_eq!(metric(d, "vllm:prefix_cache_hits_total").await, 96.0);
}

#[tokio::test]
async fn a_decode_leg_pulls_only_the_blocks_past_its_own_cached_prefix() {
    let prefill = engine(Role::Prefill, Duration::from_secs(30)).await;
    let decode = engine(Role::Decode, Duration::from_secs(30)).await;
    let (p, d) = (prefill.local_addr(), decode.local_addr());
    // The decode engine already caches the first 64 tokens: four blocks of 16.
    let warm =
        json!({"model": "sim-model", "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 1});
    let (status, _) = post(d, "/v1/completions", warm).await;
    assert_eq!(status, StatusCode::OK);

    let request =
        json!({"model": "sim-model", "prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": 2});
    let (_, answer) = post(p, "/v1/completions", prefill_leg(&request)).await;
    let params = answer["kv_transfer_params"].clone();
    let held = params["remote_block_ids"][0]
        .as_array()
        .expect("block ids")
        .len();
    assert!(held >= 6, "{params}");
    let mut decode_leg = request.clone();
    decode_leg["kv_transfer_params"] = params;
    let (status, answer) = post(d, "/v1/completions", decode_leg).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 2);
    // Every held block was read (and freed), but only those past the four cached ones moved.
    assert_eq!(metric(p, "kvmesh_sim_kv_held_blocks").await, 0.0);
    let per_block = 36.0 * 2.0 * 8.0 * 128.0 * 2.0 * 16.0;
    assert_eq!(
        metric(d, "kvmesh_sim_kv_transfer_bytes_total").await,
        (held - 4) as f64 * per_block
    );
}

#[tokio::test]
async fn roles_refuse_the_other_side_and_a_lost_hold_falls_back_to_local_prefill() {
    let prefill = engine(Role::Prefill, Duration::from_millis(50)).await;
    let decode = engine(Role::Decode, Duration::from_secs(30)).await;
    let (p, d) = (prefill.local_addr(), decode.local_addr());
    let request =
        json!({"model": "sim-model", "prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 3});
    let (status, error) = post(d, "/v1/completions", prefill_leg(&request)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("role is decode")
    );
    let mut streamed = prefill_leg(&request);
    streamed["stream"] = json!(true);
    let (status, _) = post(p, "/v1/completions", streamed).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);

    let (_, answer) = post(p, "/v1/completions", prefill_leg(&request)).await;
    let params = answer["kv_transfer_params"].clone();
    let mut pulling = request.clone();
    pulling["kv_transfer_params"] = params.clone();
    let (status, error) = post(p, "/v1/completions", pulling.clone()).await;
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "a prefill engine does not pull: {error}"
    );
    let mut incomplete = pulling.clone();
    incomplete["kv_transfer_params"]["remote_port"] = Value::Null;
    let (status, error) = post(d, "/v1/completions", incomplete).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("remote_port")
    );

    // The hold expires before the decode leg comes: it prefills locally and still answers.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metric(p, "kvmesh_sim_kv_holds_expired_total").await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the hold never expired"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, answer) = post(d, "/v1/completions", pulling).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["usage"]["completion_tokens"], 3);
    let failed = {
        let (_, bytes) = call(d, Method::GET, "/metrics", None).await;
        String::from_utf8_lossy(&bytes)
            .lines()
            .find(|l| l.starts_with("kvmesh_sim_kv_transfers_total{") && l.contains("failed"))
            .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
    };
    assert_eq!(failed, Some(1.0));
    assert_eq!(metric(p, "kvmesh_sim_kv_held_blocks").await, 0.0);
}
