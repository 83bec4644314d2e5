//! The `kvmesh-agent` binary built with the `cuda` feature, as the pod's inbound sidecar,
//! against real etcd and nats-server processes and an engine-sim engine.
//!
//! On a machine whose driver sees a GPU (or where `KVMESH_EXPECT_GPU` is set, which makes a
//! missing GPU a failure), the instance record carries each device's measured memory and
//! bandwidths and the pacer runs at the slowest measured host-to-device rate. Elsewhere the
//! agent logs why it measured nothing and registers as without the feature, at the default
//! rate.

#![cfg(feature = "cuda")]

mod support;

use std::collections::BTreeMap;

use kvmesh_control::{EtcdRegistry, Namespace, Registry};
use kvmesh_engine_sim::{KvEventEncoding, KvEventHash};
use support::*;

/// `--pace-rate-gbps`'s default, bytes per second.
const DEFAULT_RATE: f64 = 25e9;

async fn record_labels(servers: &Servers) -> BTreeMap<String, String> {
    let reg = EtcdRegistry::new(&servers.etcd.url()).expect("etcd client");
    let listing = reg
        .list(&Namespace::default().instances_prefix())
        .await
        .expect("list");
    assert_eq!(listing.records.len(), 1);
    listing.records[0].1.labels.clone()
}

fn gbps(labels: &BTreeMap<String, String>, key: &str) -> f64 {
    labels[key]
        .parse()
        .unwrap_or_else(|_| panic!("{key} is a number"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_and_the_pacer_carry_what_the_gpus_measured() {
    let expect_gpu =
        std::env::var_os("KVMESH_EXPECT_GPU").is_some() || kvmesh_agent::gpu::probe().is_ok();
    let servers = Servers::start("gpu").await;
    let engine = engine(KvEventEncoding::Positional, KvEventHash::Int).await;
    let events = format!("tcp://{}", engine.kv_events_addr().expect("events addr"));
    let agent = AgentProcess::start(
        &servers,
        &format!("http://{}", engine.local_addr()),
        &events,
        None,
        &[
            "--inbound-listen",
            "127.0.0.1:0",
            "--pace-max-inflight-bytes",
            "4294967296",
            "--labels",
            "zone=a",
        ],
    )
    .await;
    let labels = record_labels(&servers).await;
    let rate = agent
        .metric("kvmesh_agent_kv_transfer_rate_bytes_per_second ")
        .await;
    assert_eq!(labels["zone"], "a", "the given labels stay: {labels:?}");

    if !expect_gpu {
        assert!(
            labels.keys().all(|key| !key.starts_with("gpu.")),
            "{labels:?}"
        );
        assert_eq!(rate, DEFAULT_RATE);
        assert!(agent.logs().contains("no GPU measured"), "{}", agent.logs());
        return;
    }

    let devices: Vec<&str> = labels
        .keys()
        .filter_map(|key| key.strip_prefix("gpu.")?.strip_suffix(".name"))
        .collect();
    assert!(!devices.is_empty(), "no GPU labels: {labels:?}");
    let mut slowest_h2d = f64::INFINITY;
    for n in &devices {
        let key = |what: &str| format!("gpu.{n}.{what}");
        let total: u64 = labels[&key("total_bytes")].parse().expect("total bytes");
        let free: u64 = labels[&key("free_bytes")].parse().expect("free bytes");
        assert!(total >= 1 << 30 && free <= total, "device {n}: {labels:?}");
        let (h2d, d2h, d2d) = (
            gbps(&labels, &key("h2d_gbps")),
            gbps(&labels, &key("d2h_gbps")),
            gbps(&labels, &key("d2d_gbps")),
        );
        // PCIe 3 x16 moves about 12 GB/s; anything much slower is a measuring error, and
        // a copy inside the device's memory beats both copies over the bus.
        assert!(h2d > 1.0 && d2h > 1.0, "device {n}: {labels:?}");
        assert!(d2d > h2d && d2d > d2h, "device {n}: {labels:?}");
        slowest_h2d = slowest_h2d.min(h2d);
        eprintln!(
            "device {n}: {} total {total} free {free}, h2d {h2d} d2h {d2h} d2d {d2d} GB/s",
            labels[&key("name")]
        );
    }
    // The labels round to 0.1 GB/s; the pacer has the unrounded rate.
    assert!(
        (rate - slowest_h2d * 1e9).abs() <= 0.05e9 + 1.0,
        "paced at {rate} B/s, slowest measured h2d {slowest_h2d} GB/s"
    );
    assert!(agent.logs().contains("GPU measured"), "{}", agent.logs());
}
