//! [`Registry`] on etcd v3 through `etcd-client` (gRPC): one or several members of a
//! cluster (calls move to the next member when one does not answer: [`Members`]), TLS with
//! a CA and client certificates, user / password auth ([`EtcdSettings`]).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, Identity, PutOptions, TlsOptions,
    WatchOptions,
};
use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;

use super::etcd_members::Members;
use super::watch::{RawChange, RawStream, WatchSource, list_records, spawn_watch};
use super::{LeaseId, Listing, Registry, Watch};
use crate::error::ControlError;
use crate::instance::InstanceRecord;
use crate::security::{EtcdAuth, TlsFiles, read_pem, read_secret};

const BACKEND: &str = "etcd";
/// Deadline of every unary call (and of connecting, authentication included).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// A call the member in use has not answered this long goes to the next member too: a
/// healthy member answers in milliseconds, one that hangs never.
const HEDGE_AFTER: Duration = Duration::from_secs(1);
/// Deadline of one TCP (and TLS) connection to a member.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// HTTP/2 PING interval on a member's connection (etcd answers pings more often than every
/// 5 s, its `--grpc-keepalive-min-time`, with GOAWAY), and how long an answer may take.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// A watch that has been quiet this long asks its member for its status, and gives the member
/// up when no answer comes within [`WATCH_PROBE_TIMEOUT`]: a member that hangs (a stopped
/// process, a partition) resets nothing, and a watch is one long stream that would wait on it
/// forever. Unary calls have [`CALL_TIMEOUT`].
const WATCH_PROBE_INTERVAL: Duration = Duration::from_secs(2);
const WATCH_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Maps a client error; `lease` names the lease a NOT_FOUND refers to.
fn etcd_error(error: etcd_client::Error, lease: Option<i64>) -> ControlError {
    match error {
        etcd_client::Error::GRpcStatus(status) => match (status.code(), lease) {
            (tonic::Code::NotFound, Some(id)) => ControlError::LeaseNotFound(id),
            (tonic::Code::Unauthenticated | tonic::Code::PermissionDenied, _) => {
                ControlError::Refused {
                    backend: BACKEND,
                    message: status.message().to_owned(),
                }
            }
            // A wrong user or password: "etcdserver: authentication failed, invalid user ID
            // or password".
            (tonic::Code::InvalidArgument, _) if status.message().contains("authentication") => {
                ControlError::Refused {
                    backend: BACKEND,
                    message: status.message().to_owned(),
                }
            }
            (tonic::Code::Unavailable, _) => ControlError::Transport {
                backend: BACKEND,
                message: status.message().to_owned(),
            },
            (code, _) => ControlError::Server {
                backend: BACKEND,
                message: format!("{code:?}: {}", status.message()),
            },
        },
        // The keep-alive stream's answer for a lease the server does not know.
        etcd_client::Error::LeaseKeepAliveError(message) => match lease {
            Some(id) => ControlError::LeaseNotFound(id),
            None => ControlError::Server {
                backend: BACKEND,
                message,
            },
        },
        other => ControlError::Transport {
            backend: BACKEND,
            message: other.to_string(),
        },
    }
}

/// Where an [`EtcdRegistry`] connects and how it proves itself.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct EtcdSettings {
    /// Client URLs of the cluster's members, comma-separated: `http://host:port` (the scheme
    /// may be left out), or `https://host:port` with [`EtcdSettings::tls`].
    pub endpoints: String,
    /// TLS towards `https://` members: the CA that signed them, a client certificate.
    pub tls: Option<TlsFiles>,
    /// User and password, when etcd's auth is enabled.
    pub auth: Option<EtcdAuth>,
}

impl EtcdSettings {
    /// Plaintext members, no credentials.
    pub fn new(endpoints: &str) -> Self {
        Self {
            endpoints: endpoints.to_owned(),
            tls: None,
            auth: None,
        }
    }

