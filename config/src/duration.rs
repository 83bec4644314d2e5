//! Human-readable durations in the config file: `250ms`, `5s`, `2m`, `1h`.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};

/// Why a duration string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// The text was empty.
    #[error("empty duration: expected a number followed by a unit, e.g. \"5s\"")]
    Empty,
    /// The text did not start with a decimal number.
    #[error(
        "invalid duration {0:?}: expected a whole number followed by a unit (ms, s, m, h), e.g. \"250ms\""
    )]
    MissingNumber(String),
    /// The number had no unit after it.
    #[error("invalid duration {0:?}: missing unit (ms, s, m, h), e.g. \"5s\"")]
    MissingUnit(String),
    /// The unit is not one of `ms`, `s`, `m`, `h`.
    #[error("invalid duration {0:?}: unknown unit {1:?} (expected ms, s, m or h)")]
    UnknownUnit(String, String),
    /// The value does not fit in a duration.
    #[error("invalid duration {0:?}: too large")]
    Overflow(String),
}

/// Parses `<whole number><unit>` where unit is `ms`, `s`, `m` or `h`
/// (surrounding whitespace is ignored, none is allowed inside).
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err(DurationError::Empty);
    }
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(digits_end);
    if number.is_empty() {
        return Err(DurationError::MissingNumber(text.to_string()));
    }
    if unit.is_empty() {
        return Err(DurationError::MissingUnit(text.to_string()));
    }
    let value: u64 = number
        .parse()
        .map_err(|_| DurationError::Overflow(text.to_string()))?;
    let millis_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        other => {
            return Err(DurationError::UnknownUnit(
                text.to_string(),
                other.to_string(),
            ));
        }
    };
    value
        .checked_mul(millis_per_unit)
        .map(Duration::from_millis)
        .ok_or_else(|| DurationError::Overflow(text.to_string()))
}

/// Formats a duration the way the config file writes it (`250ms`, `5s`, `2m`, `1h`).
pub fn format_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis == 0 || !millis.is_multiple_of(1_000) {
        format!("{millis}ms")
    } else if millis.is_multiple_of(3_600_000) {
        format!("{}h", millis / 3_600_000)
    } else if millis.is_multiple_of(60_000) {
        format!("{}m", millis / 60_000)
    } else {
        format!("{}s", millis / 1_000)
    }
}

/// `deserialize_with` helper for [`Duration`] fields written as duration strings.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Duration, D::Error> {
    deserializer.deserialize_str(DurationVisitor)
}

struct DurationVisitor;

impl Visitor<'_> for DurationVisitor {
    type Value = Duration;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration string such as \"250ms\", \"5s\" or \"2m\"")
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<Duration, E> {
        parse_duration(value).map_err(E::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(parse_duration(" 0s "), Ok(Duration::ZERO));
    }

    #[test]
    fn rejects_malformed_text() {
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert_eq!(parse_duration("   "), Err(DurationError::Empty));
        assert!(matches!(
            parse_duration("5"),
            Err(DurationError::MissingUnit(_))
        ));
        assert!(matches!(
            parse_duration("s"),
            Err(DurationError::MissingNumber(_))
        ));
        assert!(matches!(
            parse_duration("-5s"),
            Err(DurationError::MissingNumber(_))
        ));
        assert!(
            matches!(parse_duration("1.5s"), Err(DurationError::UnknownUnit(_, u)) if u == ".5s")
        );
        assert!(matches!(
            parse_duration("5 s"),
            Err(DurationError::UnknownUnit(_, _))
        ));
        assert!(matches!(parse_duration("5d"), Err(DurationError::UnknownUnit(_, u)) if u == "d"));
        assert!(matches!(
            parse_duration("99999999999999999999s"),
            Err(DurationError::Overflow(_))
        ));
        assert!(matches!(
            parse_duration("18446744073709551615h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn error_messages_quote_the_input() {
        let message = parse_duration("5x").unwrap_err().to_string();
        assert!(message.contains("\"5x\""), "{message}");
        assert!(message.contains("unknown unit"), "{message}");
    }

    #[test]
    fn formats_round_trip() {
        for text in ["250ms", "5s", "2m", "1h", "0ms", "1500ms", "90s"] {
            let parsed = parse_duration(text).unwrap();
            assert_eq!(format_duration(parsed), text);
        }
    }
}
