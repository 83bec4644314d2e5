//! The inference RPCs, as the request metrics count them (`route` label).

/// An inference RPC of `GRPCInferenceService`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rpc {
    /// `ModelInfer`: one request, one response.
    ModelInfer,
    /// `ModelStreamInfer`: requests multiplexed on a stream, each counted alone.
    ModelStreamInfer,
}

/// Number of [`Rpc`]s.
pub(crate) const RPC_COUNT: usize = 2;

impl Rpc {
    /// Every RPC, in [`Rpc::index`] order.
    pub(crate) const ALL: [Rpc; RPC_COUNT] = [Self::ModelInfer, Self::ModelStreamInfer];

    /// Position in [`Rpc::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// The metric label and the name in logs.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::ModelInfer => "model_infer",
            Self::ModelStreamInfer => "model_stream_infer",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_follow_all() {
        for (i, rpc) in Rpc::ALL.iter().enumerate() {
            assert_eq!(rpc.index(), i);
        }
        assert_ne!(Rpc::ModelInfer.label(), Rpc::ModelStreamInfer.label());
    }
}
