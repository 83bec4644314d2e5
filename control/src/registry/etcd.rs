//! [`Registry`] on etcd v3 through its JSON gRPC gateway (`/v3/kv/*`, `/v3/lease/*`,
//! streaming `/v3/watch`; keys and values base64, 64-bit integers as strings), over hyper.
//! Tested against etcd 3.4.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use serde_json::{Value, json};

use super::etcd_endpoints::Endpoints;
use super::watch::{RawChange, RawStream, WatchSource, list_records, spawn_watch};
use super::{LeaseId, Listing, Registry, Watch};
use crate::error::ControlError;
use crate::instance::InstanceRecord;

const BACKEND: &str = "etcd";
/// Deadline of every unary call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// gRPC status code NOT_FOUND (a missing lease).
const NOT_FOUND: i64 = 5;

fn transport(e: impl std::fmt::Display) -> ControlError {
    ControlError::Transport {
        backend: BACKEND,
        message: e.to_string(),
    }
}

/// The first key after every key that starts with `prefix` (etcd's `range_end`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xFF {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte was 0xFF: "\0" means "to the end of the keyspace".
    vec![0]
}

/// Parses a gateway integer (a JSON string or number; absent = 0).
fn int(v: &Value) -> i64 {
    match v {
        Value::String(s) => s.parse().unwrap_or(0),
        Value::Number(n) => n.as_i64().unwrap_or(0),
        _ => 0,
    }
}

fn decode_b64(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::String(s) => B64.decode(s).ok(),
        // proto3 JSON leaves empty bytes out.
        Value::Null => Some(Vec::new()),
        _ => None,
    }
}

/// An etcd key-value as the gateway sends it.
#[derive(Deserialize)]
struct Kv {
    key: String,
    #[serde(default)]
    value: String,
}

impl Kv {
    fn decode(&self) -> Option<(String, Bytes)> {
        let key = B64.decode(&self.key).ok()?;
        let key = String::from_utf8(key).ok()?;
        let value = B64.decode(&self.value).ok()?;
        Some((key, Bytes::from(value)))
    }
}

/// The etcd client shared by the registry and its watches.
#[derive(Clone, Debug)]
struct EtcdClient {
    endpoints: Arc<Endpoints>,
    http: Client<HttpConnector, Full<Bytes>>,
}

impl EtcdClient {
    /// Sends `body` to `path` and waits for the response head: on the current endpoint,
    /// then on each next one while they fail to answer.
    async fn send(
        &self,
        path: &str,
        body: &Value,
        what: &'static str,
    ) -> Result<http::Response<Incoming>, ControlError> {
        let body = Bytes::from(body.to_string());
        let mut last = None;
        for _ in 0..self.endpoints.len() {
            let (index, base) = self.endpoints.current();
            let request = http::Request::post(format!("{base}{path}"))
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))
                .map_err(|e| ControlError::InvalidName(format!("etcd URL {base:?}: {e}")))?;
            let error = match tokio::time::timeout(CALL_TIMEOUT, self.http.request(request)).await {
                Ok(Ok(response)) => return Ok(response),
                Ok(Err(e)) => transport(format!("{base}: {e}")),
                Err(_) => ControlError::Timeout(what),
            };
            self.endpoints.failed(index);
            last = Some(error);
        }
        Err(last.unwrap_or(ControlError::Timeout(what)))
    }

    /// POSTs `body` to `path` and returns the JSON answer; gateway errors become
    /// [`ControlError::Server`] (or [`ControlError::LeaseNotFound`] for `lease`).
    async fn call(
        &self,
        path: &str,
        body: Value,
        lease: Option<i64>,
    ) -> Result<Value, ControlError> {
        let response = self.send(path, &body, "etcd call").await?;
        let status = response.status();
        let bytes = tokio::time::timeout(CALL_TIMEOUT, response.into_body().collect())
            .await
            .map_err(|_| ControlError::Timeout("etcd call"))?
            .map_err(transport)?
            .to_bytes();
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| ControlError::Server {
            backend: BACKEND,
            message: format!("{status}: {e}"),
        })?;
        if let Some(error) = value.get("error") {
            if let Some(id) = lease
                && int(&value["code"]) == NOT_FOUND
            {
                return Err(ControlError::LeaseNotFound(id));
            }
            return Err(ControlError::Server {
                backend: BACKEND,
                message: error.as_str().unwrap_or("unknown error").to_owned(),
            });
        }
        if !status.is_success() {
            return Err(ControlError::Server {
                backend: BACKEND,
                message: status.to_string(),
            });
        }
        Ok(value)
    }
}

