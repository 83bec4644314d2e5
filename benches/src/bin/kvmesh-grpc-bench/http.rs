//! OpenAI `/v1/completions` over HTTP/1.1 or h2c.

use anyhow::{Context, bail};
use bytes::Bytes;
use http::{Method, Request, header};
use http_body_util::{BodyExt, Full};
use kvmesh_bench::connection::{Connector, Sender};
use tokio::time::Instant;

use crate::Args;
use crate::load::{Sample, Shape, Worker};

/// One worker's connection and its request.
pub(crate) struct HttpWorker {
    sender: Sender,
    authority: String,
    h2c: bool,
    body: Bytes,
}

/// `args.concurrency` workers: a connection each (HTTP/1.1), or one shared (h2c).
pub(crate) async fn workers(
    args: &Args,
    h2c: bool,
    shape: Shape,
    prompt: &str,
) -> anyhow::Result<Vec<Worker>> {
    let body = serde_json::json!({
        "model": args.model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "stream": shape == Shape::Stream,
    });
    let body = Bytes::from(serde_json::to_vec(&body)?);
    let connector = Connector::new(args.http, h2c);
    let mut workers = Vec::with_capacity(args.concurrency);
    for _ in 0..args.concurrency {
        let sender = connector.connect().await.context("HTTP connect")?;
        workers.push(Worker::Http(HttpWorker {
            sender,
            authority: args.http.to_string(),
            h2c,
            body: body.clone(),
        }));
    }
    Ok(workers)
}

impl HttpWorker {
    /// Sends the request and reads the whole answer.
    pub(crate) async fn send(&mut self) -> anyhow::Result<Sample> {
        // HTTP/1.1: origin-form and `Host`; HTTP/2: the authority goes in the URI.
        let request = if self.h2c {
            Request::builder().uri(format!("http://{}/v1/completions", self.authority))
        } else {
            Request::builder()
                .uri("/v1/completions")
                .header(header::HOST, &self.authority)
        };
        let request = request
            .method(Method::POST)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(self.body.clone()))?;
        self.sender.ready().await?;
        let started = Instant::now();
        let response = self.sender.send(request).await?;
        if !response.status().is_success() {
            bail!("status {}", response.status());
        }
        let mut body = response.into_body();
        let mut first = None;
        while let Some(frame) = body.frame().await {
            if frame?.is_data() && first.is_none() {
                first = Some(started.elapsed());
            }
        }
        let total = started.elapsed();
        Ok(Sample {
            started,
            first: first.unwrap_or(total),
            total,
        })
    }
}
