//! Request ids: propagated from the client's `x-request-id` or generated.
//!
//! A generated id is a per-process random prefix plus a counter, formatted on
//! the stack: unique across restarts with high probability, and no syscall or
//! random draw per request.

use std::sync::atomic::{AtomicU64, Ordering};

use http::HeaderValue;

/// Longest client-supplied id that is propagated as-is.
const MAX_CLIENT_ID_LEN: usize = 128;

/// Generates request ids.
#[derive(Debug)]
pub(crate) struct RequestIds {
    prefix: u32,
    counter: AtomicU64,
}

impl RequestIds {
    /// A generator with a random prefix.
    pub(crate) fn new() -> Self {
        Self {
            prefix: rand::random(),
            counter: AtomicU64::new(0),
        }
    }

    /// The client's id when it is usable, otherwise a new one.
    pub(crate) fn resolve(&self, client: Option<&HeaderValue>) -> HeaderValue {
        match client {
            Some(id) if is_acceptable(id) => id.clone(),
            _ => self.generate(),
        }
    }

    /// A new id: `<8 hex prefix>-<16 hex counter>`.
    pub(crate) fn generate(&self) -> HeaderValue {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let mut buf = [0u8; 25];
        write_hex(&mut buf[..8], u64::from(self.prefix));
        buf[8] = b'-';
        write_hex(&mut buf[9..], n);
        HeaderValue::from_bytes(&buf).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
    }
}

/// 1 to 128 visible ASCII characters.
fn is_acceptable(id: &HeaderValue) -> bool {
    let bytes = id.as_bytes();
    !bytes.is_empty() && bytes.len() <= MAX_CLIENT_ID_LEN && bytes.iter().all(u8::is_ascii_graphic)
}

/// Writes `value`'s low `out.len() * 4` bits as lowercase hex.
fn write_hex(out: &mut [u8], mut value: u64) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for slot in out.iter_mut().rev() {
        *slot = DIGITS[(value & 0xf) as usize];
        value >>= 4;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_unique_and_well_formed() {
        let ids = RequestIds::new();
        let a = ids.generate();
        let b = ids.generate();
        assert_ne!(a, b);
        let text = a.to_str().unwrap();
        assert_eq!(text.len(), 25);
        assert_eq!(&text[8..9], "-");
        assert!(text.ends_with("0000000000000000"));
        assert!(b.to_str().unwrap().ends_with("0000000000000001"));
        assert!(text.bytes().all(|c| c == b'-' || c.is_ascii_hexdigit()));
    }

    #[test]
    fn client_ids_are_propagated_when_sane() {
        let ids = RequestIds::new();
        let client = HeaderValue::from_static("req-abc-123");
        assert_eq!(ids.resolve(Some(&client)), client);
        let spaced = HeaderValue::from_static("has space");
        assert_ne!(ids.resolve(Some(&spaced)), spaced);
        let empty = HeaderValue::from_static("");
        assert_ne!(ids.resolve(Some(&empty)), empty);
        let long = HeaderValue::from_str(&"x".repeat(129)).unwrap();
        assert_ne!(ids.resolve(Some(&long)), long);
        assert_eq!(ids.resolve(None).len(), 25);
    }

    #[test]
    fn hex_is_fixed_width() {
        let mut buf = [0u8; 4];
        write_hex(&mut buf, 0xab);
        assert_eq!(&buf, b"00ab");
    }
}
