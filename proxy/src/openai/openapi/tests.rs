//! The document against the route table and the proxy's own errors.

use std::collections::BTreeSet;

use http::Method;
use kvmesh_h1::strict::Violation;
use serde_json::Value;

use super::{DOCS_PAGE, SPEC};
use crate::openai::api_error::ApiError;
use crate::openai::route::{EngineRoutes, Route, RouteMatch, match_route};

const METHODS: [&str; 7] = ["get", "put", "post", "delete", "options", "head", "patch"];

/// Where the 404 for an unknown path is documented.
const UNKNOWN_PATH: &str = "#/components/responses/UnknownPath";

fn document() -> Value {
    serde_json::from_slice(SPEC).expect("openapi.json is JSON")
}

/// Follows a local `$ref` (`#/a/b`) to its target.
fn resolve<'a>(doc: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    doc.pointer(pointer)
}

/// `value`, or what its `$ref` points at.
fn deref<'a>(doc: &'a Value, value: &'a Value) -> &'a Value {
    match value.get("$ref").and_then(Value::as_str) {
        Some(reference) => resolve(doc, reference).unwrap_or(&Value::Null),
        None => value,
    }
}

/// Every documented (path, method, operation).
fn operations(doc: &Value) -> Vec<(String, Method, &Value)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for (method, operation) in item.as_object().expect("path item") {
            assert!(METHODS.contains(&method.as_str()), "{path}: {method}");
            let method =
                Method::from_bytes(method.to_ascii_uppercase().as_bytes()).expect("method");
            out.push((path.clone(), method, operation));
        }
    }
    out
}

/// One value of every [`ApiError`] variant. The match has no wildcard: a new
/// variant does not compile until it has a sample here and its status is
/// documented in `openapi.json`.
fn every_api_error() -> Vec<ApiError> {
    let all = vec![
        ApiError::InvalidJson("eof".into()),
        ApiError::InvalidBody("bad".into()),
        ApiError::MissingModel,
        ApiError::ModelNotFound {
            model: "x".into(),
            known: "a".into(),
        },
        ApiError::BodyTooLarge { limit: 1 },
        ApiError::MethodNotAllowed { allow: "POST" },
        ApiError::UnknownPath { path: "/x".into() },
        ApiError::RequestTimeout,
        ApiError::InvalidPrompt("template".into()),
        ApiError::Overloaded {
            model: "m".into(),
            reason: "busy",
            retry_after_secs: 1,
        },
        ApiError::NoHealthyInstance {
            model: "m".into(),
            retry_after_secs: 1,
        },
        ApiError::OnlyPrefillInstances { model: "m".into() },
        ApiError::UpstreamTimeout,
        ApiError::UpstreamUnavailable {
            detail: "refused".into(),
        },
        ApiError::PrefillFailed {
            model: "m".into(),
            detail: "refused".into(),
        },
        ApiError::Unauthorized { missing: true },
        ApiError::Unauthorized { missing: false },
        ApiError::ModelNotAllowed { model: "m".into() },
        ApiError::RouteNotAllowed {
            path: "/sleep".into(),
        },
        ApiError::RateLimited {
            limit: "requests_per_second",
            retry_after_secs: 1,
        },
        ApiError::ConcurrencyLimited {
            model: "m".into(),
            reason: "queue full",
            retry_after_secs: 1,
        },
        ApiError::HeadersTooLarge {
            detail: "101 fields".into(),
        },
        ApiError::MalformedRequest,
        ApiError::InvalidFraming(Violation::LengthAndCoding),
    ];
    for error in &all {
        match error {
            ApiError::InvalidJson(_)
            | ApiError::InvalidBody(_)
            | ApiError::MissingModel
            | ApiError::ModelNotFound { .. }
            | ApiError::BodyTooLarge { .. }
            | ApiError::MethodNotAllowed { .. }
            | ApiError::UnknownPath { .. }
            | ApiError::RequestTimeout
            | ApiError::InvalidPrompt(_)
            | ApiError::Overloaded { .. }
            | ApiError::NoHealthyInstance { .. }
            | ApiError::OnlyPrefillInstances { .. }
            | ApiError::UpstreamTimeout
            | ApiError::UpstreamUnavailable { .. }
            | ApiError::PrefillFailed { .. }
            | ApiError::Unauthorized { .. }
            | ApiError::ModelNotAllowed { .. }
            | ApiError::RouteNotAllowed { .. }
            | ApiError::RateLimited { .. }
            | ApiError::ConcurrencyLimited { .. }
            | ApiError::HeadersTooLarge { .. }
            | ApiError::MalformedRequest
            | ApiError::InvalidFraming(_) => {}
        }
    }
    all
}

/// Whether `error` can answer a request on `route`. A malformed head, or one whose framing
/// is refused, has no route: its 400 is documented with the other 400s.
fn can_answer(error: &ApiError, route: Route) -> bool {
    match error {
        ApiError::MethodNotAllowed { .. } | ApiError::HeadersTooLarge { .. } => true,
        ApiError::UnknownPath { .. } | ApiError::MalformedRequest | ApiError::InvalidFraming(_) => {
            false
        }
        ApiError::Unauthorized { .. } => !matches!(route, Route::OpenApi | Route::Docs),
        ApiError::RouteNotAllowed { .. } => matches!(route, Route::Engine(_)),
        _ => route.is_proxied(),
    }
}

