//! The proxy binary picks its runtime by the CPUs it may use: one thread on one CPU.

use kvmesh_e2e::cluster::{chat_body, engine_urls, proxy_config, start_engines};
use kvmesh_e2e::{HttpClient, ScratchDir, Spawned};

/// The `flavor` the proxy logged at start.
fn logged_flavor(proxy: &Spawned) -> String {
    let log = std::fs::read_to_string(proxy.log_path()).unwrap();
    let line = log
        .lines()
        .find(|line| line.contains("runtime started"))
        .unwrap_or_else(|| panic!("no runtime line in:\n{log}"));
    let flavor = line.split("flavor=").nth(1).unwrap_or_default();
    flavor
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_cpu_the_proxy_serves_from_one_thread() {
    let scratch = ScratchDir::new("runtime").unwrap();
    let sim = start_engines(&scratch, 2, &["--no-delay"]).unwrap();
    let config = scratch
        .write("proxy.yaml", &proxy_config(&engine_urls(&sim), ""))
        .unwrap();
    let args = ["--config".to_string(), config.display().to_string()];
    let pinned = Spawned::start_on_one_cpu("kvmesh-proxy", &args, scratch.path()).unwrap();
    assert_eq!(logged_flavor(&pinned), "\"current_thread\"");
    let client = HttpClient::http1();
    let url = format!("{}/v1/chat/completions", pinned.url("main"));
    for stream in [false, true] {
        let reply = client
            .post_json(&url, &chat_body("one thread", 4, stream))
            .await
            .unwrap();
        assert_eq!(reply.status, 200, "{:?}", reply.body);
    }

    let cpus = std::thread::available_parallelism().map_or(1, usize::from);
    let free = Spawned::start("kvmesh-proxy", &args, scratch.path()).unwrap();
    let expected = if cpus == 1 {
        "current_thread"
    } else {
        "multi_thread"
    };
    assert_eq!(logged_flavor(&free), format!("\"{expected}\""));
}
