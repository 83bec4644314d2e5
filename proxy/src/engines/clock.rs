//! Monotonic milliseconds, small enough to keep in an atomic.

use std::sync::OnceLock;
use std::time::Instant;

static ORIGIN: OnceLock<Instant> = OnceLock::new();

/// Milliseconds since the first call in this process (monotonic).
pub(crate) fn now_millis() -> u64 {
    let origin = ORIGIN.get_or_init(Instant::now);
    u64::try_from(origin.elapsed().as_millis()).unwrap_or(u64::MAX)
}
