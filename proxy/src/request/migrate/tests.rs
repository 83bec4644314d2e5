use super::*;
use crate::openai::headers::ClientFraming;
use serde_json::json;

fn chat_chunk(content: &str, finish: Option<&str>) -> String {
    let chunk = json!({
        "id": "chatcmpl-a", "created": 7, "model": "m", "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]
    });
    format!("data: {chunk}\n\n")
}

/// The migration of a stream with `body` whose answer started as an open SSE stream.
fn migration(route: Route, body: Value) -> Migration {
    let mut migration =
        Migration::new(route, body.to_string().as_bytes(), true, 1, None).expect("migratable");
    migration.started(ClientFraming::Open);
    migration
}

#[test]
fn only_extendable_streams_migrate() {
    let migrates = |route, body: &Value, stream, limit| {
        Migration::new(route, body.to_string().as_bytes(), stream, limit, None).is_some()
    };
    let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    assert!(migrates(Route::ChatCompletions, &chat, true, 1));
    assert!(!migrates(Route::ChatCompletions, &chat, false, 1));
    assert!(!migrates(Route::ChatCompletions, &chat, true, 0));
    let mut two = chat.clone();
    two["n"] = 2.into();
    assert!(migrates(Route::ChatCompletions, &two, true, 1));
    two["n"] = 0.into();
    assert!(!migrates(Route::ChatCompletions, &two, true, 1));
    let ids = json!({"model": "m", "prompt": [1, 2, 3]});
    assert!(!migrates(Route::Completions, &ids, true, 1));
    let echo = json!({"model": "m", "prompt": "x", "echo": true});
    assert!(migrates(Route::Completions, &echo, true, 1));
    let echoed_twice = json!({"model": "m", "prompt": "x", "echo": true, "n": 2});
    assert!(migrates(Route::Completions, &echoed_twice, true, 1));
    let echoed_ids = json!({"model": "m", "prompt": [1, 2, 3], "echo": true});
    assert!(!migrates(Route::Completions, &echoed_ids, true, 1));
    let text = json!({"model": "m", "prompt": ["x"]});
    assert!(migrates(Route::Completions, &text, true, 1));
    assert!(!migrates(Route::Embeddings, &text, true, 1));
}

#[test]
fn a_broken_chat_stream_continues_with_what_was_sent() {
    let mut m = migration(
        Route::ChatCompletions,
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
               "max_completion_tokens": 10, "stream": true}),
    );
    let first = format!(
        "data: {}\n\n{}{}",
        json!({"id": "chatcmpl-a", "created": 7, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
        chat_chunk("Hello", None),
        chat_chunk(" there", None),
    );
    let passed = m.pass(Bytes::from(first.clone()));
    assert_eq!(
        passed.forward,
        Bytes::from(first),
        "the first attempt passes untouched"
    );
    assert!(!passed.broken);
    let body: Value = serde_json::from_slice(&m.next_body().expect("may migrate")).unwrap();
    assert_eq!(
        body["messages"],
        json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}])
    );
    assert_eq!(body["continue_final_message"], true);
    assert_eq!(body["add_generation_prompt"], false);
    assert_eq!(body["max_completion_tokens"], 8);
    assert!(m.continuing());
    assert_eq!(m.next_body(), None, "the limit was one migration");

    // The continuation's events carry the first stream's id; its role event is dropped;
    // its usage counts the tokens sent before it.
    let continuation = format!(
        "data: {}\n\n{}data: {}\n\ndata: [DONE]\n\n",
        json!({"id": "chatcmpl-b", "created": 9, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
        chat_chunk(" friend", Some("stop")).replace("chatcmpl-a", "chatcmpl-b"),
        json!({"id": "chatcmpl-b", "created": 9, "model": "m", "choices": [],
               "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}),
    );
    let passed = m.pass(Bytes::from(continuation));
    let text = String::from_utf8(passed.forward.to_vec()).unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 3, "{text}");
    let content: Value = serde_json::from_str(&events[0]["data: ".len()..]).unwrap();
    assert_eq!(
        (content["id"].as_str(), content["created"].as_u64()),
        (Some("chatcmpl-a"), Some(7))
    );
    assert_eq!(content["choices"][0]["delta"]["content"], " friend");
    let usage: Value = serde_json::from_str(&events[1]["data: ".len()..]).unwrap();
    assert_eq!(usage["id"], "chatcmpl-a");
    assert_eq!(
        usage["usage"],
        json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13})
    );
    assert_eq!(events[2], "data: [DONE]");
}

