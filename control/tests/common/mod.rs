//! Helpers shared by the integration tests.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use kvmesh_control::{InstanceId, InstanceRecord, InstanceState, Namespace, Watch, WatchEvent};

/// A fresh directory under the system temp dir, removed with everything in it on drop.
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;

    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh directory under the system temp dir, removed on drop.
pub fn temp_dir(name: &str) -> TempDir {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let dir = std::env::temp_dir().join(format!(
        "kvmesh-control-{name}-{}-{nanos}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    TempDir(dir)
}

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
