//! Policy at the edge: API keys and their limits, limits on what clients send, request ids,
//! retry budgets, TLS, the edge's metric families, and why the proxy cannot start.

pub(crate) mod auth;
pub(crate) mod edge_metrics;
pub(crate) mod error;
pub(crate) mod limits;
pub(crate) mod request_id;
pub(crate) mod retry;
pub(crate) mod tls;
