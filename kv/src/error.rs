//! Errors of the crate's constructors (event translation has its own, in `engine_blocks`;
//! applying events to the index never fails: see `ApplyOutcome`).

use thiserror::Error;

/// Invalid block-hashing parameters.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum HashError {
    /// A block size of zero tokens was requested.
    #[error("block size must be at least 1 token")]
    ZeroBlockSize,
}

/// Invalid approximate-mode settings.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ApproxConfigError {
    /// The TTL is zero, so every prediction would expire at once.
    #[error("approximate-mode TTL must be greater than zero")]
    ZeroTtl,
    /// The TTL is longer than [`crate::MAX_TTL`].
    #[error("approximate-mode TTL {0:?} is longer than one year")]
    TtlTooLong(std::time::Duration),
    /// The size bound is zero blocks.
    #[error("approximate-mode max_blocks must be at least 1")]
    ZeroMaxBlocks,
    /// The prune target ratio is not in (0, 1].
    #[error("approximate-mode prune target ratio must be in (0, 1], got {0}")]
    PruneRatio(f64),
}
