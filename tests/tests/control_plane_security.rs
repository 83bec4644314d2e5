//! The control plane's clients against nats-server and etcd with TLS and auth switched on
//! (real servers, configured as docs/security.md shows): mutual TLS for both, each NATS auth
//! kind, etcd's user / password auth, and the clear errors that wrong credentials and
//! certificates get.

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use kvmesh_control::testing::{EtcdServer, EtcdTls, NatsServer, instance_record, temp_dir};
use kvmesh_control::{
    EtcdAuth, EtcdRegistry, EtcdSettings, EventBus, InstanceRecord, Namespace, NatsAuth, NatsBus,
    NatsSettings, Registry, TlsFiles,
};
use kvmesh_e2e::certs::TestCerts;

const SECOND: Duration = Duration::from_secs(1);

fn secret(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{text}\n")).expect("write secret");
    path
}

fn nats(url: &str, tls: Option<TlsFiles>, auth: NatsAuth) -> NatsSettings {
    NatsSettings {
        tls,
        auth,
        ..NatsSettings::new(url, "security-test")
    }
}

/// A message published on the connection comes back through a subscription of its own.
async fn round_trip(bus: &NatsBus) {
    let mut sub = bus.subscribe("kvmesh.kv.m").await.expect("subscribe");
    bus.publish("kvmesh.kv.m", Bytes::from_static(b"hello"))
        .await
        .expect("publish");
    let message = tokio::time::timeout(5 * SECOND, sub.next())
        .await
        .expect("message in time")
        .expect("subscription open");
    assert_eq!(&message.payload[..], b"hello");
}

async fn refused(settings: &NatsSettings) -> String {
    NatsBus::connect_with(settings)
        .await
        .map(drop)
        .expect_err("the server refuses")
        .to_string()
}

#[tokio::test]
async fn nats_mutual_tls_accepts_the_right_certificates_only() {
    let dir = temp_dir("security-nats-tls");
    let certs = TestCerts::generate(&dir).expect("certs");
    let config = format!(
        "tls {{\n  cert_file: {:?}\n  key_file: {:?}\n  ca_file: {:?}\n  verify: true\n}}\n",
        certs.server_cert, certs.server_key, certs.ca
    );
    let server = NatsServer::start_with_config(&dir.join("nats"), &config)
        .await
        .expect("nats starts");
    let tls = |ca: &Path, client: bool| TlsFiles {
        ca_file: Some(ca.to_owned()),
        cert_file: client.then(|| certs.client_cert.clone()),
        key_file: client.then(|| certs.client_key.clone()),
    };
    let bus = NatsBus::connect_with(&nats(
        &server.url(),
        Some(tls(&certs.ca, true)),
        NatsAuth::None,
    ))
    .await
    .expect("mutual TLS connects");
    round_trip(&bus).await;
    let tls_url = server.url().replace("nats://", "tls://");
    let again = NatsBus::connect_with(&nats(&tls_url, Some(tls(&certs.ca, true)), NatsAuth::None))
        .await
        .expect("a tls:// URL connects too");
    round_trip(&again).await;

    // No client certificate, a server signed by a CA we do not trust, no TLS at all.
    refused(&nats(
        &server.url(),
        Some(tls(&certs.ca, false)),
        NatsAuth::None,
    ))
    .await;
    refused(&nats(
        &server.url(),
        Some(tls(&certs.other_ca, true)),
        NatsAuth::None,
    ))
    .await;
    refused(&nats(&server.url(), None, NatsAuth::None)).await;
    // A missing file is named before anything is sent.
    let missing = TlsFiles {
        ca_file: Some(dir.join("nope.pem")),
        ..TlsFiles::default()
    };
    let error = refused(&nats(&server.url(), Some(missing), NatsAuth::None)).await;
    assert!(error.contains("nope.pem"), "{error}");
}