#[test]
fn an_engine_error_event_breaks_the_stream_and_is_not_forwarded() {
    let mut m = migration(
        Route::Completions,
        json!({"model": "m", "prompt": "Once", "max_tokens": 5}),
    );
    let chunk = |text: &str| {
        format!(
            "data: {}\n\n",
            json!({"id": "cmpl-a", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": text, "finish_reason": null}]})
        )
    };
    let error = format!(
        "data: {}\n\n",
        json!({"error": {"message": "engine died", "code": 500}})
    );
    let passed = m.pass(Bytes::from(format!(
        "{}{}{error}",
        chunk(" upon"),
        chunk(" a")
    )));
    assert!(passed.broken);
    assert_eq!(
        passed.forward,
        Bytes::from(format!("{}{}", chunk(" upon"), chunk(" a")))
    );
    let body: Value = serde_json::from_slice(&m.next_body().unwrap()).unwrap();
    assert_eq!(body["prompt"], "Once upon a");
    assert_eq!(body["max_tokens"], 3);
}

#[test]
fn a_finished_or_spent_stream_does_not_migrate() {
    let mut m = migration(
        Route::ChatCompletions,
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    );
    assert_eq!(m.next_body(), None, "nothing identified the stream yet");
    m.pass(Bytes::from(format!(
        "{}{}",
        chat_chunk("a", None),
        chat_chunk("b", None)
    )));
    assert_eq!(m.next_body(), None, "all max_tokens were sent");
    let mut m = migration(
        Route::ChatCompletions,
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
    );
    m.pass(Bytes::from(chat_chunk("a", Some("stop"))));
    assert_eq!(m.next_body(), None, "the engine had finished");
}

#[test]
fn a_client_continuation_is_extended_in_place_and_crlf_events_split() {
    let mut m = migration(
        Route::ChatCompletions,
        json!({"model": "m", "continue_final_message": true, "add_generation_prompt": false,
               "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Dear"}]}),
    );
    m.pass(Bytes::from(
        chat_chunk(" Sir", None).replace("\n\n", "\r\n\r\n"),
    ));
    let body: Value = serde_json::from_slice(&m.next_body().unwrap()).unwrap();
    assert_eq!(body["messages"][1]["content"], "Dear Sir");
    assert_eq!(body["messages"].as_array().map(Vec::len), Some(2));
    let events: Vec<&[u8]> = split_events(b"data: a\r\n\r\ndata: b\n\ndata: c").collect();
    assert_eq!(
        events,
        [&b"data: a\r\n\r\n"[..], b"data: b\n\n", b"data: c"]
    );
}

#[test]
fn a_continuation_whose_events_end_in_bare_carriage_returns_keeps_every_event() {
    let mut m = migration(
        Route::ChatCompletions,
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}],
               "max_completion_tokens": 10, "stream": true}),
    );
    m.pass(Bytes::from(chat_chunk("Hello", None)));
    assert!(m.next_body().is_some() && m.continuing());
    // Two events in one piece, each ended by a blank line of bare `\r`s (valid SSE): each
    // is rewritten on its own, none merged into the one before.
    let continuation = format!(
        "{}{}",
        chat_chunk(" there", None).replace("\n\n", "\r\r"),
        chat_chunk(" friend", Some("stop")).replace("\n\n", "\r\r"),
    );
    let passed = m.pass(Bytes::from(continuation));
    let text = String::from_utf8(passed.forward.to_vec()).unwrap();
    assert!(
        text.contains(" there") && text.contains(" friend"),
        "{text}"
    );
    assert_eq!(passed.text_events, 2, "{text}");
}