#[test]
fn the_document_is_openapi_3_1_with_the_crate_version() {
    let doc = document();
    assert_eq!(doc["openapi"], "3.1.0");
    assert_eq!(doc["info"]["version"], env!("CARGO_PKG_VERSION"));
    assert!(doc["info"]["title"].is_string());
}

#[test]
fn every_route_is_documented_and_every_documented_path_is_routed() {
    let doc = document();
    let ours = EngineRoutes::default();
    let mut documented = Vec::new();
    for (path, method, operation) in operations(&doc) {
        match match_route(&ours, &method, &path) {
            RouteMatch::Found(route) => documented.push(route),
            other => panic!("{method} {path} is documented but routes to {other:?}"),
        }
        assert!(
            operation["operationId"].is_string(),
            "{method} {path}: operationId"
        );
        assert!(
            operation["responses"].get("200").is_some(),
            "{method} {path}: 200"
        );
    }
    let documented_set: BTreeSet<usize> = documented.iter().map(|r| r.index()).collect();
    assert_eq!(documented.len(), documented_set.len(), "a route twice");
    // The engines' own routes are theirs to document.
    let routed: BTreeSet<usize> = Route::ALL
        .iter()
        .filter(|r| !matches!(r, Route::Engine(_)))
        .map(|r| r.index())
        .collect();
    assert_eq!(documented_set, routed, "routes without a documented path");
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in METHODS {
            if item.get(method).is_none() {
                let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes()).unwrap();
                assert!(
                    matches!(
                        match_route(&ours, &method, path),
                        RouteMatch::MethodNotAllowed(_)
                    ),
                    "{method} {path} is routed but not documented"
                );
            }
        }
    }
}

#[test]
fn every_error_the_proxy_generates_is_documented() {
    let doc = document();
    let ours = EngineRoutes::default();
    let error_schema = &doc["components"]["schemas"]["Error"];
    let codes = error_schema["properties"]["error"]["properties"]["code"]["examples"]
        .as_array()
        .expect("code examples");
    let required = error_schema["properties"]["error"]["required"]
        .as_array()
        .expect("required");
    let operations = operations(&doc);
    for error in every_api_error() {
        assert!(
            codes.contains(&Value::from(error.code())),
            "code {} is not listed in Error.code.examples",
            error.code()
        );
        let body: Value = serde_json::from_slice(&error.body()).unwrap();
        for field in required {
            let field = field.as_str().unwrap();
            assert!(body["error"].get(field).is_some(), "{error:?}: {field}");
        }
        let status = error.status().to_string();
        if matches!(error, ApiError::UnknownPath { .. }) {
            let response = resolve(&doc, UNKNOWN_PATH).expect("UnknownPath");
            assert_eq!(
                response["content"]["application/json"]["schema"]["$ref"],
                "#/components/schemas/Error"
            );
        }
        for (path, method, operation) in &operations {
            let RouteMatch::Found(route) = match_route(&ours, method, path) else {
                unreachable!()
            };
            if !can_answer(&error, route) {
                continue;
            }
            let response = deref(&doc, &operation["responses"][&status]);
            assert!(
                response.is_object(),
                "{method} {path}: status {status} of {error:?} is not documented"
            );
            assert_eq!(
                response["content"]["application/json"]["schema"]["$ref"],
                "#/components/schemas/Error",
                "{method} {path} {status}"
            );
            let headers = &response["headers"];
            assert!(headers.get("x-request-id").is_some(), "{path} {status}");
            if matches!(error, ApiError::MethodNotAllowed { .. }) {
                assert!(headers.get("Allow").is_some(), "{path} {status}");
            }
            if matches!(
                error,
                ApiError::NoHealthyInstance { .. }
                    | ApiError::Overloaded { .. }
                    | ApiError::RateLimited { .. }
                    | ApiError::ConcurrencyLimited { .. }
            ) {
                assert!(headers.get("Retry-After").is_some(), "{path} {status}");
            }
            if matches!(error, ApiError::Unauthorized { .. }) {
                assert!(headers.get("WWW-Authenticate").is_some(), "{path} {status}");
            }
        }
    }
}

#[test]
fn every_reference_resolves_and_every_component_is_used() {
    let doc = document();
    let mut references = BTreeSet::new();
    let mut stack = vec![&doc];
    while let Some(value) = stack.pop() {
        match value {
            Value::Object(map) => {
                if let Some(Value::String(reference)) = map.get("$ref") {
                    assert!(resolve(&doc, reference).is_some(), "dangling {reference}");
                    references.insert(reference.clone());
                }
                stack.extend(map.values());
            }
            Value::Array(items) => stack.extend(items),
            _ => {}
        }
    }
    // The answer to a path kvmesh does not serve belongs to no documented path.
    references.insert(UNKNOWN_PATH.to_string());
    for (kind, entries) in doc["components"].as_object().expect("components") {
        for name in entries.as_object().expect("component map").keys() {
            let reference = format!("#/components/{kind}/{name}");
            assert!(references.contains(&reference), "{reference} is unused");
        }
    }
}

#[test]
fn the_docs_page_is_self_contained() {
    let page = std::str::from_utf8(DOCS_PAGE).expect("UTF-8");
    assert!(page.starts_with("<!doctype html>"));
    assert!(page.contains("fetch(\"openapi.json\")"));
    for external in ["http://", "https://", "//cdn", "<link", "src="] {
        assert!(!page.contains(external), "docs.html references {external}");
    }
}
