//! Response heads written for HTTP/1.1 clients: the engine's status and end-to-end fields
//! plus the proxy's own, serialised straight into the output buffer.

use http::{HeaderValue, StatusCode, Version};
use kvmesh_h1::digits::push_decimal;
use kvmesh_h1::fields::is_end_to_end;
use kvmesh_h1::head::Known;
use pingora_http::ResponseHeader;

use crate::engines::upstream_session::UpstreamSession;
use crate::frontend::respond::error_headers;
use crate::openai::api_error::ApiError;
use crate::openai::headers::{
    ClientFraming, ProxyHeaders, X_KVMESH_INSTANCE, X_KVMESH_ROUTE, X_REQUEST_ID,
    downstream_response,
};

/// Appends `name: value\r\n`.
fn field(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.extend_from_slice(name);
    out.extend_from_slice(b": ");
    out.extend_from_slice(value);
    out.extend_from_slice(b"\r\n");
}

/// Appends the status line.
fn status_line(out: &mut Vec<u8>, status: u16) {
    let reason = StatusCode::from_u16(status)
        .ok()
        .and_then(|status| status.canonical_reason())
        .unwrap_or("");
    out.extend_from_slice(b"HTTP/1.1 ");
    push_decimal(out, usize::from(status));
    out.push(b' ');
    out.extend_from_slice(reason.as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// Ends a head, with `connection: close` when the connection closes after the response.
fn end_head(out: &mut Vec<u8>, close: bool) {
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends the proxy's fields and the end of the head.
fn finish(out: &mut Vec<u8>, ours: ProxyHeaders<'_>, close: bool) {
    field(
        out,
        X_KVMESH_INSTANCE.as_str().as_bytes(),
        ours.instance.as_bytes(),
    );
    field(
        out,
        X_REQUEST_ID.as_str().as_bytes(),
        ours.request_id.as_bytes(),
    );
    if let Some(route) = ours.route {
        field(out, X_KVMESH_ROUTE.as_str().as_bytes(), route.as_bytes());
    }
    end_head(out, close);
}

/// Appends the head relaying `upstream`'s response to an HTTP/1.1 client (`close`: the
/// connection closes after it) and returns how its body is framed; `None` when the engine's
/// head cannot be relayed.
pub(crate) fn write_relayed_head(
    out: &mut Vec<u8>,
    upstream: &UpstreamSession,
    ours: ProxyHeaders<'_>,
    close: bool,
) -> Option<ClientFraming> {
    let (head, length_framed) = match upstream {
        UpstreamSession::H1(exchange) => (exchange.head()?, exchange.length_framed()),
        UpstreamSession::Pingora(_) => {
            let header = upstream.response_header()?;
            let (response, framing) =
                downstream_response(&header, ours, Version::HTTP_11, false).ok()?;
            write_pingora_head(out, &response, close);
            return Some(framing);
        }
    };
    status_line(out, head.status);
    let connection = head.fields.get(Known::Connection);
    for (name, value) in head.fields.iter() {
        let ours = name.eq_ignore_ascii_case(X_REQUEST_ID.as_str().as_bytes())
            || name.eq_ignore_ascii_case(X_KVMESH_ROUTE.as_str().as_bytes())
            || name.eq_ignore_ascii_case(X_KVMESH_INSTANCE.as_str().as_bytes());
        if ours || !is_end_to_end(name, connection) {
            continue;
        }
        // The engine's length holds only for a body it framed by length (a chunked one
        // may carry a stale Content-Length beside its Transfer-Encoding).
        if !length_framed && name.eq_ignore_ascii_case(b"content-length") {
            continue;
        }
        field(out, name, value);
    }
    let framing = if length_framed {
        ClientFraming::Length
    } else {
        out.extend_from_slice(b"transfer-encoding: chunked\r\n");
        ClientFraming::Open
    };
    finish(out, ours, close);
    Some(framing)
}

/// Appends a pingora response head (already holding the proxy's fields).
fn write_pingora_head(out: &mut Vec<u8>, response: &ResponseHeader, close: bool) {
    status_line(out, response.status.as_u16());
    for (name, value) in &response.headers {
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    end_head(out, close);
}

/// Appends a whole OpenAI-shaped error response.
pub(crate) fn write_error(
    out: &mut Vec<u8>,
    error: &ApiError,
    request_id: &HeaderValue,
    close: bool,
) {
    let body = error.body();
    status_line(out, error.status());
    field(out, b"content-type", b"application/json");
    out.extend_from_slice(b"content-length: ");
    push_decimal(out, body.len());
    out.extend_from_slice(b"\r\n");
    for (name, value) in error_headers(error, request_id) {
        field(out, name.as_str().as_bytes(), value.as_bytes());
    }
    end_head(out, close);
    out.extend_from_slice(&body);
}
