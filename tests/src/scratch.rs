//! Per-test scratch directories for config files and logs.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A fresh directory under the system temp dir, removed on drop.
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// Creates a new, empty, uniquely named directory.
    pub fn new(label: &str) -> anyhow::Result<Self> {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("kvmesh-e2e-{}-{label}-{n}", std::process::id()));
        if path.exists() {
            std::fs::remove_dir_all(&path)?;
        }
        std::fs::create_dir_all(&path)?;
        Ok(Self { path })
    }

    /// The directory's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `contents` to `name` inside the directory and returns its path.
    pub fn write(&self, name: &str, contents: &str) -> anyhow::Result<PathBuf> {
        let file = self.path.join(name);
        std::fs::write(&file, contents)?;
        Ok(file)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::env::var_os("KVMESH_TEST_KEEP").is_none() {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}
