//! ZMQ TCP endpoints of the engine, per data-parallel rank (port + rank, wire-formats.md §1.2).

/// `tcp://HOST:PORT` with the port moved by `rank`; a `*` host (a bind address) becomes
/// 127.0.0.1, since the agent runs beside the engine.
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("endpoint {endpoint:?} must be tcp://HOST:PORT"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("endpoint {endpoint:?} has no port"))?;
    let port: u16 = port
        .parse()
        .map_err(|_| format!("endpoint {endpoint:?} has an invalid port"))?;
    let port = u32::from(port) + rank;
    let port = u16::try_from(port)
        .map_err(|_| format!("endpoint {endpoint:?}: port {port} for rank {rank} is too large"))?;
    if port == 0 {
        return Err(format!(
            "endpoint {endpoint:?}: port 0 cannot be connected to"
        ));
    }
    let host = match host {
        "*" | "0.0.0.0" | "" => "127.0.0.1",
        "[::]" | "::" => "[::1]",
        h => h,
    };
    Ok(format!("tcp://{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_offset_the_port() {
        assert_eq!(
            rank_endpoint("tcp://127.0.0.1:5557", 0).as_deref(),
            Ok("tcp://127.0.0.1:5557")
        );
        assert_eq!(
            rank_endpoint("tcp://*:5557", 2).as_deref(),
            Ok("tcp://127.0.0.1:5559")
        );
        assert_eq!(
            rank_endpoint("tcp://engine:6000", 1).as_deref(),
            Ok("tcp://engine:6001")
        );
        assert!(rank_endpoint("ipc:///tmp/x", 0).is_err());
        assert!(rank_endpoint("tcp://h:65535", 1).is_err());
        assert!(rank_endpoint("tcp://h:0", 0).is_err());
        assert!(rank_endpoint("tcp://h", 0).is_err());
    }
}
