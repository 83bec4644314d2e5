//! Building blocks for a test cluster: engine-sim processes and a proxy in front.

use std::time::Duration;

use crate::{HttpClient, ScratchDir, Spawned};

/// Name of the model every test cluster serves.
pub const MODEL: &str = "sim-model";

/// The block size of the test clusters' engines unless a test names one: engine-sim's default
/// follows GPU vLLM (16); these tests were written against its earlier default, 64.
pub const SIM_BLOCK_SIZE: usize = 64;

/// Starts one `kvmesh-engine-sim` process with `engines` engines on free ports.
/// `extra` adds flags (e.g. `--no-delay`); without `--block-size` among them the engines run
/// [`SIM_BLOCK_SIZE`].
pub fn start_engines(
    scratch: &ScratchDir,
    engines: usize,
    extra: &[&str],
) -> anyhow::Result<Spawned> {
    let mut args: Vec<String> = [
        "--engines",
        &engines.to_string(),
        "--port",
        "0",
        "--model",
        MODEL,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if !extra.contains(&"--block-size") {
        args.extend(["--block-size".to_string(), SIM_BLOCK_SIZE.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    Spawned::start("kvmesh-engine-sim", &args, scratch.path())
}

/// Base URLs (`http://ip:port`) of every engine a sim process announced.
pub fn engine_urls(sim: &Spawned) -> Vec<String> {
    sim.listeners()
        .iter()
        .filter(|(name, _)| name.starts_with("engine-"))
        .map(|(_, a)| format!("http://{a}"))
        .collect()
}

/// A proxy config serving [`MODEL`] over `backends`, with `extra` YAML appended.
pub fn proxy_config(backends: &[String], extra: &str) -> String {
    let mut yaml = String::from(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
         models:\n  - name: sim-model\n    policy: round_robin\n    backends:\n",
    );
    for url in backends {
        yaml.push_str(&format!("      - url: {url}\n"));
    }
    yaml.push_str(extra);
    yaml
}

/// Starts `kvmesh-proxy` with `config` (YAML text).
pub fn start_proxy(scratch: &ScratchDir, config: &str) -> anyhow::Result<Spawned> {
    let path = scratch.write("proxy.yaml", config)?;
    Spawned::start(
        "kvmesh-proxy",
        &["--config".to_string(), path.display().to_string()],
        scratch.path(),
    )
}

/// [`start_proxy`] with `RUST_LOG` at `rust_log` (its log: [`Spawned::log_path`]).
pub fn start_proxy_logging(
    scratch: &ScratchDir,
    config: &str,
    rust_log: &str,
) -> anyhow::Result<Spawned> {
    let path = scratch.write("proxy.yaml", config)?;
    Spawned::start_logging(
        "kvmesh-proxy",
        &["--config".to_string(), path.display().to_string()],
        scratch.path(),
        rust_log,
    )
}

/// Polls `url` until it answers `status`, up to `timeout` (for state the
/// server exposes as a readiness endpoint, such as the admin `/health`).
pub async fn await_status(
    client: &HttpClient,
    url: &str,
    status: u16,
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Ok(resp) = client.get(url).await
            && resp.status == status
        {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!("{url} did not answer {status} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A chat request body for [`MODEL`].
pub fn chat_body(content: &str, max_tokens: u32, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
}
