//! W3C Trace Context (<https://www.w3.org/TR/trace-context/>): the `traceparent` field read
//! from a client and written to an engine, and `tracestate` carried along.
//!
//! `traceparent` is `version-trace_id-parent_id-flags` in lowercase hex, 55 characters in
//! version `00`. A later version may append fields after a `-`; its first four fields are
//! read as version `00`'s. Version `ff`, all-zero ids, uppercase hex or any other deviation
//! make the field invalid, and an invalid field is ignored (the request starts a new trace).

use std::str::FromStr;

use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

/// `traceparent`.
pub const TRACEPARENT: &str = "traceparent";
/// `tracestate`.
pub const TRACESTATE: &str = "tracestate";

/// Length of a version-`00` `traceparent` value.
const LENGTH: usize = 55;

/// Whether `name` is `traceparent` or `tracestate` (ASCII case-insensitive), the fields the
/// proxy replaces on engine requests while it traces.
pub fn is_trace_field(name: &[u8]) -> bool {
    name.eq_ignore_ascii_case(TRACEPARENT.as_bytes())
        || name.eq_ignore_ascii_case(TRACESTATE.as_bytes())
}

/// The span context a `traceparent` value names (remote, with `tracestate` when that is
/// valid too); `None` when `traceparent` is invalid.
pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    let (trace_id, span_id, flags) = parse_fields(traceparent.trim().as_bytes())?;
    // An invalid tracestate is dropped on its own; the parent stays.
    let state = tracestate
        .map(str::trim)
        .filter(|state| printable_members(state))
        .and_then(|state| TraceState::from_str(state).ok())
        .unwrap_or_default();
    Some(SpanContext::new(trace_id, span_id, flags, true, state))
}

/// Whether every list member of a `tracestate` value is printable ASCII between optional
/// blanks, as W3C Trace Context writes keys and values. `TraceState::from_str` checks the keys
/// and that values hold no `,` or `=`, not their characters: a control character, a tab inside
/// a value or a non-ASCII one would be forwarded to engines, and a trailing one read back as
/// another state (found by fuzz/, target `traceparent`).
fn printable_members(state: &str) -> bool {
    state.split(',').all(|member| {
        member
            .trim_matches([' ', '\t'])
            .bytes()
            .all(|byte| (b' '..=b'~').contains(&byte))
    })
}

fn parse_fields(value: &[u8]) -> Option<(TraceId, SpanId, TraceFlags)> {
    if value.len() < LENGTH {
        return None;
    }
    let version = hex_u8(&value[0..2])?;
    match version {
        0xff => return None,
        0x00 if value.len() != LENGTH => return None,
        _ if value.len() > LENGTH && value[LENGTH] != b'-' => return None,
        _ => {}
    }
    if value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let mut trace_id = [0u8; 16];
    hex_into(&value[3..35], &mut trace_id)?;
    let mut span_id = [0u8; 8];
    hex_into(&value[36..52], &mut span_id)?;
    let flags = hex_u8(&value[53..55])?;
    let trace_id = TraceId::from_bytes(trace_id);
    let span_id = SpanId::from_bytes(span_id);
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    // Only the sampled flag is defined for what this reads.
    Some((
        trace_id,
        span_id,
        TraceFlags::new(flags) & TraceFlags::SAMPLED,
    ))
}

/// A lowercase hex digit's value.
fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

fn hex_u8(pair: &[u8]) -> Option<u8> {
    Some((hex_digit(pair[0])? << 4) | hex_digit(pair[1])?)
}

fn hex_into(digits: &[u8], out: &mut [u8]) -> Option<()> {
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = hex_u8(pair)?;
    }
    Some(())
}

/// A `traceparent` value (version `00`), formatted without allocating.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TraceParent([u8; LENGTH]);

impl TraceParent {
    /// The `traceparent` of `context`: its trace id, its span id as the parent and its
    /// sampled flag.
    pub fn of(context: &SpanContext) -> Self {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = [b'-'; LENGTH];
        let mut put = |at: usize, bytes: &[u8]| {
            for (i, byte) in bytes.iter().enumerate() {
                out[at + 2 * i] = HEX[usize::from(byte >> 4)];
                out[at + 2 * i + 1] = HEX[usize::from(byte & 0xf)];
            }
        };
        put(0, &[0]);
        put(3, &context.trace_id().to_bytes());
        put(36, &context.span_id().to_bytes());
        put(53, &[(context.trace_flags() & TraceFlags::SAMPLED).to_u8()]);
        Self(out)
    }