/// The Qwen3 tokenizer fetched by `scripts/fetch-tokenizer.sh` (or `KVMESH_QWEN3_TOKENIZER`).
fn qwen3() -> Arc<ModelPreprocessor> {
    let dir = std::env::var_os("KVMESH_QWEN3_TOKENIZER")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/tokenizers/qwen3")
        });
    Arc::new(ModelPreprocessor::from_dir(&dir).unwrap_or_else(|e| {
        panic!("the Qwen3 tokenizer in {dir:?} ({e}): run scripts/fetch-tokenizer.sh")
    }))
}

#[test]
fn a_token_id_prompt_migrates_with_the_generated_text_encoded_when_there_is_a_tokenizer() {
    let tokenizer = qwen3();
    let body = |prompt: Value| json!({"model": "m", "prompt": prompt, "max_tokens": 5});
    for prompt in [json!([9707, 11]), json!([[9707, 11]])] {
        let raw = body(prompt).to_string();
        assert!(Migration::new(Route::Completions, raw.as_bytes(), true, 1, None).is_none());
        let mut m = Migration::new(
            Route::Completions,
            raw.as_bytes(),
            true,
            1,
            Some(&tokenizer),
        )
        .expect("migratable with a tokenizer");
        m.started(ClientFraming::Open);
        let chunk = json!({"id": "cmpl-a", "created": 1, "model": "m",
                           "choices": [{"index": 0, "text": " world", "finish_reason": null}]});
        m.pass(Bytes::from(format!("data: {chunk}\n\n")));
        let next: Value = serde_json::from_slice(&m.next_body().unwrap()).unwrap();
        let mut expected = vec![9707, 11];
        expected.extend(tokenizer.encode_continuation(" world").unwrap());
        assert!(expected.len() > 2, "{expected:?}");
        assert_eq!(next["prompt"], json!(expected));
        assert_eq!(next["max_tokens"], 4);
    }
    // Not token ids, or not one prompt: not migrated by ids.
    for prompt in [json!([]), json!([1, "x"]), json!([[1], [2]]), json!([-1])] {
        let raw = body(prompt).to_string();
        assert!(
            Migration::new(
                Route::Completions,
                raw.as_bytes(),
                true,
                1,
                Some(&tokenizer)
            )
            .is_none(),
            "{raw}"
        );
    }
}

#[test]
fn an_echoed_prompt_is_not_generated_text_and_is_not_echoed_again() {
    let chunk = |text: &str| {
        format!(
            "data: {}\n\n",
            json!({"id": "cmpl-a", "created": 1, "model": "m",
                   "choices": [{"index": 0, "text": text, "finish_reason": null}]})
        )
    };
    let body = json!({"model": "m", "prompt": "Once", "max_tokens": 5, "echo": true});
    let mut m = migration(Route::Completions, body.clone());
    // vLLM sends the prompt with the first token's text.
    let passed = m.pass(Bytes::from(format!(
        "{}{}",
        chunk("Once upon"),
        chunk(" a")
    )));
    assert!(!passed.broken);
    let next: Value = serde_json::from_slice(&m.next_body().unwrap()).unwrap();
    assert_eq!(next["prompt"], "Once upon a");
    assert_eq!(next["echo"], false);
    assert_eq!(next["max_tokens"], 3);

    // An echo that is not the prompt: the generated text cannot be told apart.
    let mut m = migration(Route::Completions, body);
    m.pass(Bytes::from(chunk("Twice upon")));
    assert_eq!(m.next_body(), None);
}

/// A completions chunk of choice `index` from the stream `id`.
fn text_chunk(id: &str, index: u64, text: &str, finish: Option<&str>) -> String {
    let chunk = json!({"id": id, "created": 7, "model": "m", "object": "text_completion",
                       "choices": [{"index": index, "text": text, "finish_reason": finish}]});
    format!("data: {chunk}\n\n")
}

