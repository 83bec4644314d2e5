//! Building and running it all: bind, serve and drain; the admin listener; hot reload; the
//! control plane's intake; the benchmarks' entry points; the layering test.

pub(crate) mod admin_app;
pub mod bench_support;
pub(crate) mod control_plane;
pub(crate) mod heap;
mod layering;
pub(crate) mod reload;
pub(crate) mod server;
