//! Metrics, health and request ids of a running proxy.

use kvmesh_e2e::cluster::{chat_body, engine_urls, proxy_config, start_engines, start_proxy};
use kvmesh_e2e::{HttpClient, ScratchDir};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_health_and_request_ids() {
    let scratch = ScratchDir::new("observe").unwrap();
    let sim = start_engines(&scratch, 2, &["--no-delay"]).unwrap();
    let proxy = start_proxy(&scratch, &proxy_config(&engine_urls(&sim), "")).unwrap();
    let client = HttpClient::http1();
    let admin = proxy.url("admin");

    let live = client.get(&format!("{admin}/live")).await.unwrap();
    assert_eq!(live.status, 200);
    let health = client.get(&format!("{admin}/health")).await.unwrap();
    assert_eq!(health.status, 200, "{:?}", health.body);
    assert!(String::from_utf8_lossy(&health.body).contains("sim-model"));

    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let plain = client
        .post_json(&url, &chat_body("count me", 3, false))
        .await
        .unwrap();
    assert_eq!(plain.status, 200);
    assert!(
        plain
            .header("x-request-id")
            .is_some_and(|id| !id.is_empty())
    );
    let streamed = client
        .post_json(&url, &chat_body("time me", 5, true))
        .await
        .unwrap();
    assert_eq!(streamed.status, 200);
    let propagated = client
        .call(
            http::Method::POST,
            &url,
            &[
                ("content-type", "application/json"),
                ("x-request-id", "req-abc-123"),
            ],
            chat_body("tag me", 2, false).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(propagated.header("x-request-id"), Some("req-abc-123"));
    let missing = client
        .post_json(&url, &serde_json::json!({"messages": []}))
        .await
        .unwrap();
    assert_eq!(missing.status, 400);

    let metrics =
        String::from_utf8_lossy(&client.get(&format!("{admin}/metrics")).await.unwrap().body)
            .to_string();
    let requests_200: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvmesh_requests_total{") && l.contains("status=\"200\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(
        requests_200 >= 3.0,
        "kvmesh_requests_total 200s = {requests_200}\n{metrics}"
    );
    let ttft_count: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("kvmesh_time_to_first_token_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(ttft_count >= 1.0, "no TTFT observed\n{metrics}");
    for name in [
        "kvmesh_requests_in_flight",
        "kvmesh_instance_healthy",
        "kvmesh_client_errors_total",
        "kvmesh_request_duration_seconds",
    ] {
        assert!(metrics.contains(name), "missing {name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_lengths_are_counted_from_what_reached_the_client() {
    let scratch = ScratchDir::new("observe-tokens").unwrap();
    let sim = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let proxy = start_proxy(&scratch, &proxy_config(&engine_urls(&sim), "")).unwrap();
    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let plain = client
        .post_json(&url, &chat_body("count me", 5, false))
        .await
        .unwrap();
    assert_eq!(plain.status, 200);
    let usage = plain.json().unwrap()["usage"].clone();
    let streamed = client
        .post_json(&url, &chat_body("count me too", 7, true))
        .await
        .unwrap();
    assert_eq!(streamed.status, 200);
    // Refused by the engine (an empty conversation, a 400 as vLLM answers it): not counted.
    let mut empty = chat_body("", 10, false);
    empty["messages"] = serde_json::json!([]);
    let refused = client.post_json(&url, &empty).await.unwrap();
    assert_eq!(refused.status, 400);

    let metrics = client
        .get(&format!("{}/metrics", proxy.url("admin")))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&metrics.body).to_string();
    let value = |series: &str| {
        kvmesh_e2e::control_plane::metric(&text, series)
            .unwrap_or_else(|| panic!("{series}:\n{text}"))
    };
    assert_eq!(
        value("kvmesh_output_tokens_total{model=\"sim-model\"}"),
        12.0
    );
    assert_eq!(
        value("kvmesh_output_tokens_count{model=\"sim-model\"}"),
        2.0
    );
    assert_eq!(value("kvmesh_output_tokens_sum{model=\"sim-model\"}"), 12.0);
    // The plain answer's usage names its prompt; the stream without usage has none known
    // (no tokenizer configured), so one prompt was counted.
    assert_eq!(value("kvmesh_input_tokens_count{model=\"sim-model\"}"), 1.0);
    assert_eq!(
        value("kvmesh_input_tokens_sum{model=\"sim-model\"}"),
        usage["prompt_tokens"].as_f64().unwrap()
    );
}
