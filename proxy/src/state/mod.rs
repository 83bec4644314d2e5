//! The per-config state every request reads, and the background tasks that walk it
//! (health checks, KV booking sweeps, tokenizer checks).

pub(crate) mod health_check;
pub(crate) mod kv_sweeper;
pub(crate) mod shared;
pub(crate) mod tokenizer_check;
