//! The server under test: its base URL, resolved once.

use std::net::SocketAddr;

use http::uri::{Authority, InvalidUri, InvalidUriParts, PathAndQuery, Scheme};
use http::{HeaderValue, Uri};

/// Failure to understand or resolve the target URL.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// The URL does not parse.
    #[error("invalid URL {url:?}: {source}")]
    Invalid {
        /// The URL as given.
        url: String,
        /// Why it does not parse.
        source: InvalidUri,
    },
    /// Only plain `http://` is supported (h2c for HTTP/2).
    #[error("unsupported URL {0:?}: only http:// is supported")]
    Scheme(String),
    /// The URL names no host.
    #[error("URL {0:?} names no host")]
    NoHost(String),
    /// The host name does not resolve.
    #[error("cannot resolve {authority}: {source}")]
    Resolve {
        /// `host:port` that was looked up.
        authority: String,
        /// The resolver's error.
        source: std::io::Error,
    },
    /// The host name resolved to no address.
    #[error("{0} resolves to no address")]
    NoAddress(String),
    /// An endpoint path that does not make a valid URI with this base.
    #[error("invalid request path {path:?}: {source}")]
    Path {
        /// The path that was built.
        path: String,
        /// Why it is invalid.
        source: InvalidUri,
    },
    /// An absolute URI could not be assembled.
    #[error("cannot build a request URI: {0}")]
    Parts(#[from] InvalidUriParts),
}

/// A resolved OpenAI-compatible base URL.
#[derive(Debug, Clone)]
pub struct Target {
    /// The socket address connections go to.
    pub addr: SocketAddr,
    /// `host[:port]` as written in the URL (the Host header / `:authority`).
    pub authority: Authority,
    /// The path before `/v1/...`, without a trailing slash (usually empty).
    pub base_path: String,
}

impl Target {
    /// Parses `url` (e.g. `http://127.0.0.1:8080`, optionally ending in `/v1`) and resolves it.
    pub async fn resolve(url: &str) -> Result<Self, TargetError> {
        let uri: Uri = url.parse().map_err(|source| TargetError::Invalid {
            url: url.to_owned(),
            source,
        })?;
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(TargetError::Scheme(url.to_owned()));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| TargetError::NoHost(url.to_owned()))?;
        let lookup = format!(
            "{}:{}",
            authority.host(),
            authority.port_u16().unwrap_or(80)
        );
        let addr = tokio::net::lookup_host(&lookup)
            .await
            .map_err(|source| TargetError::Resolve {
                authority: lookup.clone(),
                source,
            })?
            .next()
            .ok_or_else(|| TargetError::NoAddress(lookup.clone()))?;
        let path = uri.path().trim_end_matches('/');
        let base_path = path.strip_suffix("/v1").unwrap_or(path).to_owned();
        Ok(Self {
            addr,
            authority,
            base_path,
        })
    }

    /// The URI of an endpoint such as `/v1/completions`: origin-form for HTTP/1.1, absolute
    /// (with scheme and authority) for HTTP/2.
    pub fn endpoint_uri(&self, endpoint_path: &str, http2: bool) -> Result<Uri, TargetError> {
        let path = format!("{}{endpoint_path}", self.base_path);
        let path_and_query =
            PathAndQuery::try_from(path.as_str()).map_err(|source| TargetError::Path {
                path: path.clone(),
                source,
            })?;
        let mut parts = http::uri::Parts::default();
        if http2 {
            parts.scheme = Some(Scheme::HTTP);
            parts.authority = Some(self.authority.clone());
        }
        parts.path_and_query = Some(path_and_query);
        Ok(Uri::from_parts(parts)?)
    }

    /// The Host header value for HTTP/1.1 requests.
    pub fn host_header(&self) -> HeaderValue {
        HeaderValue::from_str(self.authority.as_str())
            .unwrap_or_else(|_| HeaderValue::from_static("localhost"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn parses_a_base_url() {
        let t = Target::resolve("http://127.0.0.1:8080")
            .await
            .expect("valid");
        assert_eq!(t.addr, "127.0.0.1:8080".parse().expect("addr"));
        assert_eq!(t.base_path, "");
        let uri = t.endpoint_uri("/v1/chat/completions", false).expect("uri");
        assert_eq!(uri.to_string(), "/v1/chat/completions");
        let uri = t.endpoint_uri("/v1/completions", true).expect("uri");
        assert_eq!(uri.to_string(), "http://127.0.0.1:8080/v1/completions");
        assert_eq!(t.host_header(), "127.0.0.1:8080");
    }

    #[tokio::test]
    async fn keeps_a_path_prefix_and_drops_a_trailing_v1() {
        let t = Target::resolve("http://127.0.0.1:9/llm/v1/")
            .await
            .expect("valid");
        assert_eq!(t.base_path, "/llm");
        let uri = t.endpoint_uri("/v1/completions", false).expect("uri");
        assert_eq!(uri.to_string(), "/llm/v1/completions");
    }

    #[tokio::test]
    async fn rejects_https_and_garbage() {
        assert!(matches!(
            Target::resolve("https://127.0.0.1:8443").await,
            Err(TargetError::Scheme(_))
        ));
        assert!(matches!(
            Target::resolve("http://[::1").await,
            Err(TargetError::Invalid { .. })
        ));
    }
}
