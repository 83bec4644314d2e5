//! The CA bundle that checks `https://` engines.

use kvmesh_config::UpstreamTlsConfig;

use crate::edge::tls::{TlsError, pem};

/// The CA file to hand pingora's connector, after checking it here: the
/// connector would panic on a file it cannot load.
pub(crate) fn upstream_ca_file(tls: &UpstreamTlsConfig) -> Result<Option<String>, TlsError> {
    let Some(ca) = &tls.ca else {
        return Ok(None);
    };
    pem::roots(ca, "upstream.tls.ca")?;
    Ok(Some(ca.display().to_string()))
}
