//! TLS on data listeners and to engines: ALPN h2 and http/1.1, a wrong CA,
//! mTLS, certificate rotation under load, and errors that name field and file.

mod edge_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use edge_support::{CountingBackend, EdgeProxy, TlsClient, chat, h2_send};
use http::Method;
use kvmesh_config::Config;
use kvmesh_e2e::ScratchDir;
use kvmesh_e2e::certs::TestCerts;
use kvmesh_proxy::{Proxy, ProxyError};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

fn tls_yaml(certs: &TestCerts, extra_tls: &str, backend: &str, extra: &str) -> String {
    format!(
        "listeners:\n  - name: main\n    address: 127.0.0.1:0\n    tls:\n      cert: {}\n      key: {}\n{extra_tls}\
         admin:\n  address: 127.0.0.1:0\nmodels:\n  - name: m\n    backends:\n      - url: {backend}\n{extra}",
        certs.server_cert.display(),
        certs.server_key.display(),
    )
}

async fn chat_over(client: &TlsClient, proxy: &EdgeProxy) -> Result<edge_support::Reply, String> {
    client
        .request(
            proxy.main,
            Method::POST,
            "/v1/chat/completions",
            &[("content-type", "application/json")],
            chat("m"),
        )
        .await
}

#[tokio::test]
async fn https_serves_h2_and_http1_by_alpn() {
    let scratch = ScratchDir::new("tls-alpn").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    let backend = CountingBackend::start("a").await;
    let url = format!("http://{}", backend.addr);
    let proxy = EdgeProxy::from_yaml(&tls_yaml(&certs, "", &url, "")).await;

    let h2 = chat_over(&TlsClient::new(&certs.ca, None), &proxy)
        .await
        .unwrap();
    assert_eq!(h2.status, 200);
    assert_eq!(h2.alpn.as_deref(), Some(&b"h2"[..]));
    assert_eq!(h2.version, http::Version::HTTP_2);
    assert_eq!(h2.json()["backend"], "a");

    let h1 = chat_over(&TlsClient::http1_only(&certs.ca), &proxy)
        .await
        .unwrap();
    assert_eq!(h1.status, 200);
    assert_eq!(h1.alpn.as_deref(), Some(&b"http/1.1"[..]));
    assert_eq!(h1.version, http::Version::HTTP_11);
    // The certificate's notAfter: rcgen's default, 4096-01-01T00:00:00Z.
    let expiry = proxy
        .metric(r#"kvmesh_tls_certificate_expiry_timestamp_seconds{listener="main"}"#)
        .await;
    assert_eq!(expiry, 67_090_118_400.0);
    proxy.stop().await;
}

#[tokio::test]
async fn a_client_trusting_another_ca_fails_and_is_counted() {
    let scratch = ScratchDir::new("tls-wrong-ca").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    let backend = CountingBackend::start("a").await;
    let url = format!("http://{}", backend.addr);
    let proxy = EdgeProxy::from_yaml(&tls_yaml(&certs, "", &url, "")).await;
    let error = chat_over(&TlsClient::new(&certs.other_ca, None), &proxy)
        .await
        .unwrap_err();
    assert!(error.to_lowercase().contains("certificate"), "{error}");
    assert_eq!(backend.requests.load(Ordering::Relaxed), 0);
    let series = r#"kvmesh_tls_handshake_errors_total{listener="main",reason="error"}"#;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while proxy.metric(series).await < 1.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "handshake error not counted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    proxy.stop().await;
}

#[tokio::test]
async fn mtls_refuses_a_client_without_a_certificate() {
    let scratch = ScratchDir::new("tls-mtls").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    let backend = CountingBackend::start("a").await;
    let url = format!("http://{}", backend.addr);
    let mtls = format!(
        "      client_ca: {}\n      require_client_cert: true\n",
        certs.ca.display()
    );
    let proxy = EdgeProxy::from_yaml(&tls_yaml(&certs, &mtls, &url, "")).await;
    let anonymous = chat_over(&TlsClient::new(&certs.ca, None), &proxy).await;
    assert!(anonymous.is_err(), "{anonymous:?}");
    let identified = TlsClient::new(&certs.ca, Some((&certs.client_cert, &certs.client_key)));
    let reply = chat_over(&identified, &proxy).await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(backend.requests.load(Ordering::Relaxed), 1);
    proxy.stop().await;
}

#[tokio::test]
async fn certificate_rotation_under_load_fails_no_request() {
    let scratch = ScratchDir::new("tls-rotate").unwrap();
    let certs = Arc::new(TestCerts::generate(scratch.path()).unwrap());
    let backend = CountingBackend::start("a").await;
    let url = format!("http://{}", backend.addr);
    let extra = "reload:\n  poll_interval: 20ms\n";
    let proxy = EdgeProxy::from_yaml(&tls_yaml(&certs, "", &url, extra)).await;
    let client = TlsClient::new(&certs.ca, None);
    let old_cert = CertificateDer::from_pem_file(&certs.server_cert)
        .unwrap()
        .to_vec();

    // A connection opened before the rotation keeps working after it.
    let mut open = client.h2_connection(proxy.main).await.unwrap();
    let first = h2_send(
        &mut open,
        proxy.main.port(),
        "/v1/chat/completions",
        chat("m"),
    )
    .await;
    assert_eq!(first.unwrap().status, 200);

    let failures = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut load = Vec::new();
    for _ in 0..4 {
        let (client, failures, done, stop, main) = (
            client.clone(),
            Arc::clone(&failures),
            Arc::clone(&done),
            Arc::clone(&stop),
            proxy.main,
        );
        load.push(tokio::spawn(async move {
            let stopped = stop.notified();
            tokio::pin!(stopped);
            loop {
                let request = client.request(
                    main,
                    Method::POST,
                    "/v1/chat/completions",
                    &[("content-type", "application/json")],
                    chat("m"),
                );
                tokio::select! {
                    _ = &mut stopped => return,
                    reply = request => match reply {
                        Ok(reply) if reply.status == 200 => done.fetch_add(1, Ordering::Relaxed),
                        _ => failures.fetch_add(1, Ordering::Relaxed),
                    },
                };
            }
        }));
    }
    while done.load(Ordering::Relaxed) < 20 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let new_cert = CertificateDer::from_pem_slice(certs.rotate_server().unwrap().as_bytes())
        .unwrap()
        .to_vec();
    assert_ne!(new_cert, old_cert);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let reply = chat_over(&client, &proxy).await.unwrap();
        if reply.server_cert.as_deref() == Some(&new_cert[..]) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let at_rotation = done.load(Ordering::Relaxed);
    while done.load(Ordering::Relaxed) < at_rotation + 20 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.notify_waiters();
    for task in load {
        task.await.unwrap();
    }
    assert_eq!(failures.load(Ordering::Relaxed), 0);
    let again = h2_send(
        &mut open,
        proxy.main.port(),
        "/v1/chat/completions",
        chat("m"),
    )
    .await;
    assert_eq!(again.unwrap().status, 200, "the open connection survived");
    let reloads = proxy
        .metric(r#"kvmesh_tls_certificate_reloads_total{listener="main",result="ok"}"#)
        .await;
    assert!(reloads >= 1.0, "{reloads}");
    proxy.stop().await;
}

#[tokio::test]
async fn tls_errors_name_the_field_and_the_file() {
    let scratch = ScratchDir::new("tls-errors").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    // A key that does not go with the certificate.
    let yaml = tls_yaml(&certs, "", "http://127.0.0.1:1", "").replace(
        &certs.server_key.display().to_string(),
        &certs.client_key.display().to_string(),
    );
    let config = Config::from_yaml_str(&yaml, "edge.yaml").unwrap();
    let error = Proxy::bind(config).await.unwrap_err();
    let ProxyError::Tls(tls) = &error else {
        panic!("{error}");
    };
    assert_eq!(tls.field, "listeners[0].tls.key");
    assert_eq!(tls.file, certs.client_key.display().to_string());
    assert!(
        error
            .to_string()
            .contains("does not go with the certificate"),
        "{error}"
    );

    // A file that is not PEM is caught by validation, with its line.
    let garbage = scratch.write("garbage.pem", "not a certificate\n").unwrap();
    let yaml = tls_yaml(&certs, "", "http://127.0.0.1:1", "").replace(
        &certs.server_cert.display().to_string(),
        &garbage.display().to_string(),
    );
    let error = Config::from_yaml_str(&yaml, "edge.yaml")
        .unwrap_err()
        .to_string();
    assert!(
        error.starts_with("edge.yaml:5:13: listeners[0].tls.cert: "),
        "{error}"
    );
    assert!(
        error.contains("garbage.pem holds no PEM certificate"),
        "{error}"
    );
}

#[tokio::test]
async fn engines_behind_https_are_checked_against_the_ca_bundle() {
    let scratch = ScratchDir::new("tls-upstream").unwrap();
    let certs = TestCerts::generate(scratch.path()).unwrap();
    let backend =
        CountingBackend::start_with("tls", Some((&certs.server_cert, &certs.server_key))).await;
    let url = format!("https://localhost:{}", backend.addr.port());
    let plain_listener = |ca: &std::path::Path| {
        format!(
            "listeners:\n  - name: main\n    address: 127.0.0.1:0\nadmin:\n  address: 127.0.0.1:0\n\
             health_check:\n  enabled: false\nupstream:\n  tls:\n    ca: {}\n\
             models:\n  - name: m\n    backends:\n      - url: {url}\n",
            ca.display()
        )
    };
    let trusted = EdgeProxy::from_yaml(&plain_listener(&certs.ca)).await;
    let reply = edge_support::plain(
        trusted.main,
        Method::POST,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat("m"),
    )
    .await;
    assert_eq!(reply.status, 200, "{:?}", reply.body);
    assert_eq!(reply.json()["backend"], "tls");
    trusted.stop().await;

    let untrusted = EdgeProxy::from_yaml(&plain_listener(&certs.other_ca)).await;
    let reply = edge_support::plain(
        untrusted.main,
        Method::POST,
        "/v1/chat/completions",
        &[("content-type", "application/json")],
        chat("m"),
    )
    .await;
    assert_eq!(reply.status, 502);
    assert_eq!(backend.requests.load(Ordering::Relaxed), 1);
    untrusted.stop().await;
}