    /// The value's bytes (ASCII).
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The value.
    pub fn as_str(&self) -> &str {
        // Only ASCII hex digits and dashes are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl std::fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn reads_the_spec_example() {
        let context = parse(VALID, Some("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7")).unwrap();
        assert_eq!(
            context.trace_id(),
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
        );
        assert_eq!(
            context.span_id(),
            SpanId::from_hex("00f067aa0ba902b7").unwrap()
        );
        assert!(context.is_sampled());
        assert!(context.is_remote());
        assert_eq!(context.trace_state().get("congo"), Some("t61rcWkgMzE"));
        assert_eq!(context.trace_state().get("rojo"), Some("00f067aa0ba902b7"));
        let unsampled = parse(&VALID.replace("-01", "-00"), None).unwrap();
        assert!(!unsampled.is_sampled());
        assert_eq!(unsampled.trace_state().header(), "");
        // Surrounding whitespace is the field's optional whitespace.
        assert!(parse(&format!(" {VALID}\t"), None).is_some());
    }

    #[test]
    fn rejects_what_the_spec_calls_invalid() {
        let zero_trace = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";
        let zero_span = "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01";
        let cases = [
            "",
            "00",
            zero_trace,
            zero_span,
            &VALID.to_uppercase(),
            &VALID.replacen("00-", "ff-", 1),
            &VALID.replacen('-', "_", 1),
            &format!("{VALID}-extra"),
            &VALID[..54],
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
        ];
        for case in cases {
            assert!(parse(case, None).is_none(), "{case:?}");
        }
    }

    #[test]
    fn a_later_version_is_read_by_its_first_fields() {
        let future = VALID.replacen("00-", "01-", 1);
        assert!(parse(&future, None).is_some());
        assert!(parse(&format!("{future}-what-comes-next"), None).is_some());
        assert!(parse(&format!("{future}what"), None).is_none());
    }

    #[test]
    fn only_the_sampled_flag_is_kept() {
        let context = parse(&VALID.replace("-01", "-03"), None).unwrap();
        assert_eq!(context.trace_flags(), TraceFlags::SAMPLED);
        let context = parse(&VALID.replace("-01", "-02"), None).unwrap();
        assert_eq!(context.trace_flags(), TraceFlags::default());
    }

    #[test]
    fn an_invalid_tracestate_is_dropped_alone() {
        let context = parse(VALID, Some("no spaces allowed=1")).unwrap();
        assert_eq!(context.trace_state().header(), "");
    }

    #[test]
    fn a_tracestate_holds_printable_ascii_only() {
        // Found by fuzz/ (target `traceparent`): a value ending in a control character was
        // kept, and the state written from it read back as another one.
        let found = "a962o=E577b34da6a3ce929d0e0e4718-00f0679a0baa02b7-01\n,,,";
        for bad in [found, "k=v\u{e9}", "k=a\tb", "k=a\u{1}b,l=w", "k=v\u{7f}"] {
            let context = parse(VALID, Some(bad)).unwrap();
            assert_eq!(context.trace_state().header(), "", "{bad:?}");
        }
        // Blanks around list members are the list's optional whitespace.
        let context = parse(VALID, Some("k=v w\t , \tl=x,,")).unwrap();
        assert_eq!(context.trace_state().header(), "k=v w,l=x");
        let again = parse(VALID, Some(&context.trace_state().header())).unwrap();
        assert_eq!(again.trace_state(), context.trace_state());
    }

    #[test]
    fn formats_what_it_parses() {
        let context = parse(VALID, None).unwrap();
        assert_eq!(TraceParent::of(&context).as_str(), VALID);
        let unsampled = SpanContext::new(
            TraceId::from_bytes([0xab; 16]),
            SpanId::from_bytes([1, 2, 3, 4, 5, 6, 7, 8]),
            TraceFlags::new(0x02),
            false,
            TraceState::default(),
        );
        let value = TraceParent::of(&unsampled);
        assert_eq!(
            value.as_str(),
            "00-abababababababababababababababab-0102030405060708-00"
        );
        assert_eq!(value.as_bytes().len(), 55);
        assert_eq!(
            parse(value.as_str(), None).unwrap().span_id(),
            unsampled.span_id()
        );
    }

    #[test]
    fn names_the_trace_fields() {
        assert!(is_trace_field(b"traceparent"));
        assert!(is_trace_field(b"TraceState"));
        assert!(!is_trace_field(b"x-request-id"));
    }
}
