//! What every lane shares: the connector, the fixed request headers and the timeout.

use std::time::Duration;

use http::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use http::{HeaderMap, HeaderValue, Method, Request};
use http_body_util::Full;

use crate::connection::{Connector, RequestBody};
use crate::workload::WorkItem;

/// Shared, read-only client settings.
#[derive(Debug)]
pub struct Client {
    /// Opens connections.
    pub connector: Connector,
    /// Per-request timeout, from sending to the end of the response.
    pub timeout: Duration,
    headers: HeaderMap,
}

impl Client {
    /// A client with the given connector; `host` is the HTTP/1.1 Host header (unused on
    /// HTTP/2, where the URI carries the authority) and `authorization` an optional header.
    pub fn new(
        connector: Connector,
        timeout: Duration,
        host: HeaderValue,
        authorization: Option<HeaderValue>,
    ) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if !connector.is_http2() {
            headers.insert(HOST, host);
        }
        if let Some(value) = authorization {
            headers.insert(AUTHORIZATION, value);
        }
        Self {
            connector,
            timeout,
            headers,
        }
    }

    /// The HTTP request for `item` (cheap: the body and header values are shared buffers).
    pub fn request(&self, item: &WorkItem) -> Request<RequestBody> {
        let mut request = Request::new(Full::new(item.body.clone()));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = item.uri.clone();
        *request.headers_mut() = self.headers.clone();
        request
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn item() -> WorkItem {
        WorkItem {
            uri: "/v1/completions".parse().expect("uri"),
            body: Bytes::from_static(b"{}"),
            stream: false,
        }
    }

    #[test]
    fn http1_requests_carry_host_and_auth() {
        let client = Client::new(
            Connector::new("127.0.0.1:1".parse().expect("addr"), false),
            Duration::from_secs(1),
            HeaderValue::from_static("127.0.0.1:1"),
            Some(HeaderValue::from_static("Bearer k")),
        );
        let request = client.request(&item());
        assert_eq!(request.method(), Method::POST);
        assert_eq!(request.headers()[HOST], "127.0.0.1:1");
        assert_eq!(request.headers()[AUTHORIZATION], "Bearer k");
        assert_eq!(request.headers()[CONTENT_TYPE], "application/json");
    }

    #[test]
    fn http2_requests_leave_the_host_to_the_uri() {
        let client = Client::new(
            Connector::new("127.0.0.1:1".parse().expect("addr"), true),
            Duration::from_secs(1),
            HeaderValue::from_static("127.0.0.1:1"),
            None,
        );
        let request = client.request(&item());
        assert!(!request.headers().contains_key(HOST));
        assert!(!request.headers().contains_key(AUTHORIZATION));
    }
}
