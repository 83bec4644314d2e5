//! Reading the SSE answers of streamed chat and completions requests.

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
    let content = |c: &serde_json::Value| {
        let choice = &c["choices"][0];
        choice["text"]
            .as_str()
            .or_else(|| choice["delta"]["content"].as_str())
            .is_some_and(|piece| !piece.is_empty())
    };
    let tokens = chunks.iter().filter(|c| content(c)).count() as u64;
    assert_eq!(tokens, max_tokens, "{what}: every token once");
    if let Some(usage) = chunks
        .iter()
        .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
    {
        assert_eq!(usage["completion_tokens"], max_tokens, "{what}: {usage}");
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(usage["prompt_tokens"].as_u64().unwrap() + max_tokens),
            "{what}: {usage}"
        );
    }
}
