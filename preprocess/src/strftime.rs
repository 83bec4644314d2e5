//! `strftime_now(format)`: the current UTC time formatted with C `strftime` directives.
//!
//! Hugging Face exposes `datetime.now().strftime(format)` to chat templates (Llama 3.x prints
//! today's date with it). kvmesh formats UTC, which is what an engine in a container with no
//! time zone configured prints too.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// The template function: formats the current UTC time.
pub(crate) fn strftime_now(format: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    format_utc(secs, format)
}

/// A broken-down UTC time.
struct Civil {
    year: i64,
    month: u32,
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday.
    weekday: u32,
    /// 1-based day of the year.
    yday: u32,
}

/// Converts seconds since the Unix epoch to a UTC civil time (proleptic Gregorian calendar).
fn civil(secs: i64) -> Civil {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400) as u32;
    // Days-to-civil after Howard Hinnant's algorithm.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUMULATIVE: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUMULATIVE[month as usize - 1] + day + u32::from(leap && month > 2);
    Civil {
        year,
        month,
        day,
        hour: rem / 3600,
        minute: rem / 60 % 60,
        second: rem % 60,
        // 1970-01-01 was a Thursday (3 when Monday is 0).
        weekday: (days + 3).rem_euclid(7) as u32,
        yday,
    }
}

/// Formats `secs` (Unix time, UTC) with `strftime` directives; the `-` flag drops zero padding
/// (`%-d`). Unknown directives are copied through unchanged, as glibc does.
pub(crate) fn format_utc(secs: i64, format: &str) -> String {
    let t = civil(secs);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.next_if_eq(&'-').is_some();
        let Some(directive) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let num = |out: &mut String, value: u32, width: usize| {
            if no_pad {
                let _ = write!(out, "{value}");
            } else {
                let _ = write!(out, "{value:0width$}");
            }
        };
        let hour12 = if t.hour.is_multiple_of(12) {
            12
        } else {
            t.hour % 12
        };
        match directive {
            'Y' => {
                let _ = write!(out, "{}", t.year);
            }
            'y' => num(&mut out, t.year.rem_euclid(100) as u32, 2),
            'm' => num(&mut out, t.month, 2),
            'd' => num(&mut out, t.day, 2),
            'e' => {
                let _ = write!(out, "{:2}", t.day);
            }
            'H' => num(&mut out, t.hour, 2),
            'I' => num(&mut out, hour12, 2),
            'M' => num(&mut out, t.minute, 2),
            'S' => num(&mut out, t.second, 2),
            'j' => num(&mut out, t.yday, 3),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'A' => out.push_str(WEEKDAYS[t.weekday as usize]),
            'a' => out.push_str(&WEEKDAYS[t.weekday as usize][..3]),
            'B' => out.push_str(MONTHS[t.month as usize - 1]),
            'b' | 'h' => out.push_str(&MONTHS[t.month as usize - 1][..3]),
            'u' => num(&mut out, t.weekday + 1, 1),
            'w' => num(&mut out, (t.weekday + 1) % 7, 1),
            'F' => {
                let _ = write!(out, "{}-{:02}-{:02}", t.year, t.month, t.day);
            }
            'T' => {
                let _ = write!(out, "{:02}:{:02}:{:02}", t.hour, t.minute, t.second);
            }
            'Z' => out.push_str("UTC"),
            'z' => out.push_str("+0000"),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // 2024-07-26 09:05:03 UTC, a Friday, day 208 of a leap year.
    const T: i64 = 1_721_984_703;

    #[test]
    fn llama_date_format() {
        assert_eq!(format_utc(T, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(format_utc(0, "%d %b %Y"), "01 Jan 1970");
    }

    #[test]
    fn all_directives() {
        assert_eq!(
            format_utc(
                T,
                "%Y-%m-%d %H:%M:%S %y %j %a %A %b %B %I %p %u %w %F %T %Z %z %%"
            ),
            "2024-07-26 09:05:03 24 208 Fri Friday Jul July 09 AM 5 5 2024-07-26 09:05:03 UTC +0000 %"
        );
        assert_eq!(format_utc(T, "%-d/%-m %-H:%e|"), "26/7 9:26|");
    }

    #[test]
    fn unknown_directives_pass_through() {
        assert_eq!(format_utc(T, "%Q %-Q 100%"), "%Q %-Q 100%");
    }

    #[test]
    fn leap_day_and_year_end() {
        // 2024-02-29 12:00:00 UTC (Thursday) and 2023-12-31 23:59:59 UTC (Sunday).
        assert_eq!(format_utc(1_709_208_000, "%F %a %j"), "2024-02-29 Thu 060");
        assert_eq!(
            format_utc(1_704_067_199, "%F %T %A %j"),
            "2023-12-31 23:59:59 Sunday 365"
        );
    }

    #[test]
    fn now_is_formatted() {
        let year: i64 = strftime_now("%Y").parse().unwrap();
        assert!(year >= 2024);
    }
}