    /// The member URLs, each with its scheme, checked against the TLS settings.
    fn urls(&self) -> Result<Vec<String>, ControlError> {
        let tls = self.tls.is_some();
        let urls = self
            .endpoints
            .split(',')
            .map(str::trim)
            .filter(|url| !url.is_empty())
            .map(|url| {
                let full = match url.split_once("://") {
                    None => format!("{}://{url}", if tls { "https" } else { "http" }),
                    Some(("http", _)) if tls => {
                        return Err(ControlError::Config(format!(
                            "etcd endpoint {url:?}: TLS settings need https:// endpoints"
                        )));
                    }
                    Some(("https", _)) if !tls => {
                        return Err(ControlError::Config(format!(
                            "etcd endpoint {url:?}: https:// needs TLS settings (at least the CA file)"
                        )));
                    }
                    Some(("http" | "https", _)) => url.to_owned(),
                    Some((scheme, _)) => {
                        return Err(ControlError::Config(format!(
                            "etcd endpoint {url:?}: scheme {scheme:?} (use http:// or https://)"
                        )));
                    }
                };
                if full.contains('@') {
                    return Err(ControlError::Config(format!(
                        "etcd endpoint {url:?} carries credentials: name a password file in the auth settings"
                    )));
                }
                Ok(full)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if urls.is_empty() {
            return Err(ControlError::Config(format!(
                "etcd endpoints {:?}: none given",
                self.endpoints
            )));
        }
        Ok(urls)
    }

    /// The client options, with every file read now.
    fn options(&self) -> Result<ConnectOptions, ControlError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(CALL_TIMEOUT)
            .with_keep_alive(KEEP_ALIVE_INTERVAL, KEEP_ALIVE_TIMEOUT)
            .with_auto_token_refresh(true);
        if let Some(auth) = &self.auth {
            options = options.with_user(
                auth.user.clone(),
                read_secret(&auth.password_file, "etcd password")?,
            );
        }
        if let Some(tls) = &self.tls {
            let mut config = TlsOptions::new();
            if let Some(ca) = &tls.ca_file {
                config =
                    config.ca_certificate(Certificate::from_pem(read_pem(ca, "etcd CA file")?));
            }
            if let Some((cert, key)) = tls.client_identity()? {
                config = config.identity(Identity::from_pem(
                    read_pem(cert, "etcd client certificate")?,
                    read_pem(key, "etcd client key")?,
                ));
            }
            options = options.with_tls(config);
        }
        Ok(options)
    }
}

/// How one member's attempt at a call failed.
enum Failure {
    /// The member did not answer (transport error, timeout): another member may.
    Member(ControlError),
    /// The member answered with an error (a refusal, a lapsed lease): another would too.
    Answer(ControlError),
}

/// The etcd-backed [`Registry`]; clones share the members' clients.
#[derive(Clone, Debug)]
pub struct EtcdRegistry {
    members: Arc<Members>,
}

impl EtcdRegistry {
    /// A plaintext client of the members at `urls` ([`EtcdRegistry::with_settings`]).
    pub fn new(urls: &str) -> Result<Self, ControlError> {
        Self::with_settings(&EtcdSettings::new(urls))
    }

    /// A client as `settings` say. Calls go to one member and move to the next when it does
    /// not answer, so a client given every member keeps working while some are down. Files
    /// are read now; no connection is made until the first call (a proxy starts while etcd
    /// is down).
    pub fn with_settings(settings: &EtcdSettings) -> Result<Self, ControlError> {
        Ok(Self {
            members: Arc::new(Members::new(settings.urls()?, settings.options()?)),
        })
    }

