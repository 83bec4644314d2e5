//! SGLang's prefill/decode protocol end to end (issue 32): `kvmesh-proxy` with
//! `disaggregation.protocol: sglang` (`policy: kv`, `mode: enforce`) in front of two
//! `kvmesh-engine-sim` processes speaking it as SGLang engines do, one
//! `--disaggregation-mode prefill` (its bootstrap server on a free port, which the static
//! backend names as `bootstrap_port`) and one `--disaggregation-mode decode`.
//!
//! The prefill engine answers a leg only once the decode engine joined its room and took the
//! KV, so a proxy that did not send both legs at once would hang each request until the
//! prefill engine's bootstrap timeout (here 20 s, past the client's deadline) and fail it.
//! Chat and completions, streamed and not, from a real HTTP client: each answer is the decode
//! engine's, the decode engine received exactly the prompt's blocks for every request, the
//! prefill engine ran exactly one one-token prefill per request, and the proxy counts every
//! prefill leg `remote` (once it read the leg's answer, after the decode leg's: polled
//! against a deadline).

use std::time::Duration;

use http::Method;
use kvmesh_e2e::cluster::{MODEL, chat_body, start_engines, start_proxy};
use kvmesh_e2e::control_plane::{await_metric, metric};
use kvmesh_e2e::sse::{assert_whole_stream, sse_data};
use kvmesh_e2e::{HttpClient, ScratchDir};
use serde_json::{Value, json};

const BLOCK: u64 = 16;
/// KV bytes of one block of engine-sim's default shape (Qwen3-8B in bf16).
const BYTES_PER_BLOCK: u64 = 36 * 2 * 8 * 128 * 2 * BLOCK;
const MAX_TOKENS: u64 = 6;
/// Deadline of every request and of the proxy's leg count.
const DEADLINE: Duration = Duration::from_secs(15);

/// A request through the proxy, and what the client reads of it.
struct Case {
    path: &'static str,
    body: Value,
}