#[tokio::test]
async fn nats_token_user_password_and_nkey_auth() {
    let dir = temp_dir("security-nats-auth");
    let user_key = nkeys::KeyPair::new_user();
    let config = format!(
        "authorization {{\n  users = [\n    {{ user: agent, password: \"pw-1\" }}\n    {{ nkey: {} }}\n  ]\n}}\n",
        user_key.public_key()
    );
    let server = NatsServer::start_with_config(&dir.join("users-server"), &config)
        .await
        .expect("nats starts");
    let url = server.url();
    let password = |text: &str| secret(&dir, "password", text);
    let bus = NatsBus::connect_with(&nats(
        &url,
        None,
        NatsAuth::UserPassword {
            user: "agent".to_owned(),
            password_file: password("pw-1"),
        },
    ))
    .await
    .expect("user and password connect");
    round_trip(&bus).await;
    let seed = secret(&dir, "seed", &user_key.seed().expect("seed"));
    let bus = NatsBus::connect_with(&nats(&url, None, NatsAuth::Nkey { seed_file: seed }))
        .await
        .expect("nkey connects");
    round_trip(&bus).await;
    let wrong = refused(&nats(
        &url,
        None,
        NatsAuth::UserPassword {
            user: "agent".to_owned(),
            password_file: password("wrong"),
        },
    ))
    .await;
    assert!(wrong.contains("authorization violation"), "{wrong}");
    let other_key = nkeys::KeyPair::new_user();
    let other_seed = secret(&dir, "other-seed", &other_key.seed().expect("seed"));
    refused(&nats(
        &url,
        None,
        NatsAuth::Nkey {
            seed_file: other_seed,
        },
    ))
    .await;
    refused(&nats(&url, None, NatsAuth::None)).await;

    let token_server = NatsServer::start_with_config(
        &dir.join("token-server"),
        "authorization {\n  token: \"t0ken\"\n}\n",
    )
    .await
    .expect("nats starts");
    let token = |text: &str| NatsAuth::Token {
        token_file: secret(&dir, "token", text),
    };
    let bus = NatsBus::connect_with(&nats(&token_server.url(), None, token("t0ken")))
        .await
        .expect("token connects");
    round_trip(&bus).await;
    let wrong = refused(&nats(&token_server.url(), None, token("nope"))).await;
    assert!(wrong.contains("authorization violation"), "{wrong}");
    let empty = refused(&nats(&token_server.url(), None, token(""))).await;
    assert!(empty.contains("is empty"), "{empty}");
}

/// A NATS JWT of `claims` (`nats` beside the standard fields) for `subject`, signed by
/// `issuer`, as nsc would write it.
fn jwt(issuer: &nkeys::KeyPair, subject: &str, name: &str, nats: serde_json::Value) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": format!("{name}-{}", std::process::id()),
        "iat": 1_700_000_000u64,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let claims = b64.encode(claims.to_string());
    let signed = format!("{header}.{claims}");
    let signature = issuer.sign(signed.as_bytes()).expect("sign");
    format!("{signed}.{}", b64.encode(signature))
}

#[tokio::test]
async fn nats_creds_file_auth_in_operator_mode() {
    let dir = temp_dir("security-nats-creds");
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let unlimited = serde_json::json!({"subs": -1, "data": -1, "payload": -1});
    let operator_jwt = jwt(
        &operator,
        &operator.public_key(),
        "kvmesh-test-operator",
        serde_json::json!({"type": "operator", "version": 2}),
    );
    let account_jwt = jwt(
        &operator,
        &account.public_key(),
        "kvmesh",
        serde_json::json!({
            "type": "account", "version": 2,
            "limits": {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                       "wildcards": true, "conn": -1, "leaf": -1},
        }),
    );
    let mut user_claims = unlimited.clone();
    user_claims["type"] = "user".into();
    user_claims["version"] = 2.into();
    let user_jwt = jwt(&account, &user.public_key(), "agent", user_claims);
    let config = format!(
        "operator: {operator_jwt}\nresolver: MEMORY\nresolver_preload: {{\n  {}: {account_jwt}\n}}\n",
        account.public_key()
    );
    let server = NatsServer::start_with_config(&dir.join("server"), &config)
        .await
        .expect("nats starts");
    let creds = |user_jwt: &str, seed: &str| {
        let text = format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        );
        NatsAuth::Credentials {
            creds_file: secret(&dir, "user.creds", &text),
        }
    };
    let bus = NatsBus::connect_with(&nats(
        &server.url(),
        None,
        creds(&user_jwt, &user.seed().expect("seed")),
    ))
    .await
    .expect("the creds file connects");
    round_trip(&bus).await;
    // The JWT of a user the account never signed, with that user's own seed.
    let stranger = nkeys::KeyPair::new_user();
    let self_signed = jwt(&stranger, &stranger.public_key(), "stranger", unlimited);
    refused(&nats(
        &server.url(),
        None,
        creds(&self_signed, &stranger.seed().expect("seed")),
    ))
    .await;
    refused(&nats(&server.url(), None, NatsAuth::None)).await;
}

