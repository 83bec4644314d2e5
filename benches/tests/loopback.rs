//! kvmesh-bench against a small in-process OpenAI-like server on loopback.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use kvmesh_bench::cli::Args;
use kvmesh_bench::run::run;

/// Delay before the first token of a stream.
const FIRST_TOKEN_DELAY: Duration = Duration::from_millis(20);
/// Delay between tokens of a stream.
const TOKEN_GAP: Duration = Duration::from_millis(2);
/// Tokens per response.
const TOKENS: u64 = 4;

/// A response body fed frame by frame from a channel.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|chunk| chunk.map(|b| Ok(Frame::data(b))))
    }
}

async fn respond(request: Request<Incoming>) -> Result<Response<ChannelBody>, Infallible> {
    let path = request.uri().path().to_owned();
    let body = request
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let stream = json["stream"].as_bool().unwrap_or(false);
    let (tx, rx) = mpsc::channel(16);
    let mut response = Response::new(ChannelBody(rx));
    if path.starts_with("/busy/") {
        *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        tokio::spawn(async move { tx.send(Bytes::from_static(b"{\"error\":{}}")).await });
        return Ok(response);
    }
    let cut_short = path.starts_with("/cut/");
    tokio::spawn(async move {
        if !stream {
            let body = format!(
                "{{\"choices\":[{{\"text\":\"hello\"}}],\"usage\":{{\"prompt_tokens\":3,\"completion_tokens\":{TOKENS}}}}}"
            );
            let _ = tx.send(Bytes::from(body)).await;
            return;
        }
        let _ = tx
            .send(Bytes::from_static(
                b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            ))
            .await;
        tokio::time::sleep(FIRST_TOKEN_DELAY).await;
        for i in 0..TOKENS {
            if i > 0 {
                tokio::time::sleep(TOKEN_GAP).await;
            }
            // Split each event in two frames to cross a chunk boundary mid-line.
            let _ = tx
                .send(Bytes::from_static(
                    b"data: {\"choices\":[{\"delta\":{\"cont",
                ))
                .await;
            let _ = tx.send(Bytes::from_static(b"ent\":\"tok\"}}]}\n\n")).await;
        }
        if !cut_short {
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        }
    });
    Ok(response)
}

async fn start_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local address");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service_fn(respond))
                    .await;
            });
        }
    });
    addr
}

fn args(url: &str, extra: &[&str]) -> Args {
    let mut argv = vec!["kvmesh-bench", "--url", url];
    argv.extend_from_slice(extra);
    Args::try_parse_from(argv).expect("valid arguments")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_counts_requests_and_reported_tokens() {
    let url = format!("http://{}", start_server().await);
    let report = run(&args(&url, &["--concurrency", "4", "--requests", "40"]))
        .await
        .expect("run");
    assert_eq!(report.requests_ok, 40);
    assert_eq!(report.errors_total, 0);
    assert_eq!(report.output_tokens, 40 * TOKENS);
    assert_eq!(report.e2e_ms.expect("latencies").count, 40);
    assert!(report.ttft_ms.is_none());
    assert!(report.requests_per_s > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_times_first_token_and_gaps() {
    let url = format!("http://{}", start_server().await);
    let report = run(&args(
        &url,
        &["--stream", "--concurrency", "2", "--requests", "10"],
    ))
    .await
    .expect("run");
    assert_eq!(report.requests_ok, 10);
    assert_eq!(report.output_tokens, 10 * TOKENS);
    let ttft = report.ttft_ms.expect("TTFT recorded");
    assert_eq!(ttft.count, 10);
    let first_token_ms = FIRST_TOKEN_DELAY.as_secs_f64() * 1000.0;
    assert!(ttft.p50 >= first_token_ms, "TTFT {ttft:?}");
    let itl = report.itl_ms.expect("ITL recorded");
    assert_eq!(itl.count, 10 * (TOKENS - 1));
    let e2e = report.e2e_ms.expect("E2E recorded");
    let min_e2e_ms = first_token_ms + (TOKENS - 1) as f64 * TOKEN_GAP.as_secs_f64() * 1000.0;
    assert!(e2e.p50 >= min_e2e_ms, "E2E {e2e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_over_h2c() {
    let url = format!("http://{}", start_server().await);
    let report = run(&args(
        &url,
        &[
            "--http2",
            "--stream",
            "--concurrency",
            "8",
            "--requests",
            "16",
        ],
    ))
    .await
    .expect("run");
    assert_eq!(report.requests_ok, 16);
    assert_eq!(report.errors_total, 0);
    assert_eq!(report.itl_ms.expect("ITL").count, 16 * (TOKENS - 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_counted_by_kind() {
    let addr = start_server().await;
    let busy = run(&args(
        &format!("http://{addr}/busy"),
        &["--concurrency", "2", "--requests", "6"],
    ))
    .await
    .expect("run");
    assert_eq!(busy.requests_ok, 0);
    assert_eq!(busy.errors.get("status_503"), Some(&6));

    let cut = run(&args(
        &format!("http://{addr}/cut"),
        &["--stream", "--concurrency", "1", "--requests", "3"],
    ))
    .await
    .expect("run");
    assert_eq!(cut.errors.get("incomplete_stream"), Some(&3));

    let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let dead = closed.local_addr().expect("address");
    drop(closed);
    let refused = run(&args(
        &format!("http://{dead}"),
        &["--concurrency", "1", "--requests", "2"],
    ))
    .await
    .expect("run");
    assert_eq!(refused.errors.get("connect"), Some(&2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_sends_the_requested_count_and_honours_the_deadline() {
    let url = format!("http://{}", start_server().await);
    let counted = run(&args(&url, &["--rate", "2000", "--requests", "50"]))
        .await
        .expect("run");
    assert_eq!(counted.requests_ok, 50);

    let timed = run(&args(
        &url,
        &["--stream", "--rate", "200", "--duration", "300ms"],
    ))
    .await
    .expect("run");
    assert_eq!(timed.duration_s, 0.3);
    assert_eq!(timed.errors_total, 0);
    // Poisson with mean 60 arrivals in the window; streams still open at the deadline drop out.
    assert!(
        (20..=110).contains(&timed.requests_ok),
        "{} requests",
        timed.requests_ok
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeouts_are_counted() {
    let url = format!("http://{}", start_server().await);
    let report = run(&args(
        &url,
        &[
            "--stream",
            "--timeout",
            "5ms",
            "--concurrency",
            "1",
            "--requests",
            "3",
        ],
    ))
    .await
    .expect("run");
    assert_eq!(report.errors.get("timeout"), Some(&3));
}
