//! Disaggregated serving as vLLM's NixlConnector speaks it (`--role`).
//!
//! - **Prefill leg**: a request with `kv_transfer_params.do_remote_decode: true` runs its
//!   prefill (the client asks for one token) and its blocks stay allocated after it ends, held
//!   for a decode engine to read; the answer's `kv_transfer_params` names them
//!   (`remote_block_ids`, `remote_engine_id`, `remote_host`, `remote_port`, ...) as vLLM's
//!   does ([`params`]). Blocks nobody reads are freed after `hold_timeout`.
//! - **Decode leg**: a request carrying those parameters (`do_remote_prefill: true`) first
//!   pulls the named blocks from the named engine (the NIXL read, simulated by
//!   `POST /sim/kv_transfer/read` on the prefill engine, which frees them), over the decode
//!   engine's inbound link ([`link`]: the model's bytes per block, a bandwidth shared fairly
//!   by concurrent transfers); the pulled blocks then count as computed, so the request
//!   prefills only the rest. A read that fails (the prefill engine gone, the blocks expired)
//!   falls back to a local prefill, as vLLM's `kv_load_failure_policy: recompute` does.
//! - While KV flows in, the engine's iterations run `interference` slower: an unpaced burst
//!   of transfers hurts the streams already decoding there, as on real GPUs.
//!
//! SGLang's protocol (`--disaggregation-mode prefill|decode`) moves the same KV over the same
//! link, but both legs come at once and meet in a bootstrap room of the prefill engine
//! ([`bootstrap`], [`rooms`]).

pub(crate) mod bootstrap;
pub(crate) mod link;
pub(crate) mod params;
pub(crate) mod pull;
pub(crate) mod rooms;
