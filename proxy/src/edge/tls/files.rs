//! Change detection for watched files: modification time and size, polled.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// What a file looked like when it was last read (`None`: it could not be read).
type Stamp = Option<(SystemTime, u64)>;

/// The stamps of a set of files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FileStamps {
    files: Vec<(PathBuf, Stamp)>,
}

impl FileStamps {
    /// The current stamps of `files`.
    pub(crate) fn of<'a>(files: impl IntoIterator<Item = &'a Path>) -> Self {
        Self {
            files: files
                .into_iter()
                .map(|file| (file.to_path_buf(), stamp(file)))
                .collect(),
        }
    }

    /// The same files' stamps now.
    pub(crate) fn now(&self) -> Self {
        Self::of(self.files.iter().map(|(file, _)| file.as_path()))
    }
}

fn stamp(file: &Path) -> Stamp {
    let metadata = std::fs::metadata(file).ok()?;
    Some((metadata.modified().ok()?, metadata.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rewrite_changes_the_stamp() {
        let dir = std::env::temp_dir().join(format!("kvmesh-stamps-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("a.pem");
        std::fs::write(&file, "one").unwrap();
        let first = FileStamps::of([file.as_path()]);
        assert_eq!(first.now(), first);
        std::fs::write(&file, "three").unwrap();
        assert_ne!(first.now(), first);
        std::fs::remove_file(&file).unwrap();
        let gone = first.now();
        assert_ne!(gone, first);
        assert_eq!(gone.now(), gone);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