/// The etcd-backed [`Registry`].
#[derive(Clone, Debug)]
pub struct EtcdRegistry {
    client: EtcdClient,
}

impl EtcdRegistry {
    /// A client of the etcd cluster at `urls`: one endpoint (`http://host:port`; the scheme
    /// may be left out) or several separated by commas, the members of one cluster. Calls
    /// go to one endpoint at a time and move to the next when it does not answer. No
    /// connection is made until the first call.
    pub fn new(urls: &str) -> Result<Self, ControlError> {
        let endpoints = Arc::new(Endpoints::parse(urls)?);
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        connector.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self {
            client: EtcdClient { endpoints, http },
        })
    }
}

#[async_trait]
impl Registry for EtcdRegistry {
    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId, ControlError> {
        let ttl = ttl.as_secs().max(1);
        let v = self
            .client
            .call("/v3/lease/grant", json!({"TTL": ttl}), None)
            .await?;
        match int(&v["ID"]) {
            0 => Err(ControlError::Server {
                backend: BACKEND,
                message: "lease grant returned no id".into(),
            }),
            id => Ok(LeaseId(id)),
        }
    }

    async fn keep_alive(&self, lease: LeaseId) -> Result<Duration, ControlError> {
        let body = json!({"ID": lease.0.to_string()});
        let v = self
            .client
            .call("/v3/lease/keepalive", body, Some(lease.0))
            .await?;
        match int(&v["result"]["TTL"]) {
            ttl if ttl > 0 => Ok(Duration::from_secs(ttl.unsigned_abs())),
            _ => Err(ControlError::LeaseNotFound(lease.0)),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> Result<(), ControlError> {
        let body = json!({"ID": lease.0.to_string()});
        self.client
            .call("/v3/lease/revoke", body, Some(lease.0))
            .await
            .map(drop)
    }

    async fn put(
        &self,
        key: &str,
        record: &InstanceRecord,
        lease: Option<LeaseId>,
    ) -> Result<(), ControlError> {
        let mut body = json!({"key": B64.encode(key), "value": B64.encode(record.to_json())});
        if let Some(lease) = lease {
            body["lease"] = lease.0.to_string().into();
        }
        self.client
            .call("/v3/kv/put", body, lease.map(|l| l.0))
            .await
            .map(drop)
    }

    async fn delete(&self, key: &str) -> Result<(), ControlError> {
        let body = json!({"key": B64.encode(key)});
        self.client
            .call("/v3/kv/deleterange", body, None)
            .await
            .map(drop)
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
        let body = json!({
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix.as_bytes())),
        });
        let v = self.client.call("/v3/kv/range", body, None).await?;
        let revision = int(&v["header"]["revision"]);
        let kvs: Vec<Kv> = match v.get("kvs") {
            Some(kvs) => serde_json::from_value(kvs.clone())?,
            None => Vec::new(),
        };
        let mut out: Vec<(String, Bytes)> = kvs.iter().filter_map(Kv::decode).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok((out, revision))
    }

    async fn watch_raw(
        &self,
        prefix: &str,
        revision: i64,
    ) -> Result<Box<dyn RawStream>, ControlError> {
        let body = json!({"create_request": {
            "key": B64.encode(prefix),
            "range_end": B64.encode(prefix_end(prefix.as_bytes())),
            "start_revision": revision.to_string(),
        }});
        let response = self.client.send("/v3/watch", &body, "etcd watch").await?;
        if !response.status().is_success() {
            return Err(ControlError::Server {
                backend: BACKEND,
                message: format!("watch: {}", response.status()),
            });
        }
        Ok(Box::new(EtcdWatchStream {
            body: response.into_body(),
            buf: BytesMut::new(),
        }))
    }
}

