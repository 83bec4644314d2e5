//! The members of an etcd cluster a client may talk to, one `etcd-client` client each, and
//! which one is in use (the last to answer first). `etcd-client` balances one channel over every endpoint, but a member
//! that refuses connections fails the calls routed to it (etcdv3/etcd-client#39); here calls
//! go to the current member, and one that fails to answer (connection refused or reset, no
//! leader, no answer in time) hands the role to the next, so a client given every member of
//! a cluster keeps working while some of them are down.

use std::sync::atomic::{AtomicUsize, Ordering};

use etcd_client::{Client, ConnectOptions};
use tokio::sync::OnceCell;

/// One member: its URL and its client, made on first use (authenticating when auth is on).
struct Member {
    url: String,
    client: OnceCell<Client>,
}

/// The members of one cluster, in the order given.
pub(super) struct Members {
    members: Vec<Member>,
    current: AtomicUsize,
    options: ConnectOptions,
}

impl std::fmt::Debug for Members {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<&str> = self.members.iter().map(|m| m.url.as_str()).collect();
        f.debug_struct("Members")
            .field("urls", &urls)
            .finish_non_exhaustive()
    }
}

impl Members {
    /// The members at `urls` (at least one), each reached with `options`.
    pub(super) fn new(urls: Vec<String>, options: ConnectOptions) -> Self {
        Self {
            members: urls
                .into_iter()
                .map(|url| Member {
                    url,
                    client: OnceCell::new(),
                })
                .collect(),
            current: AtomicUsize::new(0),
            options,
        }
    }

    /// How many members there are.
    pub(super) fn len(&self) -> usize {
        self.members.len()
    }

    /// The member in use: its position (for [`Members::failed`]) and URL.
    pub(super) fn current(&self) -> (usize, &str) {
        let index = self.current.load(Ordering::Relaxed) % self.members.len();
        (index, &self.members[index].url)
    }

    /// The URL of the member at `index`.
    pub(super) fn url(&self, index: usize) -> &str {
        &self.members[index].url
    }

    /// The client of the member at `index`, connecting on first use.
    pub(super) async fn client(&self, index: usize) -> Result<Client, etcd_client::Error> {
        let member = &self.members[index];
        let client = member
            .client
            .get_or_try_init(|| Client::connect([member.url.as_str()], Some(self.options.clone())))
            .await?;
        Ok(client.clone())
    }

    /// The member at `index` answered a call first: it is the one in use.
    pub(super) fn answered(&self, index: usize) {
        self.current.store(index, Ordering::Relaxed);
    }

    /// The member at `index` did not answer: the next one takes over, unless another call
    /// already moved on.
    pub(super) fn failed(&self, index: usize) {
        let next = (index + 1) % self.members.len();
        let _ = self
            .current
            .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_rotate_once_per_member() {
        let members = Members::new(
            vec!["http://a:2379".to_owned(), "http://b:2379".to_owned()],
            ConnectOptions::new(),
        );
        assert_eq!(members.len(), 2);
        assert_eq!(members.current(), (0, "http://a:2379"));
        members.failed(0);
        assert_eq!(members.current(), (1, "http://b:2379"));
        // A late report about the member already left behind changes nothing.
        members.failed(0);
        assert_eq!(members.current().0, 1);
        members.failed(1);
        assert_eq!(members.current().0, 0);
        // A member that answered first (a hedged call) is the one in use.
        members.answered(1);
        assert_eq!(members.current(), (1, "http://b:2379"));
    }
}
