//! The members of an etcd cluster a client may talk to, and which one it uses now: calls
//! go to the current endpoint; one that fails to answer (connection refused or reset, no
//! answer in time) hands the role to the next, so a client given every member of a
//! cluster keeps working while one of them is down.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::ControlError;

/// The endpoints of one etcd cluster, in the order given.
#[derive(Debug)]
pub(super) struct Endpoints {
    bases: Vec<String>,
    current: AtomicUsize,
}

impl Endpoints {
    /// Parses `list`: endpoints (`http://host:port`, the scheme may be left out) separated
    /// by commas.
    pub(super) fn parse(list: &str) -> Result<Self, ControlError> {
        let bases = list
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(base_url)
            .collect::<Result<Vec<_>, _>>()?;
        if bases.is_empty() {
            return Err(ControlError::InvalidName(format!(
                "etcd URL {list:?}: no endpoint"
            )));
        }
        Ok(Self {
            bases,
            current: AtomicUsize::new(0),
        })
    }

    /// How many endpoints there are.
    pub(super) fn len(&self) -> usize {
        self.bases.len()
    }

    /// The endpoint in use: its position (for [`Endpoints::failed`]) and base URL.
    pub(super) fn current(&self) -> (usize, &str) {
        let index = self.current.load(Ordering::Relaxed) % self.bases.len();
        (index, &self.bases[index])
    }

    /// The endpoint at `index` did not answer: the next one takes over, unless another
    /// call already moved on.
    pub(super) fn failed(&self, index: usize) {
        let next = (index + 1) % self.bases.len();
        let _ = self
            .current
            .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// `url` as a base URL without a trailing slash, `http://` added when it has no scheme.
fn base_url(url: &str) -> Result<String, ControlError> {
    let base = if url.contains("://") {
        url.trim_end_matches('/').to_owned()
    } else {
        format!("http://{}", url.trim_end_matches('/'))
    };
    if !base.starts_with("http://") {
        return Err(ControlError::InvalidName(format!(
            "etcd URL {url:?}: only http:// is supported"
        )));
    }
    base.parse::<http::Uri>()
        .map_err(|e| ControlError::InvalidName(format!("etcd URL {url:?}: {e}")))?;
    Ok(base)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_parses_and_failures_rotate() {
        let endpoints = Endpoints::parse("127.0.0.1:2379, http://10.0.0.2:2379/ ,").unwrap();
        assert_eq!(endpoints.len(), 2);
        assert_eq!(endpoints.current(), (0, "http://127.0.0.1:2379"));
        endpoints.failed(0);
        assert_eq!(endpoints.current(), (1, "http://10.0.0.2:2379"));
        // A late report about the endpoint already left behind changes nothing.
        endpoints.failed(0);
        assert_eq!(endpoints.current().0, 1);
        endpoints.failed(1);
        assert_eq!(endpoints.current().0, 0);
    }

    #[test]
    fn bad_lists_are_refused() {
        assert!(Endpoints::parse("").is_err());
        assert!(Endpoints::parse(" , ").is_err());
        assert!(Endpoints::parse("https://127.0.0.1:2379").is_err());
        assert!(Endpoints::parse("127.0.0.1:2379,http://[bad").is_err());
    }
}