    /// Runs `call` against the member in use, within [`CALL_TIMEOUT`]. When the member does
    /// not answer within [`HEDGE_AFTER`], the same call goes to the next member too (a
    /// member that hangs, stopped or partitioned, resets nothing and would hold the call
    /// for the whole timeout); the first answer wins and its member becomes the one in use.
    /// A member that fails (transport error or timeout) hands the role on at once.
    async fn call<T, F, Fut>(&self, what: &'static str, call: F) -> Result<T, ControlError>
    where
        F: Fn(Client) -> Fut,
        Fut: Future<Output = Result<T, ControlError>>,
    {
        let count = self.members.len();
        let (first, _) = self.members.current();
        let attempt = |offset: usize| {
            let index = (first + offset) % count;
            let url = self.members.url(index);
            let call = &call;
            async move {
                let answer = async {
                    let client = self
                        .members
                        .client(index)
                        .await
                        .map_err(|error| etcd_error(error, None))?;
                    call(client).await
                };
                let outcome = match tokio::time::timeout(CALL_TIMEOUT, answer).await {
                    Ok(Ok(answer)) => Ok(answer),
                    Ok(Err(ControlError::Transport { backend, message })) => {
                        Err(Failure::Member(ControlError::Transport {
                            backend,
                            message: format!("{url}: {message}"),
                        }))
                    }
                    Ok(Err(other)) => Err(Failure::Answer(other)),
                    Err(_) => Err(Failure::Member(ControlError::Timeout(what))),
                };
                (index, outcome)
            }
        };
        let mut attempts = FuturesUnordered::new();
        attempts.push(attempt(0));
        let mut launched = 1;
        loop {
            let hedge = async {
                if launched < count {
                    tokio::time::sleep(HEDGE_AFTER).await;
                } else {
                    std::future::pending::<()>().await;
                }
            };
            tokio::select! {
                Some((index, outcome)) = attempts.next() => match outcome {
                    Ok(answer) => {
                        self.members.answered(index);
                        return Ok(answer);
                    }
                    Err(Failure::Answer(error)) => return Err(error),
                    Err(Failure::Member(error)) => {
                        self.members.failed(index);
                        if launched < count {
                            attempts.push(attempt(launched));
                            launched += 1;
                        } else if attempts.is_empty() {
                            return Err(error);
                        }
                    }
                },
                () = hedge => {
                    attempts.push(attempt(launched));
                    launched += 1;
                }
            }
        }
    }
}

#[async_trait]
impl Registry for EtcdRegistry {
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, ControlError> {
        let ttl = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        self.call("etcd lease grant", |mut client| async move {
            let granted = client
                .lease_grant(ttl, None)
                .await
                .map_err(|error| etcd_error(error, None))?;
            Ok(LeaseId(granted.id()))
        })
        .await
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, ControlError> {
        self.call("etcd lease keep-alive", |mut client| async move {
            let error = |error| etcd_error(error, Some(lease.0));
            let (mut keeper, mut answers) =
                client.lease_keep_alive(lease.0).await.map_err(error)?;
            keeper.keep_alive().await.map_err(error)?;
            match answers.message().await.map_err(error)? {
                Some(answer) if answer.ttl() > 0 => {
                    Ok(Duration::from_secs(answer.ttl().unsigned_abs()))
                }
                _ => Err(ControlError::LeaseNotFound(lease.0)),
            }
        })
        .await
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), ControlError> {
        self.call("etcd lease revoke", |mut client| async move {
            client
                .lease_revoke(lease.0)
                .await
                .map(drop)
                .map_err(|error| etcd_error(error, Some(lease.0)))
        })
        .await
    }

    async fn put(
        &self,
        key: &str,
        record: &InstanceRecord,
        lease: Option<LeaseId>,
    ) -> Result<(), ControlError> {
        let value = record.to_json();
        self.call("etcd put", |mut client| {
            let value = value.clone();
            async move {
                let options = lease.map(|lease| PutOptions::new().with_lease(lease.0));
                client
                    .put(key, value, options)
                    .await
                    .map(drop)
                    .map_err(|error| etcd_error(error, lease.map(|lease| lease.0)))
            }
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<(), ControlError> {
        self.call("etcd delete", |mut client| async move {
            client
                .delete(key, None)
                .await
                .map(drop)
                .map_err(|error| etcd_error(error, None))
        })
        .await
    }

    async fn list(&self, prefix: &str) -> Result<Listing, ControlError> {
        list_records(self, prefix).await
    }

    fn watch(&self, prefix: &str) -> Watch {
        spawn_watch(self.clone(), prefix.to_owned())
    }
}

#[async_trait]
impl WatchSource for EtcdRegistry {
    async fn list_raw(&self, prefix: &str) -> Result<(Vec<(String, Bytes)>, i64), ControlError> {
        self.call("etcd range", |mut client| async move {
            let listing = client
                .get(prefix, Some(GetOptions::new().with_prefix()))
                .await
                .map_err(|error| etcd_error(error, None))?;
            let revision = listing.header().map_or(0, |header| header.revision());
            let mut out: Vec<(String, Bytes)> = listing
                .kvs()
                .iter()
                .filter_map(|kv| {
                    let key = kv.key_str().ok()?.to_owned();
                    Some((key, Bytes::copy_from_slice(kv.value())))
                })
                .collect();
            out.sort_by(|a, b| a.0.cmp(&b.0));
            Ok((out, revision))
        })
        .await
    }

    async fn watch_raw(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<Box<dyn RawStream>, ControlError> {
        self.call("etcd watch", |mut client| async move {
            // The member `call` runs this on.
            let (member, _) = self.members.current();
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(revision);
            let probe = client.clone();
            let stream = client
                .watch(prefix, Some(options))
                .await
                .map_err(|error| etcd_error(error, None))?;
            Ok(Box::new(EtcdWatchStream {
                stream,
                probe,
                members: Arc::clone(&self.members),
                member,
            }) as Box<dyn RawStream>)
        })
        .await
    }
}

/// An open etcd watch on member `member`, whose client `probe` checks the member still
/// answers while the watch is quiet.
struct EtcdWatchStream {
    stream: etcd_client::WatchStream,
    probe: Client,
    members: Arc<Members>,
    member: usize,
}

/// Returns once `client`'s member fails to answer a status request within
/// [`WATCH_PROBE_TIMEOUT`], asked every [`WATCH_PROBE_INTERVAL`].
async fn member_hangs(mut client: Client) {
    loop {
        tokio::time::sleep(WATCH_PROBE_INTERVAL).await;
        match tokio::time::timeout(WATCH_PROBE_TIMEOUT, client.status()).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => return,
        }
    }
}

/// The changes of one watch response; `Err` when the watch was canceled.
fn changes(response: &etcd_client::WatchResponse) -> Result<Vec<RawChange>, ControlError> {
    if response.canceled() {
        return Err(ControlError::Server {
            backend: BACKEND,
            message: format!(
                "watch canceled (compact revision {}): {}",
                response.compact_revision(),
                response.cancel_reason()
            ),
        });
    }
    Ok(response
        .events()
        .iter()
        .filter_map(|event| {
            let kv = event.kv()?;
            let key = kv.key_str().ok()?.to_owned();
            Some(match event.event_type() {
                EventType::Delete => RawChange::Delete(key),
                EventType::Put => RawChange::Put(key, Bytes::copy_from_slice(kv.value())),
            })
        })
        .collect())
}

#[async_trait]
impl RawStream for EtcdWatchStream {
    async fn next(&mut self) -> Result<Option<Vec<RawChange>>, ControlError> {
        loop {
            let message = tokio::select! {
                message = self.stream.message() => message.map_err(|error| etcd_error(error, None)),
                () = member_hangs(self.probe.clone()) => Err(ControlError::Timeout("etcd watch probe")),
            };
            // The watch broke, or its member stopped answering: it is opened again on the next
            // member, not on this one.
            let message = message.inspect_err(|_| self.members.failed(self.member));
            let Some(response) = message? else {
                return Ok(None);
            };
            let changes = changes(&response)?;
            if !changes.is_empty() {
                return Ok(Some(changes));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_against_the_tls_settings() {
        let urls = |endpoints: &str, tls: bool| {
            EtcdSettings {
                endpoints: endpoints.to_owned(),
                tls: tls.then(TlsFiles::default),
                auth: None,
            }
            .urls()
        };
        assert_eq!(
            urls("127.0.0.1:2379, http://b:2379", false).expect("plain"),
            ["http://127.0.0.1:2379", "http://b:2379"]
        );
        assert_eq!(urls("a:2379", true).expect("tls"), ["https://a:2379"]);
        assert!(urls("https://a:2379", false).is_err());
        assert!(urls("http://a:2379", true).is_err());
        assert!(urls("unix://a", false).is_err());
        assert!(urls("http://u:p@a:2379", false).is_err());
        assert!(urls(" , ", false).is_err());
    }
}
