//! Kinds of upstream failure, as counted in `kvmesh_upstream_errors_total`.

/// How an attempt to use an instance failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FailureKind {
    /// The TCP (or h2) connection could not be opened.
    Connect,
    /// No response headers within `first_byte_timeout`, or a body gap over `idle_timeout`.
    Timeout,
    /// The connection broke after it was opened.
    Reset,
    /// The engine answered 5xx.
    Status5xx,
    /// Discovery removed the instance mid-answer (its agent's lease ended after the drain
    /// period, or it died): not the engine's fault, never counted towards ejection.
    Left,
}

/// Number of [`FailureKind`]s.
pub(crate) const FAILURE_KINDS: usize = 5;

impl FailureKind {
    /// Every kind, in [`FailureKind::index`] order.
    pub(crate) const ALL: [FailureKind; FAILURE_KINDS] = [
        Self::Connect,
        Self::Timeout,
        Self::Reset,
        Self::Status5xx,
        Self::Left,
    ];

    /// Position in [`FailureKind::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Connect => "connect",
            Self::Timeout => "timeout",
            Self::Reset => "reset",
            Self::Status5xx => "status_5xx",
            Self::Left => "left",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_follow_all() {
        for (i, kind) in FailureKind::ALL.iter().enumerate() {
            assert_eq!(kind.index(), i);
        }
        assert_eq!(FailureKind::Status5xx.label(), "status_5xx");
    }
}