/// The data of each event of `forward`, parsed (`[DONE]` as a string).
fn forwarded(forward: &Bytes) -> Vec<Value> {
    let text = std::str::from_utf8(forward).unwrap();
    kvmesh_wire::sse::data_values(text.as_bytes())
        .map(|data| serde_json::from_slice(data).unwrap_or_else(|_| json!("[DONE]")))
        .collect()
}

#[test]
fn each_unfinished_choice_of_several_continues_in_turn() {
    let mut m = migration(
        Route::Completions,
        json!({"model": "m", "prompt": "Once", "n": 3, "max_tokens": 4, "stream": true,
               "stream_options": {"include_usage": true}}),
    );
    // Choice 1 finishes; 0 and 2 are cut after one and two tokens.
    m.pass(Bytes::from(
        [
            text_chunk("cmpl-a", 0, " upon", None),
            text_chunk("cmpl-a", 1, " there", Some("stop")),
            text_chunk("cmpl-a", 2, " more", None),
            text_chunk("cmpl-a", 2, " and", None),
        ]
        .concat(),
    ));
    assert!(m.may_continue());
    let body: Value = serde_json::from_slice(&m.next_body().expect("migrates")).unwrap();
    assert_eq!(
        (&body["prompt"], &body["max_tokens"], body.get("n")),
        (&json!("Once upon"), &json!(3), None),
        "choice 0 first, alone"
    );
    assert_eq!(m.choice_carried(), Some(0));

    // Choice 0's continuation: its index stays 0, its usage and [DONE] are dropped, since
    // choice 2 is still to go on.
    let passed = m.pass(Bytes::from(
        [
            text_chunk("cmpl-b", 0, " a", None),
            text_chunk("cmpl-b", 0, " time", Some("length")),
            format!(
                "data: {}\n\ndata: [DONE]\n\n",
                json!({"id": "cmpl-b", "created": 9, "model": "m", "choices": [],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
            ),
        ]
        .concat(),
    ));
    let events = forwarded(&passed.forward);
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(
        events
            .iter()
            .all(|e| e["id"] == "cmpl-a" && e["choices"][0]["index"] == 0)
    );
    assert!(m.another_choice());
    assert!(m.next_body().is_none(), "the one migration was spent");

    // Choice 2 goes on with its own text; the migration limit does not count it.
    let body: Value = serde_json::from_slice(&m.next_choice_body().unwrap()).unwrap();
    assert_eq!(
        (&body["prompt"], &body["max_tokens"]),
        (&json!("Once more and"), &json!(2))
    );
    assert_eq!(m.choice_carried(), Some(2));
    let passed = m.pass(Bytes::from(
        [
            text_chunk("cmpl-c", 0, " so", None),
            text_chunk("cmpl-c", 0, " on", Some("length")),
            format!(
                "data: {}\n\ndata: [DONE]\n\n",
                json!({"id": "cmpl-c", "created": 9, "model": "m", "choices": [],
                       "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})
            ),
        ]
        .concat(),
    ));
    let events = forwarded(&passed.forward);
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(events[0]["choices"][0]["index"], 2);
    assert_eq!(events[1]["choices"][0]["index"], 2);
    // 3 (choice 0) + 1 (choice 1) + 4 (choice 2) tokens; the prompt without choice 2's text.
    assert_eq!(
        events[2]["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 8, "total_tokens": 10})
    );
    assert_eq!(events[3], "[DONE]");
    assert!(!m.another_choice());
    assert!(!m.may_continue());
}

#[test]
fn a_choice_the_request_did_not_ask_for_stops_migration() {
    let mut m = migration(
        Route::Completions,
        json!({"model": "m", "prompt": "Once", "n": 2, "max_tokens": 4}),
    );
    m.pass(Bytes::from(text_chunk("cmpl-a", 0, " upon", None)));
    assert!(m.may_continue());
    m.pass(Bytes::from(text_chunk("cmpl-a", 2, " x", None)));
    assert!(!m.may_continue());
}

#[test]
fn the_transcript_counts_the_text_events_the_token_counter_would() {
    let role = json!({"id": "chatcmpl-a", "created": 7, "model": "m",
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]});
    let last = json!({"id": "chatcmpl-a", "created": 7, "model": "m",
                      "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]});
    let usage = json!({"id": "chatcmpl-a", "choices": [],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}});
    let chat = format!(
        "data: {role}\n\n{}{}{}data: {last}\n\ndata: {usage}\n\ndata: [DONE]\n\n",
        chat_chunk("Hello", None),
        chat_chunk(" \"there\"", None),
        chat_chunk("!", Some("length")),
    );
    let completions = [
        text_chunk("cmpl-a", 0, " upon", None),
        text_chunk("cmpl-a", 0, "", Some("stop")),
        text_chunk("cmpl-a", 1, " a", Some("length")),
        "data: [DONE]\n\n".to_string(),
    ]
    .concat();
    for (route, body, events, texts) in [
        (
            Route::ChatCompletions,
            json!({"model": "m", "messages": []}),
            chat,
            3,
        ),
        (
            Route::Completions,
            json!({"model": "m", "prompt": "x", "n": 2}),
            completions,
            2,
        ),
    ] {
        let mut m = migration(route, body);
        let passed = m.pass(Bytes::from(events.clone()));
        let mut counter = kvmesh_wire::usage::TokenCount::default();
        counter.observe(events.as_bytes(), true);
        let mut counted = kvmesh_wire::usage::TokenCount::default();
        counted.observe_counted(events.as_bytes(), passed.text_events);
        assert_eq!(passed.text_events, texts, "{events}");
        assert_eq!(
            (counted.completion_tokens(), counted.prompt_tokens()),
            (counter.completion_tokens(), counter.prompt_tokens()),
            "{events}"
        );
    }
}

#[test]
fn each_choice_strips_its_own_echo_and_one_not_started_is_echoed_by_its_continuation() {
    let mut m = migration(
        Route::Completions,
        json!({"model": "m", "prompt": "Once", "echo": true, "n": 2, "max_tokens": 3}),
    );
    // Choice 0 starts (the prompt with its first token); choice 1 has not when the engine dies.
    m.pass(Bytes::from(text_chunk("cmpl-a", 0, "Once upon", None)));
    let body: Value = serde_json::from_slice(&m.next_body().expect("migrates")).unwrap();
    assert_eq!(
        (&body["prompt"], &body["echo"], &body["max_tokens"]),
        (&json!("Once upon"), &json!(false), &json!(2)),
        "choice 0 has its echo: only its text goes on"
    );
    m.pass(Bytes::from(
        [
            text_chunk("cmpl-b", 0, " a", None),
            text_chunk("cmpl-b", 0, " time", Some("length")),
            "data: [DONE]\n\n".to_string(),
        ]
        .concat(),
    ));
    let body: Value = serde_json::from_slice(&m.next_choice_body().unwrap()).unwrap();
    assert_eq!(
        (&body["prompt"], &body["echo"], &body["max_tokens"]),
        (&json!("Once"), &json!(true), &json!(3)),
        "choice 1 never started: its continuation echoes for it"
    );
    let passed = m.pass(Bytes::from(
        [
            text_chunk("cmpl-c", 0, "Once there", None),
            text_chunk("cmpl-c", 0, " was", None),
        ]
        .concat(),
    ));
    assert_eq!(passed.text_events, 2);
    assert_eq!(
        m.choices[1].text, " there was",
        "the echo is no generated text"
    );
    let events = forwarded(&passed.forward);
    assert_eq!(events[0]["choices"][0]["index"], 1);
    assert_eq!(events[0]["choices"][0]["text"], "Once there");
}
