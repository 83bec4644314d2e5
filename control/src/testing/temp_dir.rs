//! Throwaway directories for tests, removed with everything in them when dropped.

use std::path::{Path, PathBuf};

/// A fresh directory under the system temp dir, removed with everything in it on drop.
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh directory `kvmesh-{name}-{pid}-{nanos}` under the system temp dir, removed on drop.
///
/// # Panics
///
/// When the directory cannot be created.
pub fn temp_dir(name: &str) -> TempDir {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let dir = std::env::temp_dir().join(format!("kvmesh-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    TempDir(dir)
}
