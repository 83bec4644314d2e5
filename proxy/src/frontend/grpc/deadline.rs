//! The `grpc-timeout` request header: the client's deadline.

use std::time::Duration;

use tokio::time::Instant;
use tonic::metadata::MetadataMap;

/// How much earlier than the client's deadline the proxy gives up. tonic's own timeout
/// (started a little before the handler) answers CANCELLED; ending first, the proxy answers
/// DEADLINE_EXCEEDED and records it as such. 10 ms lost that race about once in a few dozen
/// runs on a loaded 2-core machine (the handler starts late, or its timer wakes late).
const MARGIN: Duration = Duration::from_millis(50);

/// The deadline a request carries, counted from `now` (less [`MARGIN`]); `None` when it has
/// none (or an unreadable one, which gRPC says to ignore).
pub(crate) fn deadline(metadata: &MetadataMap, now: Instant) -> Option<Instant> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    now.checked_add(parse_timeout(value)?.saturating_sub(MARGIN))
}

/// `1`–`8` ASCII digits and a unit: `H`ours, `M`inutes, `S`econds, `m`illi-, `u`micro-
/// or `n`anoseconds.
fn parse_timeout(value: &str) -> Option<Duration> {
    let digits = value.len().checked_sub(1)?;
    if !(1..=8).contains(&digits) {
        return None;
    }
    let (number, unit) = value.split_at(digits);
    if !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = number.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(
            parse_timeout("99999999S"),
            Some(Duration::from_secs(99_999_999))
        );
        assert_eq!(parse_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse_timeout("0n"), Some(Duration::ZERO));
    }

    #[test]
    fn rejects_malformed_values() {
        for value in ["", "S", "100", "123456789S", "1x", "-1S", "1.5S", " 1S"] {
            assert_eq!(parse_timeout(value), None, "{value:?}");
        }
    }

    #[test]
    fn reads_the_header() {
        let now = Instant::now();
        let mut metadata = MetadataMap::new();
        assert_eq!(deadline(&metadata, now), None);
        metadata.insert("grpc-timeout", "1500m".parse().unwrap());
        assert_eq!(
            deadline(&metadata, now),
            Some(now + Duration::from_millis(1450))
        );
        metadata.insert("grpc-timeout", "1u".parse().unwrap());
        assert_eq!(deadline(&metadata, now), Some(now));
        metadata.insert("grpc-timeout", "soon".parse().unwrap());
        assert_eq!(deadline(&metadata, now), None);
    }
}
