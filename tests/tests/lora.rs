//! LoRA adapters with a static config: two `kvmesh-engine-sim` engines, one serving the
//! adapter `sql-lora` (`--lora-modules`) and listing it under `adapters:` in the proxy's
//! config. Requests naming the adapter go only to that engine and are answered by the
//! adapter; base-model requests still use both; `GET /v1/models` lists the adapter with its
//! base model as `parent`; an unknown name is a 404. (The discovered case, adapters read from
//! the engine by the agent, is in `control_plane.rs`.)

use std::collections::BTreeMap;

use kvmesh_e2e::cluster::{MODEL, engine_urls, start_engines, start_proxy};
use kvmesh_e2e::{HttpClient, ScratchDir};
use serde_json::{Value, json};

fn completion(model: &str, prompt: &str) -> Value {
    json!({"model": model, "prompt": prompt, "max_tokens": 2})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_requests_go_only_to_the_backends_listing_the_adapter() -> anyhow::Result<()> {
    let scratch = ScratchDir::new("lora-static")?;
    let lora_sim = start_engines(
        &scratch,
        1,
        &["--no-delay", "--lora-modules", "sql-lora=/adapters/sql"],
    )?;
    let base_sim = start_engines(&scratch, 1, &["--no-delay"])?;
    let (lora, base) = (&engine_urls(&lora_sim)[0], &engine_urls(&base_sim)[0]);
    let config = format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         models:\n  - name: {MODEL}\n    policy: round_robin\n    backends:\n\
         \x20     - url: {lora}\n        adapters: [sql-lora]\n\
         \x20     - url: {base}\n"
    );
    let proxy = start_proxy(&scratch, &config)?;
    let client = HttpClient::default();
    let url = format!("{}/v1/completions", proxy.url("main"));

    let models = client
        .get(&format!("{}/v1/models", proxy.url("main")))
        .await?;
    let models: Value = serde_json::from_slice(&models.body)?;
    let ids: Vec<(&str, &str)> = models["data"]
        .as_array()
        .map(|all| {
            all.iter()
                .map(|m| {
                    (
                        m["id"].as_str().unwrap_or(""),
                        m["parent"].as_str().unwrap_or(""),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(ids, [(MODEL, ""), ("sql-lora", MODEL)], "{models}");

    let mut served: BTreeMap<(String, String), usize> = BTreeMap::new();
    for model in ["sql-lora", MODEL] {
        for i in 0..6 {
            let response = client
                .post_json(&url, &completion(model, &format!("question {i}")))
                .await?;
            assert_eq!(response.status, 200, "{model}");
            let body: Value = serde_json::from_slice(&response.body)?;
            assert_eq!(
                body["model"], model,
                "the engine answered as {}",
                body["model"]
            );
            let instance = response
                .header("x-kvmesh-instance")
                .unwrap_or("")
                .to_string();
            *served.entry((model.to_string(), instance)).or_default() += 1;
        }
    }
    let expected = BTreeMap::from([
        (("sql-lora".to_string(), lora.clone()), 6),
        ((MODEL.to_string(), lora.clone()), 3),
        ((MODEL.to_string(), base.clone()), 3),
    ]);
    assert_eq!(served, expected);

    let response = client
        .post_json(&url, &completion("chat-lora", "question"))
        .await?;
    assert_eq!(response.status, 404);
    let body: Value = serde_json::from_slice(&response.body)?;
    assert_eq!(body["error"]["code"], "model_not_found", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("sql-lora")),
        "the known names include the adapter: {body}"
    );
    Ok(())
}
