//! Backend base URLs: `http://host:port`, or `https://host:port` for TLS to the engine.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

/// A validated backend base URL of the form `http://host:port` or `https://host:port`.
///
/// The host is an IPv4 address, a bracketed IPv6 address or a DNS name; the port
/// is required. A trailing `/` is accepted and dropped; any other path, a query,
/// user info or a scheme other than `http` and `https` is rejected.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BackendUrl {
    text: String,
    host: String,
    port: u16,
    tls: bool,
}

/// Why a backend URL was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid URL {url:?}: {reason}")]
pub struct BackendUrlError {
    /// The rejected text.
    pub url: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl BackendUrl {
    /// Parses `http://host:port` or `https://host:port` (optionally with a trailing `/`).
    pub fn parse(text: &str) -> Result<Self, BackendUrlError> {
        let fail = |reason| BackendUrlError {
            url: text.to_string(),
            reason,
        };
        let (rest, tls) = if let Some(rest) = text.strip_prefix("http://") {
            (rest, false)
        } else if let Some(rest) = text.strip_prefix("https://") {
            (rest, true)
        } else {
            return Err(fail("expected http://host:port or https://host:port"));
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.is_empty() {
            return Err(fail("missing host and port"));
        }
        if authority.contains(['/', '?', '#']) {
            return Err(fail("a backend URL has no path, query or fragment"));
        }
        if authority.contains('@') {
            return Err(fail("user info is not allowed"));
        }
        let (host, port) = if let Some(bracketed) = authority.strip_prefix('[') {
            let (inner, after) = bracketed
                .split_once(']')
                .ok_or_else(|| fail("unterminated IPv6 address"))?;
            if inner.parse::<std::net::Ipv6Addr>().is_err() {
                return Err(fail("invalid IPv6 address"));
            }
            let port = after
                .strip_prefix(':')
                .ok_or_else(|| fail("missing port"))?;
            (format!("[{inner}]"), port)
        } else {
            let (host, port) = authority
                .rsplit_once(':')
                .ok_or_else(|| fail("missing port"))?;
            if host.is_empty() {
                return Err(fail("missing host"));
            }
            if !host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-' || b == b'_')
            {
                return Err(fail("invalid host"));
            }
            (host.to_string(), port)
        };
        if port.is_empty() {
            return Err(fail("missing port"));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| fail("port must be a number from 1 to 65535"))?;
        if port == 0 {
            return Err(fail("port must be a number from 1 to 65535"));
        }
        let scheme = if tls { "https" } else { "http" };
        Ok(Self {
            text: format!("{scheme}://{host}:{port}"),
            host,
            port,
            tls,
        })
    }

    /// The URL as `http://host:port` or `https://host:port` (no trailing slash).
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The host: an IP address (IPv6 in brackets) or a DNS name.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// The port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `host:port`, as sent in the `Host` header.
    pub fn authority(&self) -> &str {
        let scheme = if self.tls { "https://" } else { "http://" };
        &self.text[scheme.len()..]
    }

    /// Whether the engine is reached over TLS (`https://`).
    pub fn is_tls(&self) -> bool {
        self.tls
    }
}

impl fmt::Display for BackendUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for BackendUrl {
    type Err = BackendUrlError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::parse(text)
    }
}

impl<'de> Deserialize<'de> for BackendUrl {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(BackendUrlVisitor)
    }
}

struct BackendUrlVisitor;

impl Visitor<'_> for BackendUrlVisitor {
    type Value = BackendUrl;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a URL of the form http://host:port or https://host:port")
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<BackendUrl, E> {
        BackendUrl::parse(value).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_host_port_forms() {
        let url = BackendUrl::parse("http://127.0.0.1:8001").unwrap();
        assert_eq!(url.as_str(), "http://127.0.0.1:8001");
        assert_eq!(url.host(), "127.0.0.1");
        assert_eq!(url.port(), 8001);
        assert_eq!(url.authority(), "127.0.0.1:8001");

        let url = BackendUrl::parse("http://engine-0.svc:80/").unwrap();
        assert_eq!(url.as_str(), "http://engine-0.svc:80");
        assert_eq!(url.host(), "engine-0.svc");

        let url = BackendUrl::parse("http://[::1]:9000").unwrap();
        assert_eq!(url.host(), "[::1]");
        assert_eq!(url.authority(), "[::1]:9000");
        assert!(!url.is_tls());

        let url = BackendUrl::parse("https://engine-0.svc:8443/").unwrap();
        assert_eq!(url.as_str(), "https://engine-0.svc:8443");
        assert_eq!(url.authority(), "engine-0.svc:8443");
        assert_eq!(url.host(), "engine-0.svc");
        assert!(url.is_tls());
    }

    #[test]
    fn rejects_everything_else() {
        for (text, reason) in [
            ("x", "expected http://host:port"),
            ("127.0.0.1:8001", "expected http://host:port"),
            (
                "ftp://a:1",
                "expected http://host:port or https://host:port",
            ),
            ("https://a", "missing port"),
            ("http://", "missing host and port"),
            ("http://host", "missing port"),
            ("http://host:", "missing port"),
            ("http://:80", "missing host"),
            ("http://host:0", "port must be"),
            ("http://host:70000", "port must be"),
            ("http://host:80/v1", "no path"),
            ("http://host:80?a=b", "no path"),
            ("http://u@host:80", "user info"),
            ("http://ho st:80", "invalid host"),
            ("http://[::1:80", "unterminated"),
            ("http://[zz]:80", "invalid IPv6"),
            ("http://[::1]", "missing port"),
        ] {
            let err = BackendUrl::parse(text).unwrap_err();
            assert!(
                err.reason.contains(reason),
                "{text}: got {:?}, want {reason:?}",
                err.reason
            );
            assert!(err.to_string().contains(&format!("{text:?}")));
        }
    }
}
