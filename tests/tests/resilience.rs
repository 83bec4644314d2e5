//! Failure handling with real processes: dead engines, engines dying mid-stream,
//! timeouts, graceful shutdown.

use std::time::Duration;

use http::Method;
use kvmesh_e2e::cluster::{
    MODEL, await_status, chat_body, engine_urls, proxy_config, start_engines, start_proxy,
};
use kvmesh_e2e::control_plane::assert_migrations;
use kvmesh_e2e::sse::{
    OpenStream, assert_all_whole, assert_whole_choices, chat_and_completions, open_streams_with,
    sse_comments, sse_data,
};
use kvmesh_e2e::{HttpClient, ScratchDir};

fn error_body(resp: &kvmesh_e2e::Response) -> serde_json::Value {
    let body = resp.json().expect("error body is JSON");
    let err = body
        .get("error")
        .unwrap_or_else(|| panic!("no error object in {body}"));
    for field in ["message", "type", "param", "code"] {
        assert!(err.get(field).is_some(), "error lacks {field}: {body}");
    }
    err.clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_engines_down_every_request_succeeds() {
    let scratch = ScratchDir::new("one-down").unwrap();
    let alive = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let mut dead = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let urls = [engine_urls(&alive), engine_urls(&dead)].concat();
    let proxy = start_proxy(&scratch, &proxy_config(&urls, "")).unwrap();
    dead.kill();

    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    for i in 0..20 {
        let resp = client
            .post_json(&url, &chat_body(&format!("request {i}"), 3, false))
            .await
            .unwrap();
        assert_eq!(resp.status, 200, "request {i}: {:?}", resp.body);
        assert_eq!(resp.header("x-kvmesh-instance"), Some(urls[0].as_str()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_killed_mid_stream_ends_stream_with_error_event() {
    let scratch = ScratchDir::new("mid-stream").unwrap();
    // Real-time decode (~6 ms per token): a 2,000-token stream lasts seconds.
    let mut victim = start_engines(&scratch, 1, &[]).unwrap();
    let proxy = start_proxy(&scratch, &proxy_config(&engine_urls(&victim), "")).unwrap();

    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let body = chat_body("a very long answer please", 2000, true).to_string();
    let mut stream = client
        .send(
            Method::POST,
            &url,
            &[("content-type", "application/json")],
            body,
        )
        .await
        .unwrap();
    assert_eq!(stream.status, 200);
    let first = stream.next_chunk().await.unwrap().expect("a first chunk");
    assert!(first.starts_with(b"data: "), "{first:?}");
    victim.kill();

    let rest = tokio::time::timeout(Duration::from_secs(20), stream.rest())
        .await
        .expect("the stream ends instead of hanging")
        .expect("the stream ends cleanly, not with a transport error");
    let text = String::from_utf8_lossy(&rest);
    let last_event = text.trim_end().rsplit("\n\n").next().unwrap_or_default();
    assert!(
        last_event.starts_with("data: {\"error\""),
        "last event: {last_event:?}"
    );

    // The proxy itself is unaffected.
    let live = client
        .get(&format!("{}/live", proxy.url("admin")))
        .await
        .unwrap();
    assert_eq!(live.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_first_byte_timeout_is_504() {
    let scratch = ScratchDir::new("timeout").unwrap();
    let sim = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let proxy = start_proxy(
        &scratch,
        &proxy_config(&engine_urls(&sim), "limits:\n  first_byte_timeout: 300ms\n"),
    )
    .unwrap();
    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let resp = client
        .call(
            Method::POST,
            &url,
            &[
                ("content-type", "application/json"),
                ("x-sim-delay-ms", "3000"),
            ],
            chat_body("slow", 2, false).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status, 504, "{:?}", resp.body);
    error_body(&resp);

    // A prompt request right after is served.
    let ok = client
        .post_json(&url, &chat_body("fast", 2, false))
        .await
        .unwrap();
    assert_eq!(ok.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_gone_before_first_byte_is_502() {
    let scratch = ScratchDir::new("gone").unwrap();
    let mut sim = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let proxy = start_proxy(
        &scratch,
        &proxy_config(&engine_urls(&sim), "health_check:\n  enabled: false\n"),
    )
    .unwrap();
    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let pending = {
        let client = client.clone();
        let url = url.clone();
        tokio::spawn(async move {
            client
                .call(
                    Method::POST,
                    &url,
                    &[
                        ("content-type", "application/json"),
                        ("x-sim-delay-ms", "30000"),
                    ],
                    chat_body("doomed", 2, false).to_string(),
                )
                .await
        })
    };
    // The proxy reports the request in flight on the instance once it is forwarded.
    let metrics_url = format!("{}/metrics", proxy.url("admin"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = client.get(&metrics_url).await.unwrap();
        let text = String::from_utf8_lossy(&metrics.body).to_string();
        if text
            .lines()
            .any(|l| l.starts_with("kvmesh_instance_in_flight{") && l.ends_with(" 1"))
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "request never in flight:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sim.kill();
    let resp = pending.await.unwrap().unwrap();
    assert_eq!(resp.status, 502, "{:?}", resp.body);
    error_body(&resp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_instance_is_503_with_retry_after() {
    let scratch = ScratchDir::new("no-healthy").unwrap();
    // A port that nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let extra = "health_check:\n  interval: 100ms\n  timeout: 100ms\n  unhealthy_threshold: 1\n";
    let proxy = start_proxy(
        &scratch,
        &proxy_config(&[format!("http://{closed}")], extra),
    )
    .unwrap();
    let client = HttpClient::http1();
    await_status(
        &client,
        &format!("{}/health", proxy.url("admin")),
        503,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let resp = client
        .post_json(
            &format!("{}/v1/chat/completions", proxy.url("main")),
            &chat_body("anyone?", 2, false),
        )
        .await
        .unwrap();
    assert_eq!(resp.status, 503, "{:?}", resp.body);
    assert!(
        resp.header("retry-after").is_some(),
        "no Retry-After: {:?}",
        resp.headers
    );
    error_body(&resp);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_long_stream_then_exits_zero() {
    let scratch = ScratchDir::new("drain").unwrap();
    let sim = start_engines(&scratch, 1, &[]).unwrap();
    let mut proxy = start_proxy(
        &scratch,
        &proxy_config(&engine_urls(&sim), "shutdown:\n  drain_timeout: 30s\n"),
    )
    .unwrap();
    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    // ~300 tokens at ~6 ms each: the stream outlives the signal by far.
    let mut stream = client
        .send(
            Method::POST,
            &url,
            &[("content-type", "application/json")],
            chat_body("drain me", 300, true).to_string(),
        )
        .await
        .unwrap();
    assert_eq!(stream.status, 200);
    stream.next_chunk().await.unwrap().expect("first chunk");
    proxy.terminate().unwrap();

    let rest = tokio::time::timeout(Duration::from_secs(30), stream.rest())
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "stream was cut: ...{}",
        &text[text.len().saturating_sub(200)..]
    );
    let status = proxy.wait_exit(Duration::from_secs(30)).unwrap();
    assert!(status.success(), "proxy exited with {status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn h2c_client_and_h2c_upstream() {
    let scratch = ScratchDir::new("h2c").unwrap();
    let sim = start_engines(&scratch, 1, &["--no-delay"]).unwrap();
    let backend = engine_urls(&sim).remove(0);
    let config = format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         models:\n  - name: {MODEL}\n    backends:\n      - url: {backend}\n        protocol: h2c\n"
    );
    let proxy = start_proxy(&scratch, &config).unwrap();
    let client = HttpClient::h2c();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let resp = client
        .post_json(&url, &chat_body("over h2", 4, true))
        .await
        .unwrap();
    assert_eq!(resp.status, 200, "{:?}", resp.body);
    assert_eq!(resp.header("x-kvmesh-instance"), Some(backend.as_str()));
    assert!(
        String::from_utf8_lossy(&resp.body)
            .trim_end()
            .ends_with("data: [DONE]")
    );
}

/// The value of `series` in the proxy's metrics (0 when absent).
async fn proxy_metric(client: &HttpClient, proxy: &kvmesh_e2e::Spawned, series: &str) -> f64 {
    let metrics = client
        .get(&format!("{}/metrics", proxy.url("admin")))
        .await
        .unwrap();
    kvmesh_e2e::control_plane::metric(&String::from_utf8_lossy(&metrics.body), series)
        .unwrap_or(0.0)
}

/// A failing engine (`--fail-status` or `--head-delay-ms` from `fault`) listed first and a
/// healthy one, behind a round-robin proxy with `extra` YAML; returns their URLs.
fn faulty_pair(
    scratch: &ScratchDir,
    fault: &[&str],
    extra: &str,
) -> (
    Vec<kvmesh_e2e::Spawned>,
    kvmesh_e2e::Spawned,
    String,
    String,
) {
    let faulty = start_engines(scratch, 1, &[&["--no-delay"], fault].concat()).unwrap();
    let healthy = start_engines(scratch, 1, &["--no-delay"]).unwrap();
    let (bad, good) = (
        engine_urls(&faulty)[0].clone(),
        engine_urls(&healthy)[0].clone(),
    );
    let proxy = start_proxy(scratch, &proxy_config(&[bad.clone(), good.clone()], extra)).unwrap();
    (vec![faulty, healthy], proxy, bad, good)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_answering_503_is_retried_on_another() {
    let scratch = ScratchDir::new("retry-503").unwrap();
    let (_sims, proxy, bad, good) = faulty_pair(&scratch, &["--fail-status", "503"], "");
    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    for i in 0..10 {
        let resp = client
            .post_json(&url, &chat_body(&format!("request {i}"), 3, i % 2 == 0))
            .await
            .unwrap();
        assert_eq!(resp.status, 200, "request {i}: {:?}", resp.body);
        assert_eq!(resp.header("x-kvmesh-instance"), Some(good.as_str()));
    }
    // Every 503 the failing engine gave was retried, none reached a client.
    let answered_503 = proxy_metric(
        &client,
        &proxy,
        &format!("kvmesh_upstream_errors_total{{instance=\"{bad}\",kind=\"status_5xx\",model=\"{MODEL}\"}}"),
    )
    .await;
    let retried = proxy_metric(
        &client,
        &proxy,
        &format!("kvmesh_retries_total{{model=\"{MODEL}\",reason=\"status\"}}"),
    )
    .await;
    assert!(
        answered_503 >= 1.0,
        "round robin sent the first request to it"
    );
    assert_eq!(retried, answered_503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_first_byte_is_retried_elsewhere() {
    let scratch = ScratchDir::new("retry-timeout").unwrap();
    let (_sims, proxy, bad, good) = faulty_pair(
        &scratch,
        &["--head-delay-ms", "10000"],
        "limits:\n  first_byte_timeout: 300ms\n",
    );
    let client = HttpClient::http1();
    let url = format!("{}/v1/completions", proxy.url("main"));
    for i in 0..4 {
        let body =
            serde_json::json!({"model": MODEL, "prompt": format!("slow {i}"), "max_tokens": 2});
        let resp = client.post_json(&url, &body).await.unwrap();
        assert_eq!(resp.status, 200, "request {i}: {:?}", resp.body);
        assert_eq!(resp.header("x-kvmesh-instance"), Some(good.as_str()));
    }
    let timed_out = proxy_metric(
        &client,
        &proxy,
        &format!(
            "kvmesh_upstream_errors_total{{instance=\"{bad}\",kind=\"timeout\",model=\"{MODEL}\"}}"
        ),
    )
    .await;
    let retried = proxy_metric(
        &client,
        &proxy,
        &format!("kvmesh_retries_total{{model=\"{MODEL}\",reason=\"timeout\"}}"),
    )
    .await;
    assert!(timed_out >= 1.0);
    assert_eq!(retried, timed_out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_retry_budget_passes_the_answer_through_and_4xx_is_never_retried() {
    let scratch = ScratchDir::new("retry-budget").unwrap();
    let no_budget = "retry:\n  budget_ratio: 0\n  budget_min_per_second: 0\n\
                     outlier_detection:\n  consecutive_failures: 1000\n";
    let (_sims, proxy, bad, _good) = faulty_pair(&scratch, &["--fail-status", "503"], no_budget);
    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    let mut passed_503 = 0;
    for i in 0..6 {
        let resp = client
            .post_json(&url, &chat_body(&format!("request {i}"), 3, false))
            .await
            .unwrap();
        if resp.status == 503 {
            assert_eq!(resp.header("x-kvmesh-instance"), Some(bad.as_str()));
            assert!(
                error_body(&resp)["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("simulated failure")
            );
            passed_503 += 1;
        } else {
            assert_eq!(resp.status, 200, "{:?}", resp.body);
        }
    }
    assert_eq!(
        passed_503, 3,
        "round robin: every other request went to the failing engine"
    );
    let exhausted = proxy_metric(
        &client,
        &proxy,
        &format!("kvmesh_retry_budget_exhausted_total{{model=\"{MODEL}\"}}"),
    )
    .await;
    assert_eq!(exhausted, 3.0);

    // An engine answering 404 (the request's fault) is neither retried nor ejected.
    let scratch = ScratchDir::new("retry-4xx").unwrap();
    let (_sims, proxy, bad, _good) = faulty_pair(&scratch, &["--fail-status", "404"], "");
    let mut passed_404 = 0;
    let url = format!("{}/v1/chat/completions", proxy.url("main"));
    for i in 0..8 {
        let resp = client
            .post_json(&url, &chat_body(&format!("request {i}"), 3, false))
            .await
            .unwrap();
        if resp.status == 404 {
            assert_eq!(resp.header("x-kvmesh-instance"), Some(bad.as_str()));
            passed_404 += 1;
        }
    }
    assert_eq!(passed_404, 4, "never ejected: it kept its turn");
    let retried = proxy_metric(
        &client,
        &proxy,
        &format!("kvmesh_retries_total{{model=\"{MODEL}\",reason=\"status\"}}"),
    )
    .await;
    assert_eq!(retried, 0.0);
}

/// Two engines, one to be killed, behind a round-robin proxy.
struct Pair {
    _scratch: ScratchDir,
    victim: kvmesh_e2e::Spawned,
    survivor: kvmesh_e2e::Spawned,
    victim_url: String,
    proxy: kvmesh_e2e::Spawned,
    client: HttpClient,
}

impl Pair {
    fn start(name: &str) -> Self {
        let scratch = ScratchDir::new(name).unwrap();
        // Real-time decode (~6 ms per token): a 300-token stream lasts about two seconds.
        let victim = start_engines(&scratch, 1, &[]).unwrap();
        let survivor = start_engines(&scratch, 1, &[]).unwrap();
        let victim_url = engine_urls(&victim)[0].clone();
        let urls = [engine_urls(&victim), engine_urls(&survivor)].concat();
        let proxy = start_proxy(&scratch, &proxy_config(&urls, "")).unwrap();
        Self {
            _scratch: scratch,
            victim,
            survivor,
            victim_url,
            proxy,
            client: HttpClient::http1(),
        }
    }

    /// Opens one stream per `(path under /v1/, body)` of `requests` and reads each one's
    /// first chunk, then kills the victim; the streams, half of which round robin put on it.
    async fn open_then_kill<'a>(
        &mut self,
        requests: impl IntoIterator<Item = (&'a str, serde_json::Value)>,
    ) -> Vec<OpenStream> {
        let streams = open_streams_with(&self.client, &self.proxy.url("main"), requests)
            .await
            .unwrap();
        let on_victim = streams.iter().filter(|s| s.instance == self.victim_url);
        assert_eq!(on_victim.count(), streams.len() / 2, "round robin");
        self.victim.kill();
        streams
    }

    /// The survivor's URL.
    fn survivor_url(&self) -> String {
        engine_urls(&self.survivor)[0].clone()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_on_a_killed_engine_continue_on_another() {
    const STREAMS: usize = 20;
    const MAX_TOKENS: u64 = 300;
    let mut pair = Pair::start("migrate");

    // Half chat, half completions; round robin puts every other one on the victim.
    let streams = pair
        .open_then_kill(chat_and_completions(STREAMS, MAX_TOKENS))
        .await;
    let bodies = assert_all_whole(streams, MAX_TOKENS, Duration::from_secs(30))
        .await
        .unwrap();
    // Each moved stream says where it went on, once, in a comment clients skip.
    let survivor_url = pair.survivor_url();
    for (instance, body) in &bodies {
        let expected = if *instance == pair.victim_url {
            vec![format!(
                "x-kvmesh-route migration=1; instance={survivor_url}"
            )]
        } else {
            Vec::new()
        };
        assert_eq!(sse_comments(body), expected, "a stream first on {instance}");
    }
    assert_migrations(&pair.client, &pair.proxy, STREAMS / 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_streams_on_a_killed_engine_continue_without_a_second_echo() {
    const STREAMS: usize = 6;
    const MAX_TOKENS: u64 = 300;
    let mut pair = Pair::start("migrate-echo");

    let prompt = |i: usize| format!("echo-marker-{i}");
    let requests = (0..STREAMS).map(|i| {
        let body = serde_json::json!({"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS,
                          "stream": true, "echo": true});
        ("completions", body)
    });
    let streams = pair.open_then_kill(requests).await;
    let bodies = assert_all_whole(streams, MAX_TOKENS, Duration::from_secs(30))
        .await
        .unwrap();
    for (i, (_, body)) in bodies.iter().enumerate() {
        let text: String = sse_data(body)
            .iter()
            .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
            .filter_map(|chunk| chunk["choices"][0]["text"].as_str().map(str::to_owned))
            .collect();
        assert!(text.starts_with(&prompt(i)), "stream {i}: {text:.80}");
        assert_eq!(
            text.matches(&prompt(i)).count(),
            1,
            "stream {i}: echoed once"
        );
    }
    assert_migrations(&pair.client, &pair.proxy, STREAMS / 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_of_several_choices_continue_each_choice_on_another() {
    const STREAMS: usize = 6;
    const CHOICES: u64 = 3;
    const MAX_TOKENS: u64 = 200;
    let mut pair = Pair::start("migrate-choices");

    // Half chat (with a usage chunk), half completions echoing their prompt, each with three
    // choices.
    let requests = chat_and_completions(STREAMS, MAX_TOKENS).map(|(path, mut body)| {
        body["n"] = CHOICES.into();
        if path == "completions" {
            body["echo"] = true.into();
        }
        (path, body)
    });
    let streams = pair.open_then_kill(requests).await;
    let survivor_url = pair.survivor_url();
    for stream in streams {
        let (index, instance) = (stream.index, stream.instance.clone());
        let rest = tokio::time::timeout(Duration::from_secs(30), stream.stream.rest())
            .await
            .expect("the stream ends in time")
            .unwrap();
        let body = [stream.first.as_ref(), rest.as_ref()].concat();
        let what = format!("stream {index}");
        assert_whole_choices(&body, CHOICES, MAX_TOKENS, &what);
        if index % 2 == 1 {
            // Each choice's text starts with the prompt, echoed once.
            let prompt = format!("Once {index}");
            let mut texts = vec![String::new(); CHOICES as usize];
            for data in sse_data(&body) {
                let Ok(chunk) = serde_json::from_str::<serde_json::Value>(&data) else {
                    continue;
                };
                for choice in chunk["choices"].as_array().into_iter().flatten() {
                    let at = choice["index"].as_u64().unwrap() as usize;
                    texts[at].push_str(choice["text"].as_str().unwrap_or(""));
                }
            }
            for text in &texts {
                assert!(text.starts_with(&prompt), "{what}: {text:.60}");
                assert_eq!(text.matches(&prompt).count(), 1, "{what}: {text:.60}");
            }
        }
        // A moved stream's choices go on one after another, each saying so once.
        let expected: Vec<String> = if instance == pair.victim_url {
            (0..CHOICES)
                .map(|choice| {
                    format!("x-kvmesh-route migration=1; choice={choice}; instance={survivor_url}")
                })
                .collect()
        } else {
            Vec::new()
        };
        assert_eq!(sse_comments(&body), expected, "{what}");
    }
    assert_migrations(&pair.client, &pair.proxy, STREAMS / 2).await;
}

/// The sum over `engines` of their metric `name`.
async fn engines_total(client: &HttpClient, engines: &[String], name: &str) -> f64 {
    let mut total = 0.0;
    for engine in engines {
        let text = client.get(&format!("{engine}/metrics")).await.unwrap();
        total +=
            kvmesh_e2e::control_plane::metric_total(&String::from_utf8_lossy(&text.body), name);
    }
    total
}

/// 200 streams whose clients read the first piece and then nothing. Most are 2,000 tokens
/// (about 440 KB), which the kernel's socket buffers take whole: the proxy finishes them and
/// holds nothing for them. Eight are 40,000 tokens (about 9 MB, over the 4 MB a socket's send
/// buffer grows to here): the proxy's writes stall, and `limits.write_timeout` (5 s here) cuts
/// each of those, closing its connection and cancelling its engine request. Meanwhile the
/// proxy's memory grows by at most 64 MB and other clients are served; afterwards nothing is
/// in flight, on the engines or in the proxy's bookings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_stop_reading_are_cut_by_the_write_timeout_and_hold_nothing() {
    const STALLED: u32 = 200;
    const LONG: u32 = 8;
    let scratch = ScratchDir::new("stalled-readers").unwrap();
    // Streams as fast as the proxy takes them: a stalled client's buffers fill at once.
    let sims = start_engines(&scratch, 2, &["--no-delay", "--max-num-seqs", "512"]).unwrap();
    let engines = engine_urls(&sims);
    let config = proxy_config(&engines, "limits:\n  write_timeout: 5s\n").replace(
        "policy: round_robin",
        "policy: kv\n    kv:\n      block_size: 64",
    );
    let proxy = start_proxy(&scratch, &config).unwrap();
    let metrics_url = format!("{}/metrics", proxy.url("admin"));
    let url = format!("{}/v1/completions", proxy.url("main"));
    let prompt = |seed: u32, max_tokens: u32, stream: bool| {
        let ids: Vec<u32> = (0..128).map(|i| 1_000 + seed * 7_919 + i).collect();
        let mut body = kvmesh_e2e::control_plane::model_prompt(MODEL, &ids, max_tokens);
        body["stream"] = serde_json::Value::Bool(stream);
        body.to_string()
    };
    let client = HttpClient::http1();
    let headers = [("content-type", "application/json")];
    let warm = client
        .call(Method::POST, &url, &headers, prompt(0, 4, false))
        .await
        .unwrap();
    assert_eq!(warm.status, 200);
    let baseline = proxy.rss_bytes();

    // Each stalled client has its own connection with a 4 KiB receive buffer.
    let stalled_client = HttpClient::http1_small_window(4096);
    let mut opening = tokio::task::JoinSet::new();
    for seed in 1..=STALLED {
        let max_tokens = if seed <= LONG { 40_000 } else { 2_000 };
        let (client, url, body) = (
            stalled_client.clone(),
            url.clone(),
            prompt(seed, max_tokens, true),
        );
        opening.spawn(async move {
            let headers = [("content-type", "application/json")];
            let mut stream = client
                .send(Method::POST, &url, &headers, body)
                .await
                .unwrap();
            assert_eq!(stream.status, 200);
            assert!(
                stream.next_chunk().await.unwrap().is_some(),
                "a first piece"
            );
            stream
        });
    }
    let mut opened = Vec::new();
    while let Some(stream) = opening.join_next().await {
        opened.push(stream.unwrap());
    }

    // While they stall: others are served, and the proxy's memory is sampled until the long
    // streams were cut and nothing is in flight.
    let in_flight = format!("kvmesh_requests_in_flight{{model=\"{MODEL}\"}}");
    let cut_series = format!("kvmesh_client_write_timeouts_total{{model=\"{MODEL}\"}}");
    let mut peak = baseline;
    let mut served = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let cut = loop {
        peak = peak.max(proxy.rss_bytes());
        let text = client.get(&metrics_url).await.unwrap();
        let text = String::from_utf8_lossy(&text.body).into_owned();
        let metric = |series: &str| kvmesh_e2e::control_plane::metric(&text, series);
        let cut = metric(&cut_series).unwrap_or(0.0);
        if cut >= f64::from(LONG) && metric(&in_flight) == Some(0.0) {
            break cut;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{cut} of {LONG} long streams cut, {:?} in flight",
            metric(&in_flight)
        );
        let answer = client
            .call(
                Method::POST,
                &url,
                &headers,
                prompt(10_000 + served, 4, false),
            )
            .await
            .unwrap();
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        served += 1;
    };
    assert_eq!(
        cut,
        f64::from(LONG),
        "only the streams the kernel could not hold are cut"
    );
    assert!(served > 0, "no other client was served while they stalled");
    let grown = peak.saturating_sub(baseline);
    assert!(
        grown <= 64 << 20,
        "the proxy's memory grew by {} MB while {STALLED} readers stalled",
        grown >> 20
    );
    drop(opened);

    // Nothing is left in flight: not on the engines, not in the proxy's bookings.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while engines_total(&client, &engines, "vllm:num_requests_running").await
        + engines_total(&client, &engines, "vllm:num_requests_waiting").await
        > 0.0
    {
        assert!(std::time::Instant::now() < deadline, "engines still busy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let explained = client
        .call(
            Method::POST,
            &format!("{}/debug/route?route=completions", proxy.url("admin")),
            &headers,
            prompt(0, 4, false),
        )
        .await
        .unwrap()
        .json()
        .unwrap();
    for instance in explained["instances"].as_array().expect("instances") {
        assert_eq!(instance["active_requests"], 0, "{explained}");
        assert_eq!(instance["active_blocks"], 0, "{explained}");
    }
}
