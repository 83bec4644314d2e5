//! `kvmesh-test-certs DIR`: writes a throw-away test PKI (see
//! `kvmesh_e2e::certs`) into DIR: ca.pem, server.pem, server.key, client.pem,
//! client.key, other-ca.pem. Used by the Python TLS tests.

use std::path::PathBuf;

use anyhow::Context;
use kvmesh_e2e::certs::TestCerts;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .context("usage: kvmesh-test-certs DIR")?;
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    TestCerts::generate(&dir)?;
    println!("{}", dir.display());
    Ok(())
}
