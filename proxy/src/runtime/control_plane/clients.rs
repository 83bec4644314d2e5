//! The etcd and NATS client settings of the proxy, from `discovery` and `events` (their
//! `tls` and `auth` blocks).

use kvmesh_config::{ControlTlsConfig, DiscoveryConfig, EventsConfig, NatsAuthConfig};
use kvmesh_control::{
    DurableStream, EtcdAuth, EtcdSettings, Namespace, NatsAuth, NatsSettings, TlsFiles,
};

/// Name the proxy's NATS connection shows in the server's connection list.
const NATS_CLIENT_NAME: &str = "kvmesh-proxy";

fn tls_files(tls: &ControlTlsConfig) -> TlsFiles {
    TlsFiles {
        ca_file: tls.ca.clone(),
        cert_file: tls.cert.clone(),
        key_file: tls.key.clone(),
    }
}

/// The etcd client settings of `discovery`.
pub(crate) fn etcd_settings(discovery: &DiscoveryConfig) -> EtcdSettings {
    EtcdSettings {
        endpoints: discovery.endpoint.clone(),
        tls: discovery.tls.as_ref().map(tls_files),
        auth: discovery.auth.as_ref().map(|auth| EtcdAuth {
            user: auth.user.clone(),
            password_file: auth.password_file.clone(),
        }),
    }
}

/// The NATS client settings of `events`, whose subjects live under `namespace`.
pub(crate) fn nats_settings(events: &EventsConfig, namespace: &Namespace) -> NatsSettings {
    NatsSettings {
        url: events.url.clone(),
        name: NATS_CLIENT_NAME.to_owned(),
        tls: events.tls.as_ref().map(tls_files),
        auth: nats_auth(&events.auth),
        durable: events.jetstream.as_ref().map(|jetstream| DurableStream {
            name: jetstream.stream.clone(),
            subjects: vec![namespace.all_events_subject()],
            max_age: jetstream.max_age,
        }),
        ping_interval: events.ping_interval,
    }
}

/// The one kind of credentials the config names (validation refused several).
fn nats_auth(auth: &NatsAuthConfig) -> NatsAuth {
    NatsAuth::first_of(
        auth.token_file.clone(),
        auth.user.clone().zip(auth.password_file.clone()),
        auth.nkey_seed_file.clone(),
        auth.creds_file.clone(),
    )
}