fn cases() -> Vec<Case> {
    let words = |n: usize, seed: usize| {
        (0..n)
            .map(|i| format!("w{seed}x{i}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut streamed_chat = chat_body(&words(70, 1), MAX_TOKENS as u32, true);
    streamed_chat["stream_options"] = json!({"include_usage": true});
    vec![
        Case {
            path: "/v1/chat/completions",
            body: chat_body(&words(50, 0), MAX_TOKENS as u32, false),
        },
        Case {
            path: "/v1/chat/completions",
            body: streamed_chat,
        },
        Case {
            path: "/v1/completions",
            body: json!({"model": MODEL, "prompt": words(90, 2), "max_tokens": MAX_TOKENS}),
        },
        Case {
            path: "/v1/completions",
            body: json!({"model": MODEL, "prompt": words(40, 3), "max_tokens": MAX_TOKENS,
                         "stream": true, "stream_options": {"include_usage": true}}),
        },
    ]
}

/// The usage a client read: of the JSON answer, or of a stream's usage chunk.
fn usage_of(body: &[u8], streamed: bool, what: &str) -> Value {
    if !streamed {
        let answer: Value = serde_json::from_slice(body).expect("a JSON answer");
        assert_eq!(
            answer["usage"]["completion_tokens"], MAX_TOKENS,
            "{what}: {answer}"
        );
        let choice = &answer["choices"][0];
        assert_eq!(choice["finish_reason"], "length", "{what}: {answer}");
        let text = choice["text"]
            .as_str()
            .or_else(|| choice["message"]["content"].as_str())
            .expect("a text");
        assert_eq!(
            text.split_whitespace().count() as u64,
            MAX_TOKENS,
            "{what}: the decode engine's words, not the prefill engine's one: {text:?}"
        );
        return answer["usage"].clone();
    }
    assert_whole_stream(body, MAX_TOKENS, what);
    sse_data(body)
        .iter()
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .find_map(|chunk| chunk.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap_or_else(|| panic!("{what}: a usage chunk"))
}

async fn metrics(client: &HttpClient, url: &str) -> String {
    let reply = client
        .get(&format!("{url}/metrics"))
        .await
        .expect("metrics");
    String::from_utf8_lossy(&reply.body).into_owned()
}

/// The sum of every sample of `name` whose labels contain `label`.
fn total(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(label))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_legs_meet_in_a_bootstrap_room_and_the_client_gets_the_decode_answer() {
    let scratch = ScratchDir::new("sglang-pd").unwrap();
    let engine = |mode: &'static str| {
        start_engines(
            &scratch,
            1,
            &[
                "--no-delay",
                "--block-size",
                "16",
                "--enable-prompt-tokens-details",
                "--disaggregation-mode",
                mode,
                "--disaggregation-bootstrap-port",
                "0",
                "--disaggregation-bootstrap-timeout",
                "20",
                "--disaggregation-waiting-timeout",
                "20",
            ],
        )
        .unwrap()
    };
    let (prefill, decode) = (engine("prefill"), engine("decode"));
    let prefill_url = prefill.url("engine-0");
    let decode_url = decode.url("engine-0");
    let bootstrap_port = prefill.addr("bootstrap-0").port();
    let config = format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         health_check:\n  enabled: false\n\
         models:\n  - name: {MODEL}\n    policy: kv\n    kv:\n      block_size: {BLOCK}\n\
         \x20   disaggregation:\n      protocol: sglang\n      mode: enforce\n      on_prefill_failure: fail\n\
         \x20   backends:\n      - url: {prefill_url}\n        role: prefill\n        bootstrap_port: {bootstrap_port}\n\
         \x20     - url: {decode_url}\n        role: decode\n"
    );
    let proxy = start_proxy(&scratch, &config).unwrap();
    let client = HttpClient::http1();

    let mut blocks = 0;
    let mut prompt_tokens = 0;
    let cases = cases();
    for (index, case) in cases.iter().enumerate() {
        let what = format!("request {index} ({})", case.path);
        let streamed = case.body["stream"] == true;
        let url = format!("{}{}", proxy.url("main"), case.path);
        let headers = [("content-type", "application/json")];
        let reply = tokio::time::timeout(
            DEADLINE,
            client.call(Method::POST, &url, &headers, case.body.to_string()),
        )
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer within {DEADLINE:?}"))
        .unwrap();
        assert_eq!(
            reply.status,
            200,
            "{what}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        let route = reply.header("x-kvmesh-route").expect("a route").to_owned();
        assert!(
            route.starts_with(&format!("prefill={prefill_url}")),
            "{what}: {route}"
        );
        assert_eq!(
            reply
                .header("x-kvmesh-instance")
                .map(|i| i.trim_end_matches('/')),
            Some(decode_url.as_str()),
            "{what}"
        );
        let usage = usage_of(&reply.body, streamed, &what);
        let prompt = usage["prompt_tokens"].as_u64().expect("prompt tokens");
        // SGLang's decode engine reports the prefill engine's prefix hit: none, each prompt
        // is new there.
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"], 0,
            "{what}: {usage}"
        );
        prompt_tokens += prompt;
        blocks += prompt.div_ceil(BLOCK);
    }
    let requests = cases.len() as f64;

    // The decode engine received each prompt's blocks over its link, all of them, one
    // transfer per request, and decoded every answer.
    let decoded = metrics(&client, &decode_url).await;
    assert_eq!(
        total(&decoded, "kvmesh_sim_kv_transfers_total", "outcome=\"ok\""),
        requests,
        "{decoded}"
    );
    assert_eq!(
        total(
            &decoded,
            "kvmesh_sim_kv_transfers_total",
            "outcome=\"failed\""
        ),
        0.0
    );
    assert_eq!(
        total(&decoded, "kvmesh_sim_kv_transfer_bytes_total", ""),
        (blocks * BYTES_PER_BLOCK) as f64
    );
    assert_eq!(
        total(&decoded, "vllm:generation_tokens_total", ""),
        requests * MAX_TOKENS as f64
    );
    // The prefill engine ran exactly one prefill of one token per request, of the same
    // prompts, and holds nothing any more.
    let prefilled = metrics(&client, &prefill_url).await;
    assert_eq!(
        total(
            &prefilled,
            "vllm:request_success_total",
            "finished_reason=\"length\""
        ),
        requests,
        "{prefilled}"
    );
    assert_eq!(
        total(&prefilled, "vllm:generation_tokens_total", ""),
        requests
    );
    assert_eq!(
        total(&prefilled, "vllm:prompt_tokens_total", ""),
        prompt_tokens as f64
    );
    assert_eq!(total(&prefilled, "kvmesh_sim_kv_held_blocks", ""), 0.0);

    // The proxy counts a prefill leg once it read its answer, after the decode leg's.
    let admin = format!("{}/metrics", proxy.url("admin"));
    let series = format!("kvmesh_prefill_legs_total{{model=\"{MODEL}\",outcome=\"remote\"}}");
    await_metric(&client, &admin, &series, |v| v == requests, DEADLINE)
        .await
        .unwrap();
    let text = client.get(&admin).await.unwrap();
    let text = String::from_utf8_lossy(&text.body);
    let failed = format!("kvmesh_prefill_legs_total{{model=\"{MODEL}\",outcome=\"failed\"}}");
    assert_eq!(metric(&text, &failed).unwrap_or(0.0), 0.0, "{text}");
}
