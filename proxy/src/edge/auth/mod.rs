//! API keys: `Authorization: Bearer <key>` checked against SHA-256 hashes from
//! the config, the models each key may use, and its limits (requests per
//! second, tokens per minute, requests in flight).
//!
//! Tokens: a request's prompt tokens are charged when it is admitted (its
//! token count when `policy: kv` tokenized it, else an estimate of one token
//! per 4 bytes of body) and its completion tokens as the response streams
//! through (one per SSE data event, corrected by the `usage` the engine
//! reports). The tokens bucket may go into debt down to minus one minute's
//! worth; a key is admitted again once it is back above zero.

mod bucket;
mod hash;
mod key;
mod meter;
mod table;

pub use hash::sha256_hex;
pub(crate) use key::{ApiKey, KeyPermit, KeyRejection, LIMITS, Limit};
pub(crate) use meter::CompletionMeter;
pub(crate) use table::{AuthFailure, Authenticator};

/// Bytes of request body counted as one prompt token when the prompt was not tokenized.
pub(crate) const BYTES_PER_ESTIMATED_TOKEN: u64 = 4;

/// The prompt tokens charged for a request: its token count when known, else
/// the estimate from its body size.
pub(crate) fn prompt_tokens(tokenized: Option<u64>, body_len: usize) -> u64 {
    tokenized.unwrap_or_else(|| (body_len as u64).div_ceil(BYTES_PER_ESTIMATED_TOKEN))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_tokens_prefer_the_count() {
        assert_eq!(prompt_tokens(Some(7), 1000), 7);
        assert_eq!(prompt_tokens(None, 1000), 250);
        assert_eq!(prompt_tokens(None, 1001), 251);
        assert_eq!(prompt_tokens(None, 0), 0);
    }
}
