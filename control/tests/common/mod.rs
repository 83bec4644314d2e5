//! Helpers shared by the integration tests.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::time::Duration;

use kvmesh_control::{InstanceId, InstanceRecord, InstanceState, Namespace, Watch, WatchEvent};

/// A record of instance `id` of model `m`.
pub fn record(ns: &Namespace, model: &str, id: u64) -> InstanceRecord {
    let instance_id = InstanceId(id);
    InstanceRecord {
        instance_id,
        model: model.to_owned(),
        url: format!("http://127.0.0.1:{}", 8000 + id),
        protocol: "http1".into(),
        block_size: 16,
        total_blocks: 1024,
        dp_ranks: 1,
        labels: Default::default(),
        adapters: Vec::new(),
        event_subject: ns.event_subject(model),
        snapshot_subject: ns.snapshot_subject(instance_id),
        state: InstanceState::Ready,
    }
}

/// The next watch event within `secs` seconds.
pub async fn next_event(watch: &mut Watch, secs: u64) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(secs), watch.next())
        .await
        .expect("watch event in time")
        .expect("watch open")
}