/// The gateway's watch response: one JSON object per line.
struct EtcdWatchStream {
    body: Incoming,
    buf: BytesMut,
}

impl EtcdWatchStream {
    /// Turns one response line into changes; `Err` when the watch was canceled.
    fn parse_line(line: &[u8]) -> Result<Vec<RawChange>, ControlError> {
        let v: Value = serde_json::from_slice(line)?;
        if let Some(error) = v.get("error") {
            return Err(ControlError::Server {
                backend: BACKEND,
                message: error.to_string(),
            });
        }
        let result = &v["result"];
        if result["canceled"].as_bool() == Some(true) {
            return Err(ControlError::Server {
                backend: BACKEND,
                message: format!(
                    "watch canceled (compact revision {})",
                    int(&result["compact_revision"])
                ),
            });
        }
        let mut changes = Vec::new();
        for event in result["events"].as_array().into_iter().flatten() {
            let kv = &event["kv"];
            let Some(key) = decode_b64(&kv["key"]).and_then(|k| String::from_utf8(k).ok()) else {
                continue;
            };
            if event["type"].as_str() == Some("DELETE") {
                changes.push(RawChange::Delete(key));
            } else if let Some(value) = decode_b64(&kv["value"]) {
                changes.push(RawChange::Put(key, Bytes::from(value)));
            }
        }
        Ok(changes)
    }
}

#[async_trait]
impl RawStream for EtcdWatchStream {
    async fn next(&mut self) -> Result<Option<Vec<RawChange>>, ControlError> {
        loop {
            if let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
                let line = self.buf.split_to(end + 1);
                let line = line.trim_ascii();
                if line.is_empty() {
                    continue;
                }
                let changes = Self::parse_line(line)?;
                if changes.is_empty() {
                    continue;
                }
                return Ok(Some(changes));
            }
            match self.body.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.buf.extend_from_slice(&data);
                    }
                }
                Some(Err(e)) => return Err(transport(e)),
                None => return Ok(None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ends_cover_the_prefix() {
        assert_eq!(prefix_end(b"/a/"), b"/a0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff\xff"), b"\0");
    }

    #[test]
    fn watch_lines_parse() {
        let put = br#"{"result":{"header":{"revision":"3"},"events":[{"kv":{"key":"L2EvYw==","create_revision":"3","mod_revision":"3","version":"1","value":"eQ=="}}]}}"#;
        let changes = EtcdWatchStream::parse_line(put).expect("put");
        assert!(matches!(&changes[..], [RawChange::Put(k, v)] if k == "/a/c" && &v[..] == b"y"));
        let del = br#"{"result":{"header":{"revision":"4"},"events":[{"type":"DELETE","kv":{"key":"L2EvYg==","mod_revision":"4"}}]}}"#;
        let changes = EtcdWatchStream::parse_line(del).expect("delete");
        assert!(matches!(&changes[..], [RawChange::Delete(k)] if k == "/a/b"));
        let created = br#"{"result":{"header":{"revision":"2"},"created":true}}"#;
        assert!(
            EtcdWatchStream::parse_line(created)
                .expect("created")
                .is_empty()
        );
        let canceled = br#"{"result":{"canceled":true,"compact_revision":"9"}}"#;
        assert!(EtcdWatchStream::parse_line(canceled).is_err());
    }

    #[test]
    fn urls_are_checked() {
        assert!(EtcdRegistry::new("http://127.0.0.1:2379").is_ok());
        assert!(EtcdRegistry::new("127.0.0.1:2379").is_ok());
        assert!(EtcdRegistry::new("https://127.0.0.1:2379").is_err());
    }
}
