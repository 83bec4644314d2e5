//! Opening streamed chat and completions requests and reading their SSE answers.

use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http::Method;

use crate::cluster::{MODEL, chat_body};
use crate::{HttpClient, StreamingResponse};

/// The `data:` values of an SSE body, in order.
pub fn sse_data(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .split("\n\n")
        .filter_map(|event| event.trim().strip_prefix("data: ").map(str::to_owned))
        .collect()
}

/// Asserts that `body`, a streamed chat or completions answer (`what` names it in failure
/// messages), is one whole stream: no error event, one `id` throughout, exactly
/// `max_tokens` events carrying text, one final `[DONE]`, and a usage chunk (when there is
/// one) that counts every token.
pub fn assert_whole_stream(body: &[u8], max_tokens: u64, what: &str) {
    assert_whole_choices(body, 1, max_tokens, what);
}

/// [`assert_whole_stream`] for a stream of `choices` choices (`n`): each of the indexes
/// `0..choices` has exactly `max_tokens` events carrying text and one finish, and the usage
/// chunk counts the tokens of them all.
pub fn assert_whole_choices(body: &[u8], choices: u64, max_tokens: u64, what: &str) {
    let data = sse_data(body);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{what}");
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1, "{what}");
    let chunks: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(
        chunks.iter().all(|c| c.get("error").is_none()),
        "{what}: {data:?}"
    );
    let ids: std::collections::BTreeSet<&str> =
        chunks.iter().filter_map(|c| c["id"].as_str()).collect();
    assert_eq!(ids.len(), 1, "{what}: one id throughout");
    let mut tokens = vec![0u64; choices as usize];
    let mut finishes = vec![0u64; choices as usize];
    for choice in chunks.iter().flat_map(|c| c["choices"].as_array().unwrap()) {
        let index = choice["index"].as_u64().expect("an index") as usize;
        assert!(index < tokens.len(), "{what}: choice {index}");
        let piece = choice["text"]
            .as_str()
            .or_else(|| choice["delta"]["content"].as_str());
        tokens[index] += u64::from(piece.is_some_and(|piece| !piece.is_empty()));
        finishes[index] += u64::from(!choice["finish_reason"].is_null());
    }
    assert_eq!(
        tokens,
        vec![max_tokens; choices as usize],
        "{what}: every token once"
    );
    assert_eq!(
        finishes,
        vec![1; choices as usize],
        "{what}: one finish each"
    );
    if let Some(usage) = chunks
        .iter()
        .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
    {
        let completion = choices * max_tokens;
        assert_eq!(usage["completion_tokens"], completion, "{what}: {usage}");
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(usage["prompt_tokens"].as_u64().unwrap() + completion),
            "{what}: {usage}"
        );
    }
}

/// One stream opened by [`open_streams`].
pub struct OpenStream {
    /// Its position among the streams opened.
    pub index: usize,
    /// The instance that answered (`x-kvmesh-instance`).
    pub instance: String,
    /// Its first body chunk.
    pub first: Bytes,
    /// The rest of it.
    pub stream: StreamingResponse,
}

impl OpenStream {
    /// Reads the rest within `deadline` and asserts the whole answer is one stream of
    /// `max_tokens` tokens ([`assert_whole_stream`]); the whole body.
    pub async fn assert_whole(
        self,
        max_tokens: u64,
        deadline: Duration,
    ) -> anyhow::Result<Vec<u8>> {
        let rest = tokio::time::timeout(deadline, self.stream.rest())
            .await
            .context("the stream did not end in time")??;
        let body = [self.first.as_ref(), rest.as_ref()].concat();
        assert_whole_stream(&body, max_tokens, &format!("stream {}", self.index));
        Ok(body)
    }
}

/// [`OpenStream::assert_whole`] for each of `streams`, in turn; each one's first instance
/// and whole body.
pub async fn assert_all_whole(
    streams: Vec<OpenStream>,
    max_tokens: u64,
    deadline: Duration,
) -> anyhow::Result<Vec<(String, Vec<u8>)>> {
    let mut bodies = Vec::with_capacity(streams.len());
    for stream in streams {
        let instance = stream.instance.clone();
        bodies.push((instance, stream.assert_whole(max_tokens, deadline).await?));
    }
    Ok(bodies)
}

/// The comments (`: ...` lines, without the colon and space) of an SSE body, in order.
pub fn sse_comments(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .lines()
        .filter_map(|line| line.strip_prefix(": ").map(str::to_owned))
        .collect()
}

/// `count` streamed requests of `max_tokens` tokens, each with its own prompt, alternately
/// chat (with a usage chunk) and completions: `(path under /v1/, body)` for
/// [`open_streams_with`].
pub fn chat_and_completions(
    count: usize,
    max_tokens: u64,
) -> impl Iterator<Item = (&'static str, serde_json::Value)> {
    (0..count).map(move |index| {
        if index % 2 == 0 {
            let mut body = chat_body(&format!("tell story {index}"), max_tokens as u32, true);
            body["stream_options"] = serde_json::json!({"include_usage": true});
            ("chat/completions", body)
        } else {
            let body = serde_json::json!({"model": MODEL, "prompt": format!("Once {index}"),
                "max_tokens": max_tokens, "stream": true});
            ("completions", body)
        }
    })
}

/// Opens `count` streams of `max_tokens` tokens through the proxy at `main` (its data
/// listener's URL), each with its own prompt, alternately chat (with a usage chunk) and
/// completions, and reads each one's first chunk.
pub async fn open_streams(
    client: &HttpClient,
    main: &str,
    count: usize,
    max_tokens: u64,
) -> anyhow::Result<Vec<OpenStream>> {
    open_streams_with(client, main, chat_and_completions(count, max_tokens)).await
}

/// Opens one stream per `(path under /v1/, body)` of `requests` through the proxy at `main`,
/// and reads each one's first chunk.
pub async fn open_streams_with(
    client: &HttpClient,
    main: &str,
    requests: impl IntoIterator<Item = (&str, serde_json::Value)>,
) -> anyhow::Result<Vec<OpenStream>> {
    let mut streams = Vec::new();
    for (index, (path, body)) in requests.into_iter().enumerate() {
        let url = format!("{main}/v1/{path}");
        let headers = [("content-type", "application/json")];
        let mut stream = client
            .send(Method::POST, &url, &headers, body.to_string())
            .await?;
        anyhow::ensure!(stream.status == 200, "stream {index}: {}", stream.status);
        let first = stream.next_chunk().await?.context("no first chunk")?;
        let instance = stream.headers["x-kvmesh-instance"].to_str()?.to_owned();
        streams.push(OpenStream {
            index,
            instance,
            first,
            stream,
        });
    }
    Ok(streams)
}
