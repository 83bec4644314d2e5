//! `GET /openapi.json` and `GET /docs` on the data listeners.
//!
//! The OpenAPI 3.1 description of the data API is a committed asset
//! (`openapi.json` beside this file), compiled into the binary and served as
//! static bytes: no per-request serialisation, no allocation. `/docs` is a
//! self-contained HTML page (`docs.html`, no external assets) that fetches
//! `openapi.json` and renders it. Unit tests keep the document in step with the
//! route table and the errors the proxy generates; the end-to-end suite
//! (`tests/python/test_openapi.py`) validates real responses against it.

use bytes::Bytes;
use http::HeaderValue;

/// The OpenAPI document.
const SPEC: &[u8] = include_bytes!("openapi.json");

/// The page that renders it.
const DOCS_PAGE: &[u8] = include_bytes!("docs.html");

/// `text/html; charset=utf-8`.
pub(crate) const HTML: HeaderValue = HeaderValue::from_static("text/html; charset=utf-8");

/// The body of `GET /openapi.json`.
pub(crate) fn spec() -> Bytes {
    Bytes::from_static(SPEC)
}

/// The body of `GET /docs`.
pub(crate) fn docs_page() -> Bytes {
    Bytes::from_static(DOCS_PAGE)
}

#[cfg(test)]
mod tests;