fn record(id: u64) -> InstanceRecord {
    instance_record(&Namespace::default(), "m", id)
}

#[tokio::test]
async fn etcd_with_client_certificates_accepts_the_right_ones_only() {
    let dir = temp_dir("security-etcd-tls");
    let certs = TestCerts::generate(&dir).expect("certs");
    let etcd = EtcdServer::start_tls(
        &dir.join("etcd"),
        EtcdTls {
            cert: certs.server_cert.clone(),
            key: certs.server_key.clone(),
            ca: certs.ca.clone(),
            client_cert_auth: true,
        },
    )
    .await
    .expect("etcd starts");
    assert!(etcd.url().starts_with("https://"));
    let settings = |ca: &Path, client: bool| EtcdSettings {
        endpoints: etcd.url(),
        tls: Some(TlsFiles {
            ca_file: Some(ca.to_owned()),
            cert_file: client.then(|| certs.client_cert.clone()),
            key_file: client.then(|| certs.client_key.clone()),
        }),
        auth: None,
    };
    let registry = EtcdRegistry::with_settings(&settings(&certs.ca, true)).expect("client");
    registry
        .put("/kvmesh/instances/m/1", &record(1), None)
        .await
        .expect("put over mutual TLS");
    let listing = registry.list("/kvmesh/instances/").await.expect("list");
    assert_eq!(listing.records.len(), 1);

    for (ca, client) in [(&certs.ca, false), (&certs.other_ca, true)] {
        let registry = EtcdRegistry::with_settings(&settings(ca, client)).expect("client");
        assert!(
            registry.list("/kvmesh/instances/").await.is_err(),
            "ca {ca:?}, client certificate {client}"
        );
    }
    let plain = EtcdRegistry::with_settings(&EtcdSettings::new(
        &etcd.url().replace("https://", "http://"),
    ))
    .expect("client");
    assert!(plain.list("/kvmesh/instances/").await.is_err());
}

#[tokio::test]
async fn etcd_user_and_password_auth() {
    let dir = temp_dir("security-etcd-auth");
    let etcd = EtcdServer::start(&dir.join("etcd"))
        .await
        .expect("etcd starts");
    let mut admin = etcd_client::Client::connect([etcd.url()], None)
        .await
        .expect("admin client");
    admin.user_add("root", "root-pw", None).await.expect("root");
    admin.user_grant_role("root", "root").await.expect("role");
    admin
        .user_add("agent", "agent-pw", None)
        .await
        .expect("user");
    admin.user_grant_role("agent", "root").await.expect("role");
    admin.auth_enable().await.expect("auth on");

    let settings = |password: &str| EtcdSettings {
        endpoints: etcd.url(),
        tls: None,
        auth: Some(EtcdAuth {
            user: "agent".to_owned(),
            password_file: secret(&dir, &format!("pw-{password}"), password),
        }),
    };
    let registry = EtcdRegistry::with_settings(&settings("agent-pw")).expect("client");
    let lease = registry.grant_lease(10 * SECOND).await.expect("lease");
    registry
        .put("/kvmesh/instances/m/2", &record(2), Some(lease))
        .await
        .expect("put as agent");
    registry.keep_alive(lease).await.expect("keep-alive");
    let mut watch = registry.watch("/kvmesh/instances/");
    let first = tokio::time::timeout(5 * SECOND, watch.next())
        .await
        .expect("watch in time")
        .expect("watch open");
    assert!(
        matches!(first, kvmesh_control::WatchEvent::Put { ref key, .. } if key == "/kvmesh/instances/m/2"),
        "{first:?}"
    );

    let wrong = EtcdRegistry::with_settings(&settings("wrong")).expect("client");
    let error = wrong
        .list("/kvmesh/instances/")
        .await
        .expect_err("a wrong password is refused")
        .to_string();
    assert!(
        error.contains("etcd refused the client") && error.contains("authentication failed"),
        "{error}"
    );
    let anonymous = EtcdRegistry::new(&etcd.url()).expect("client");
    assert!(anonymous.list("/kvmesh/instances/").await.is_err());
}
