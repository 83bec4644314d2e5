//! What a reload cannot change: the listeners' names and addresses, whether a
//! listener uses TLS, the admin address and the gRPC listener (sockets are bound once), and
//! tracing (its exporter starts once).

use kvmesh_config::Config;

/// Why `next` cannot replace `current`, if it cannot.
pub(crate) fn incompatibility(current: &Config, next: &Config) -> Option<String> {
    if current.listeners.len() != next.listeners.len() {
        return Some(format!(
            "the number of listeners changed ({} -> {}); listeners change only on restart",
            current.listeners.len(),
            next.listeners.len()
        ));
    }
    for (i, (old, new)) in current.listeners.iter().zip(&next.listeners).enumerate() {
        if old.name != new.name || old.address != new.address {
            return Some(format!(
                "listeners[{i}] changed from {} {} to {} {}; listener names and addresses change only on restart",
                old.name, old.address, new.name, new.address
            ));
        }
        if old.tls.is_some() != new.tls.is_some() {
            return Some(format!(
                "listeners[{i}].tls was turned {}; TLS is turned on or off only on restart (its files and settings may change)",
                if new.tls.is_some() { "on" } else { "off" }
            ));
        }
    }
    if current.admin.address != next.admin.address {
        return Some(format!(
            "admin.address changed from {} to {}; it changes only on restart",
            current.admin.address, next.admin.address
        ));
    }
    if current.grpc != next.grpc {
        return Some("the grpc section changed; the gRPC listener changes only on restart".into());
    }
    if current.telemetry != next.telemetry {
        return Some("the telemetry section changed; tracing changes only on restart".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(listeners: &str) -> Config {
        let text = format!(
            "listeners:\n{listeners}admin:\n  address: 127.0.0.1:0\nmodels:\n  - name: m\n    backends:\n      - url: http://127.0.0.1:1\n"
        );
        Config::from_yaml_str(&text, "t.yaml").unwrap()
    }

    #[test]
    fn listeners_and_admin_must_stay() {
        let one = config("  - name: main\n    address: 127.0.0.1:0\n");
        assert_eq!(incompatibility(&one, &one), None);
        let mut models = one.clone();
        models.models[0].name = "other".into();
        models.limits.max_body_bytes = 1;
        assert_eq!(incompatibility(&one, &models), None);
        let moved = config("  - name: main\n    address: 127.0.0.1:1\n");
        let reason = incompatibility(&one, &moved).unwrap();
        assert!(reason.contains("listeners[0] changed"), "{reason}");
        let renamed = config("  - name: other\n    address: 127.0.0.1:0\n");
        assert!(incompatibility(&one, &renamed).is_some());
        let two = config(
            "  - name: main\n    address: 127.0.0.1:0\n  - name: b\n    address: 127.0.0.1:0\n",
        );
        assert!(
            incompatibility(&one, &two)
                .unwrap()
                .contains("number of listeners")
        );
        let mut admin = one.clone();
        admin.admin.address = "127.0.0.1:1".parse().unwrap();
        assert!(
            incompatibility(&one, &admin)
                .unwrap()
                .contains("admin.address")
        );
        let mut grpc = one.clone();
        grpc.grpc.max_stream_requests = 1;
        assert!(incompatibility(&one, &grpc).unwrap().contains("grpc"));
        let mut traced = one.clone();
        traced.telemetry.sampling_ratio = 0.5;
        assert!(
            incompatibility(&one, &traced)
                .unwrap()
                .contains("telemetry")
        );
    }
}
