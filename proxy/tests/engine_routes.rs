//! The engines' own routes (`engine_routes`): forwarded as they are to an instance of the
//! model the request names (in its JSON body, a form field, the query or a header), with
//! the same admission, keys and metrics as kvmesh's routes; admin routes only for keys
//! with `engine_admin`.

#[allow(dead_code)]
mod support;

mod edge_support;

use bytes::Bytes;
use edge_support::metric_reaching;
use http::Method;
use kvmesh_proxy::sha256_hex;
use support::{Backend, TestProxy, error_of, send};

/// Two models, each on its own backend (`b` has the alias `b-alias`).
async fn two_models(extra: &str) -> (Backend, Backend, TestProxy) {
    let a = Backend::ok().await;
    let b = Backend::ok().await;
    let yaml = format!(
        "models:\n  - name: a\n    backends:\n      - url: {}\n  - name: b\n    aliases: [b-alias]\n    backends:\n      - url: {}\nhealth_check:\n  enabled: false\n{extra}",
        a.url, b.url
    );
    (a, b, TestProxy::start(&yaml).await)
}

const JSON: (&str, &str) = ("content-type", "application/json");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inference_routes_go_to_the_model_the_request_names() {
    let (a, b, proxy) = two_models("").await;
    // The JSON body's model (an alias rewritten to the model's name).
    let body = r#"{"model":"b-alias","prompt":"hello"}"#;
    let reply = send(proxy.main, Method::POST, "/tokenize", &[JSON], body).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-kvmesh-instance"), Some(b.url.as_str()));
    // The query's, on a GET route.
    let reply = send(
        proxy.main,
        Method::GET,
        "/tokenizer_info?x=1&model=a",
        &[],
        Bytes::new(),
    )
    .await;
    assert_eq!(reply.status, 200);
    // The header's.
    let headers = [JSON, ("x-kvmesh-model", "b")];
    let reply = send(proxy.main, Method::POST, "/v1/rerank", &headers, "{}").await;
    assert_eq!(reply.status, 200);
    // A form field of a multipart body.
    let form = "--XyZ\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\na\r\n\
                --XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\
                Content-Type: audio/wav\r\n\r\nRIFF....\r\n--XyZ--\r\n";
    let multipart = [("content-type", "multipart/form-data; boundary=XyZ")];
    let reply = send(
        proxy.main,
        Method::POST,
        "/v1/audio/transcriptions",
        &multipart,
        form,
    )
    .await;
    assert_eq!(reply.status, 200);

    let at_a: Vec<_> = a.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(
        at_a,
        ["/tokenizer_info?x=1&model=a", "/v1/audio/transcriptions"]
    );
    let at_b = b.requests();
    assert_eq!(at_b.len(), 2, "{:?}", b.seen());
    assert_eq!(at_b[0].path, "/tokenize");
    assert_eq!(at_b[0].body, r#"{"model":"b","prompt":"hello"}"#);
    assert_eq!(at_b[1].path, "/v1/rerank");
    assert_eq!(
        a.requests()[1].body,
        form.as_bytes(),
        "the form is forwarded as it came"
    );
    for (route, model) in [
        ("/tokenize", "b"),
        ("/tokenizer_info", "a"),
        ("/v1/rerank", "b"),
        ("/v1/audio/transcriptions", "a"),
    ] {
        let series = format!(
            "kvmesh_requests_total{{model=\"{model}\",protocol=\"http\",route=\"{route}\",status=\"200\"}}"
        );
        assert_eq!(
            metric_reaching(proxy.admin, &series, 1.0).await,
            1.0,
            "{series}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_names_no_model_is_400_unless_one_model_is_served() {
    let (a, b, proxy) = two_models("").await;
    let reply = send(
        proxy.main,
        Method::POST,
        "/tokenize",
        &[JSON],
        r#"{"prompt":"x"}"#,
    )
    .await;
    assert_eq!(reply.status, 400);
    assert_eq!(error_of(reply).await["code"], "missing_model");
    let unknown = [JSON, ("x-kvmesh-model", "nope")];
    let reply = send(proxy.main, Method::POST, "/tokenize", &unknown, "{}").await;
    assert_eq!(reply.status, 404);
    assert_eq!(error_of(reply).await["code"], "model_not_found");
    let broken = send(
        proxy.main,
        Method::POST,
        "/tokenize",
        &[JSON],
        "{\"model\":",
    )
    .await;
    assert_eq!(broken.status, 400);
    assert_eq!(error_of(broken).await["code"], "invalid_json");
    assert!(a.requests().is_empty() && b.requests().is_empty());
    let missing = r#"kvmesh_client_errors_total{reason="missing_model"}"#;
    assert_eq!(metric_reaching(proxy.admin, missing, 1.0).await, 1.0);

    let only = Backend::ok().await;
    let yaml = format!(
        "models:\n  - name: m\n    backends:\n      - url: {}\nhealth_check:\n  enabled: false\n",
        only.url
    );
    let single = TestProxy::start(&yaml).await;
    let reply = send(
        single.main,
        Method::POST,
        "/detokenize",
        &[JSON],
        r#"{"tokens":[1]}"#,
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(only.seen().len(), 1, "{:?}", only.seen());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_are_forwarded_only_for_keys_allowed_them() {
    let keys = format!(
        "auth:\n  keys:\n    - name: ops\n      sha256: {}\n      engine_admin: true\n    - name: app\n      sha256: {}\n",
        sha256_hex(b"sk-ops"),
        sha256_hex(b"sk-app")
    );
    let (a, _b, proxy) = two_models(&keys).await;
    let app = [JSON, ("authorization", "Bearer sk-app")];
    let body = r#"{"model":"a"}"#;
    let refused = send(proxy.main, Method::POST, "/reset_prefix_cache", &app, body).await;
    assert_eq!(refused.status, 403);
    let error = error_of(refused).await;
    assert_eq!(error["code"], "route_not_allowed");
    assert_eq!(error["type"], "permission_error");
    assert!(a.requests().is_empty());
    // The same key may use the inference routes.
    let reply = send(proxy.main, Method::POST, "/tokenize", &app, body).await;
    assert_eq!(reply.status, 200);

    let ops = [JSON, ("authorization", "Bearer sk-ops")];
    let reply = send(proxy.main, Method::POST, "/reset_prefix_cache", &ops, body).await;
    assert_eq!(reply.status, 200);
    let paths: Vec<_> = a.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/tokenize", "/reset_prefix_cache"]);
    assert!(
        a.requests()
            .iter()
            .all(|r| !r.headers.contains_key("authorization")),
        "the key stays with kvmesh"
    );
    let refusals = r#"kvmesh_client_errors_total{reason="route_not_allowed"}"#;
    assert_eq!(metric_reaching(proxy.admin, refusals, 1.0).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_config_chooses_what_is_forwarded() {
    let routes = "engine_routes:\n  forward: [/v1/score, /custom/infer]\n";
    let (a, _b, proxy) = two_models(routes).await;
    let body = r#"{"model":"a"}"#;
    let not_listed = send(proxy.main, Method::POST, "/tokenize", &[JSON], body).await;
    assert_eq!(not_listed.status, 404);
    assert_eq!(error_of(not_listed).await["code"], "unknown_url");
    let wrong_method = send(proxy.main, Method::GET, "/v1/score", &[], Bytes::new()).await;
    assert_eq!(wrong_method.status, 405);
    assert_eq!(wrong_method.header("allow"), Some("POST"));
    for path in ["/v1/score", "/custom/infer"] {
        let reply = send(proxy.main, Method::POST, path, &[JSON], body).await;
        assert_eq!(reply.status, 200, "{path}");
    }
    let paths: Vec<_> = a.requests().iter().map(|r| r.path.clone()).collect();
    assert_eq!(paths, ["/v1/score", "/custom/infer"]);
    let other = r#"kvmesh_requests_total{model="a",protocol="http",route="other",status="200"}"#;
    assert_eq!(metric_reaching(proxy.admin, other, 1.0).await, 1.0);
}
