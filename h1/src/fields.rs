//! What header fields mean between hops, on raw bytes: which fields describe one connection
//! rather than the message (RFC 9110 §7.6.1), the tokens of a `Connection` value, whether an
//! `Expect` value asks for `100 Continue` and whether a `Content-Type` is an event stream.
//! Names and values in any case.

/// Fields that describe one connection, not the message (RFC 9110 §7.6.1), plus `expect`,
/// which the proxy answers itself. `name` in any case.
fn is_hop_by_hop(name: &[u8]) -> bool {
    const HOP_BY_HOP: [&[u8]; 10] = [
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"expect",
    ];
    HOP_BY_HOP.iter().any(|hop| hop.eq_ignore_ascii_case(name))
}

/// Whether `name` is one of the comma-separated tokens of a `Connection` value.
#[inline]
pub fn listed_in_connection(connection: &[u8], name: &[u8]) -> bool {
    connection
        .split(|&byte| byte == b',')
        .any(|token| token.trim_ascii().eq_ignore_ascii_case(name))
}

/// Whether a field called `name`, in a head whose `Connection` value is `connection`, is
/// end-to-end (forwarded): neither hop-by-hop nor listed in `Connection`.
#[inline]
pub fn is_end_to_end(name: &[u8], connection: Option<&[u8]>) -> bool {
    !is_hop_by_hop(name) && !connection.is_some_and(|list| listed_in_connection(list, name))
}

/// Whether an `Expect` value asks for `100 Continue` before the body is sent.
#[inline]
pub fn is_100_continue(expect: &[u8]) -> bool {
    expect.eq_ignore_ascii_case(b"100-continue")
}

/// Whether a `Content-Type` value is `text/event-stream` (parameters allowed).
#[inline]
pub fn is_event_stream_type(content_type: &[u8]) -> bool {
    content_type
        .trim_ascii_start()
        .get(..17)
        .is_some_and(|essence| essence.eq_ignore_ascii_case(b"text/event-stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_event_streams() {
        assert!(is_event_stream_type(b"Text/Event-Stream; charset=utf-8"));
        assert!(is_event_stream_type(b" text/event-stream"));
        assert!(!is_event_stream_type(b"application/json"));
        assert!(!is_event_stream_type(b""));
    }

    #[test]
    fn connection_tokens_and_hop_by_hop_fields_are_not_end_to_end() {
        assert!(listed_in_connection(b"keep-alive, X-Private", b"x-private"));
        assert!(!listed_in_connection(b"keep-alive", b"close"));
        assert!(is_end_to_end(b"content-type", None));
        assert!(is_end_to_end(b"x-custom", Some(b"keep-alive")));
        for hop in [&b"Connection"[..], b"TE", b"transfer-encoding", b"expect"] {
            assert!(!is_end_to_end(hop, None), "{hop:?}");
        }
        assert!(!is_end_to_end(b"X-Private", Some(b"close, x-private")));
    }
}
