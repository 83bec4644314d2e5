//! Accept loop: HTTP/1.1 and h2c (prior knowledge) on one port, `TCP_NODELAY`, graceful stop.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::body::ResponseBody;
use super::state::EngineState;
use super::{bootstrap, router};

/// How long a stopping engine waits for open connections to finish.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves the engine's API on `listener` until `shutdown` changes or its sender is dropped.
pub(crate) async fn serve(
    listener: TcpListener,
    state: Arc<EngineState>,
    shutdown: watch::Receiver<bool>,
) {
    serve_with(listener, state, shutdown, router::handle).await;
}

/// Serves a prefill engine's SGLang bootstrap server on `listener`, as [`serve`].
pub(crate) async fn serve_bootstrap(
    listener: TcpListener,
    state: Arc<EngineState>,
    shutdown: watch::Receiver<bool>,
) {
    serve_with(listener, state, shutdown, bootstrap::handle).await;
}

/// Answers every request on `listener` with `handler`.
async fn serve_with<H, F>(
    listener: TcpListener,
    state: Arc<EngineState>,
    mut shutdown: watch::Receiver<bool>,
    handler: H,
) where
    H: Fn(Arc<EngineState>, Request<Incoming>) -> F + Copy + Send + Sync + 'static,
    F: Future<Output = Response<ResponseBody>> + Send + 'static,
{
    let builder = Arc::new(Builder::new(TokioExecutor::new()));
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!(error = %e, "cannot set TCP_NODELAY");
                    }
                    conns.spawn(serve_connection(stream, state.clone(), builder.clone(), shutdown.clone(), handler));
                }
                Err(e) => {
                    // E.g. out of file descriptors: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
            _ = shutdown.changed() => break,
        }
    }
    drop(listener);
    let drained = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while conns.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        conns.abort_all();
    }
}

async fn serve_connection<H, F>(
    stream: tokio::net::TcpStream,
    state: Arc<EngineState>,
    builder: Arc<Builder<TokioExecutor>>,
    mut shutdown: watch::Receiver<bool>,
    handler: H,
) where
    H: Fn(Arc<EngineState>, Request<Incoming>) -> F + Copy + Send + Sync + 'static,
    F: Future<Output = Response<ResponseBody>> + Send + 'static,
{
    let service = service_fn(move |req| {
        let state = state.clone();
        async move { Ok::<_, Infallible>(handler(state, req).await) }
    });
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        _ = shutdown.changed() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}
