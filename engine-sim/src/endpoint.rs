//! ZMQ `tcp://HOST:PORT` endpoints: parsing, the per-engine port offset, binding.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener};

use crate::error::SimError;

/// A parsed `tcp://HOST:PORT` endpoint. `HOST` is an IP address, `[IPv6]`, `localhost`, or `*`
/// (every interface, as in vLLM's `tcp://*:5557`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TcpEndpoint {
    host: IpAddr,
    port: u16,
}

impl TcpEndpoint {
    /// Parses `endpoint`; only the `tcp` transport is supported.
    pub(crate) fn parse(endpoint: &str) -> Result<Self, String> {
        let rest = endpoint
            .strip_prefix("tcp://")
            .ok_or_else(|| format!("`{endpoint}`: only tcp://HOST:PORT endpoints are supported"))?;
        let (host, port) = rest
            .rsplit_once(':')
            .ok_or_else(|| format!("`{endpoint}`: expected tcp://HOST:PORT"))?;
        let port = port
            .parse::<u16>()
            .map_err(|_| format!("`{endpoint}`: the port must be a number from 0 to 65535"))?;
        let host = match host {
            "*" => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            "localhost" => IpAddr::V4(Ipv4Addr::LOCALHOST),
            h => h
                .strip_prefix('[')
                .and_then(|h| h.strip_suffix(']'))
                .map(|h| h.parse::<Ipv6Addr>().map(IpAddr::V6))
                .unwrap_or_else(|| h.parse::<IpAddr>())
                .map_err(|_| {
                    format!("`{endpoint}`: the host must be an IP address, localhost or *")
                })?,
        };
        Ok(Self { host, port })
    }

    /// The address engine `index` of a process uses: the port plus the index (vLLM's data
    /// parallel rule), or port 0 for every engine when the port is 0.
    pub(crate) fn address(&self, index: usize) -> Result<SocketAddr, SimError> {
        if self.port == 0 {
            return Ok(SocketAddr::new(self.host, 0));
        }
        let port = u16::try_from(usize::from(self.port) + index).map_err(|_| {
            SimError::InvalidConfig(format!("port {} + {index} exceeds 65535", self.port))
        })?;
        Ok(SocketAddr::new(self.host, port))
    }

    /// Binds a listener for engine `index`.
    pub(crate) fn bind(&self, index: usize) -> Result<TcpListener, SimError> {
        let addr = self.address(index)?;
        TcpListener::bind(addr).map_err(|source| SimError::Bind { addr, source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hosts_and_ports() {
        let e = TcpEndpoint::parse("tcp://*:5557").expect("wildcard");
        assert_eq!(
            e.address(2).ok(),
            Some(SocketAddr::from(([0, 0, 0, 0], 5559)))
        );
        let e = TcpEndpoint::parse("tcp://127.0.0.1:0").expect("ipv4");
        assert_eq!(
            e.address(3).ok(),
            Some(SocketAddr::from(([127, 0, 0, 1], 0)))
        );
        let e = TcpEndpoint::parse("tcp://[::1]:6000").expect("ipv6");
        assert_eq!(e.address(0).map(|a| a.port()).ok(), Some(6000));
        assert!(TcpEndpoint::parse("tcp://localhost:1").is_ok());
        for bad in [
            "ipc:///tmp/x",
            "inproc://x",
            "tcp://127.0.0.1",
            "tcp://127.0.0.1:70000",
            "tcp://example.com:5557",
        ] {
            assert!(TcpEndpoint::parse(bad).is_err(), "{bad}");
        }
        let e = TcpEndpoint::parse("tcp://127.0.0.1:65535").expect("max port");
        assert!(e.address(1).is_err());
    }

    #[test]
    fn binds_a_free_port() {
        let e = TcpEndpoint::parse("tcp://127.0.0.1:0").expect("endpoint");
        let listener = e.bind(0).expect("bind");
        assert_ne!(listener.local_addr().map(|a| a.port()).ok(), Some(0));
    }
}
