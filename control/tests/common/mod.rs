//! Helpers shared by the integration tests.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

use std::time::Duration;

use kvmesh_control::{Watch, WatchEvent};

pub use kvmesh_control::testing::instance_record as record;

/// The next watch event within `secs` seconds.
pub async fn next_event(watch: &mut Watch, secs: u64) -> WatchEvent {
    tokio::time::timeout(Duration::from_secs(secs), watch.next())
        .await
        .expect("watch event in time")
        .expect("watch open")
}
