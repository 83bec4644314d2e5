//! Errors the proxy answers itself, in OpenAI's shape:
//! `{"error":{"message","type","param","code"}}`.

use bytes::Bytes;
use kvmesh_h1::strict::Violation;
use serde::Serialize;

/// Why a client's request was rejected before reaching an engine; one
/// `kvmesh_client_errors_total` series each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClientErrorReason {
    /// Body is not JSON.
    InvalidJson,
    /// Body is JSON but not a valid request object.
    InvalidBody,
    /// No `model` field.
    MissingModel,
    /// `model` names no configured model or alias.
    ModelNotFound,
    /// Body larger than `limits.max_body_bytes`.
    BodyTooLarge,
    /// Known path, wrong method.
    MethodNotAllowed,
    /// Unknown path.
    UnknownPath,
    /// Head or body not received within `limits.client_header_timeout`.
    RequestTimeout,
    /// The chat template rejected the request, or the chat body is invalid (`policy: kv`).
    InvalidPrompt,
    /// No API key, or an unknown one (auth on).
    Unauthorized,
    /// The API key may not use the model.
    ModelNotAllowed,
    /// The route is an engine admin route and the request's API key may not use it.
    RouteNotAllowed,
    /// The API key is over one of its limits.
    RateLimited,
    /// The request head is over `limits.max_header_bytes` or `limits.max_headers`.
    HeadersTooLarge,
    /// The request head is not valid HTTP.
    MalformedRequest,
    /// The request's framing, `Host` or target breaks RFC 9112 (`kvmesh_h1::strict`), or
    /// its chunked body is malformed.
    InvalidFraming,
}

/// Number of [`ClientErrorReason`]s.
pub(crate) const CLIENT_ERROR_REASONS: usize = 16;

impl ClientErrorReason {
    /// Every reason, in declaration order.
    pub(crate) const ALL: [ClientErrorReason; CLIENT_ERROR_REASONS] = [
        Self::InvalidJson,
        Self::InvalidBody,
        Self::MissingModel,
        Self::ModelNotFound,
        Self::BodyTooLarge,
        Self::MethodNotAllowed,
        Self::UnknownPath,
        Self::RequestTimeout,
        Self::InvalidPrompt,
        Self::Unauthorized,
        Self::ModelNotAllowed,
        Self::RouteNotAllowed,
        Self::RateLimited,
        Self::HeadersTooLarge,
        Self::MalformedRequest,
        Self::InvalidFraming,
    ];

    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::InvalidJson => "invalid_json",
            Self::InvalidBody => "invalid_body",
            Self::MissingModel => "missing_model",
            Self::ModelNotFound => "model_not_found",
            Self::BodyTooLarge => "body_too_large",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::UnknownPath => "unknown_path",
            Self::RequestTimeout => "request_timeout",
            Self::InvalidPrompt => "invalid_prompt",
            Self::Unauthorized => "unauthorized",
            Self::ModelNotAllowed => "model_not_allowed",
            Self::RouteNotAllowed => "route_not_allowed",
            Self::RateLimited => "rate_limited",
            Self::HeadersTooLarge => "headers_too_large",
            Self::MalformedRequest => "malformed_request",
            Self::InvalidFraming => "invalid_framing",
        }
    }
}

/// An error response the proxy generates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ApiError {
    /// 400: the body is not JSON.
    InvalidJson(String),
    /// 400: the body is JSON of the wrong shape.
    InvalidBody(String),
    /// 400: no `model`.
    MissingModel,
    /// 404: unknown model; `known` lists the served names.
    ModelNotFound {
        /// The requested name.
        model: String,
        /// Comma-separated served names and aliases.
        known: String,
    },
    /// 413: body over the limit.
    BodyTooLarge {
        /// The limit in bytes.
        limit: u64,
    },
    /// 405: wrong method; `allow` is the method that is.
    MethodNotAllowed {
        /// Value of the `Allow` header.
        allow: &'static str,
    },
    /// 404: no such path.
    UnknownPath {
        /// The requested path.
        path: String,
    },
    /// 408: the client was too slow sending its request.
    RequestTimeout,
    /// 400: the chat template raised, or the chat body is invalid; the message is the
    /// preprocessor's (`policy: kv`).
    InvalidPrompt(String),
    /// 503: every instance of the model is busy (`policy: kv` thresholds).
    Overloaded {
        /// The model.
        model: String,
        /// Why nothing was admitted.
        reason: &'static str,
        /// Seconds to wait before retrying (`Retry-After`).
        retry_after_secs: u64,
    },
    /// 503: every instance of the model is unhealthy or ejected.
    NoHealthyInstance {
        /// The model.
        model: String,
        /// Seconds until an instance may be back (`Retry-After`).
        retry_after_secs: u64,
    },
    /// 503: every instance of a model that is not disaggregated only prefills (`--role
    /// prefill`): none takes a whole request.
    OnlyPrefillInstances {
        /// The model.
        model: String,
    },
    /// 503: a disaggregated model's prefill leg failed and its `on_prefill_failure` is
    /// `fail`.
    PrefillFailed {
        /// The model.
        model: String,
        /// What the prefill leg saw.
        detail: String,
    },
    /// 504: no response headers within `limits.first_byte_timeout`.
    UpstreamTimeout,
    /// 502: every attempt failed before a response byte.
    UpstreamUnavailable {
        /// What the last attempt saw.
        detail: String,
    },
    /// 401: no API key, or one that matches none configured (the key is never echoed).
    Unauthorized {
        /// No key was presented at all.
        missing: bool,
    },
    /// 403: the API key may not use the model.
    ModelNotAllowed {
        /// The requested name.
        model: String,
    },
    /// 403: an engine admin route, and the request's API key (if any) lacks `engine_admin`.
    RouteNotAllowed {
        /// The requested path.
        path: String,
    },
    /// 429: the API key is over a limit.
    RateLimited {
        /// The limit's config field (`requests_per_second`, `tokens_per_minute`, `max_concurrency`).
        limit: &'static str,
        /// Seconds to wait before retrying (`Retry-After`).
        retry_after_secs: u64,
    },
    /// 503: the model's concurrency limit is reached and no slot became free.
    ConcurrencyLimited {
        /// The model.
        model: String,
        /// Why no slot was given.
        reason: &'static str,
        /// Seconds to wait before retrying (`Retry-After`).
        retry_after_secs: u64,
    },
    /// 431: the request head is over a limit.
    HeadersTooLarge {
        /// Which limit, and by how much.
        detail: String,
    },
    /// 400: the request head is not valid HTTP.
    MalformedRequest,
    /// 400: the request's framing, `Host` or target breaks RFC 9112, or its chunked body is
    /// malformed; the connection is closed after the answer.
    InvalidFraming(Violation),
}

#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: &'a str,
}

/// The JSON error object, as bytes.
pub(crate) fn error_json(message: &str, kind: &str, param: Option<&str>, code: &str) -> Vec<u8> {
    let envelope = Envelope {
        error: Body {
            message,
            kind,
            param,
            code,
        },
    };
    serde_json::to_vec(&envelope).unwrap_or_else(|_| b"{\"error\":{}}".to_vec())
}

impl ApiError {
    /// HTTP status.
    pub(crate) fn status(&self) -> u16 {
        match self {
            Self::InvalidJson(_)
            | Self::InvalidBody(_)
            | Self::MissingModel
            | Self::InvalidPrompt(_)
            | Self::MalformedRequest
            | Self::InvalidFraming(_) => 400,
            Self::Unauthorized { .. } => 401,
            Self::ModelNotAllowed { .. } | Self::RouteNotAllowed { .. } => 403,
            Self::ModelNotFound { .. } | Self::UnknownPath { .. } => 404,
            Self::MethodNotAllowed { .. } => 405,
            Self::RequestTimeout => 408,
            Self::BodyTooLarge { .. } => 413,
            Self::RateLimited { .. } => 429,
            Self::HeadersTooLarge { .. } => 431,
            Self::UpstreamUnavailable { .. } => 502,
            Self::NoHealthyInstance { .. }
            | Self::OnlyPrefillInstances { .. }
            | Self::Overloaded { .. }
            | Self::ConcurrencyLimited { .. }
            | Self::PrefillFailed { .. } => 503,
            Self::UpstreamTimeout => 504,
        }
    }

    /// OpenAI `type`.
    pub(crate) fn error_type(&self) -> &'static str {
        match self {
            Self::InvalidJson(_)
            | Self::InvalidBody(_)
            | Self::MissingModel
            | Self::BodyTooLarge { .. }
            | Self::MethodNotAllowed { .. }
            | Self::RequestTimeout
            | Self::InvalidPrompt(_)
            | Self::Unauthorized { .. }
            | Self::HeadersTooLarge { .. }
            | Self::MalformedRequest
            | Self::InvalidFraming(_) => "invalid_request_error",
            Self::ModelNotAllowed { .. } | Self::RouteNotAllowed { .. } => "permission_error",
            Self::RateLimited { limit, .. } if *limit == "tokens_per_minute" => "tokens",
            Self::RateLimited { .. } => "requests",
            Self::ModelNotFound { .. } | Self::UnknownPath { .. } => "not_found_error",
            Self::NoHealthyInstance { .. }
            | Self::OnlyPrefillInstances { .. }
            | Self::Overloaded { .. }
            | Self::ConcurrencyLimited { .. }
            | Self::PrefillFailed { .. } => "service_unavailable",
            Self::UpstreamTimeout => "timeout",
            Self::UpstreamUnavailable { .. } => "upstream_error",
        }
    }

    /// OpenAI `code`.
    pub(crate) fn code(&self) -> &'static str {
        match self {
            Self::InvalidJson(_) => "invalid_json",
            Self::InvalidBody(_) => "invalid_body",
            Self::MissingModel => "missing_model",
            Self::ModelNotFound { .. } => "model_not_found",
            Self::BodyTooLarge { .. } => "request_too_large",
            Self::MethodNotAllowed { .. } => "method_not_allowed",
            Self::UnknownPath { .. } => "unknown_url",
            Self::RequestTimeout => "request_timeout",
            Self::InvalidPrompt(_) => "invalid_prompt",
            Self::NoHealthyInstance { .. } => "no_healthy_instance",
            Self::OnlyPrefillInstances { .. } => "only_prefill_instances",
            Self::Overloaded { .. } => "all_instances_busy",
            Self::UpstreamTimeout => "upstream_timeout",
            Self::UpstreamUnavailable { .. } => "upstream_unavailable",
            Self::PrefillFailed { .. } => "prefill_failed",
            Self::Unauthorized { missing: true } => "missing_api_key",
            Self::Unauthorized { missing: false } => "invalid_api_key",
            Self::ModelNotAllowed { .. } => "model_not_allowed",
            Self::RouteNotAllowed { .. } => "route_not_allowed",
            Self::RateLimited { .. } => "rate_limit_exceeded",
            Self::ConcurrencyLimited { .. } => "model_concurrency_limit",
            Self::HeadersTooLarge { .. } => "request_header_fields_too_large",
            Self::MalformedRequest => "malformed_request",
            Self::InvalidFraming(_) => "invalid_framing",
        }
    }

    /// OpenAI `param`: the request field at fault, if one is.
    pub(crate) fn param(&self) -> Option<&'static str> {
        match self {
            Self::MissingModel | Self::ModelNotFound { .. } | Self::ModelNotAllowed { .. } => {
                Some("model")
            }
            Self::InvalidPrompt(_) => Some("messages"),
            _ => None,
        }
    }

    /// Human-readable message.
    pub(crate) fn message(&self) -> String {
        match self {
            Self::InvalidJson(detail) => format!("request body is not valid JSON: {detail}"),
            Self::InvalidBody(detail) => format!("invalid request body: {detail}"),
            Self::MissingModel => "you must provide a model parameter".to_string(),
            Self::ModelNotFound { model, known } => {
                format!("the model {model:?} does not exist; known models: {known}")
            }
            Self::BodyTooLarge { limit } => {
                format!("request body is larger than the limit of {limit} bytes")
            }
            Self::MethodNotAllowed { allow } => format!("method not allowed; use {allow}"),
            Self::UnknownPath { path } => format!("unknown path {path:?}"),
            Self::RequestTimeout => "the request was not received in time".to_string(),
            Self::InvalidPrompt(detail) => detail.clone(),
            Self::Overloaded { model, reason, .. } => {
                format!("model {model:?} is overloaded: {reason}; retry later")
            }
            Self::NoHealthyInstance { model, .. } => {
                format!("no healthy instance of model {model:?} is available; retry later")
            }
            Self::OnlyPrefillInstances { model } => format!(
                "every instance of model {model:?} is registered prefill only (--role prefill) \
                 and the model has no `disaggregation` entry, so none takes a whole request: \
                 register decode or both instances, or configure disaggregation for it"
            ),
            Self::UpstreamTimeout => "the engine did not answer in time".to_string(),
            Self::UpstreamUnavailable { detail } => {
                format!("the engine could not be reached: {detail}")
            }
            Self::PrefillFailed { model, detail } => {
                format!("the prefill leg of model {model:?} failed: {detail}")
            }
            Self::Unauthorized { missing: true } => {
                "you didn't provide an API key; send it as `Authorization: Bearer <key>`"
                    .to_string()
            }
            Self::Unauthorized { missing: false } => "incorrect API key provided".to_string(),
            Self::ModelNotAllowed { model } => {
                format!("this API key may not use the model {model:?}")
            }
            Self::RouteNotAllowed { path } => format!(
                "{path} is an engine admin route: only API keys with engine_admin: true may use it"
            ),
            Self::RateLimited {
                limit,
                retry_after_secs,
            } => format!(
                "rate limit reached for this API key ({limit}); retry in {retry_after_secs}s"
            ),
            Self::ConcurrencyLimited { model, reason, .. } => {
                format!("model {model:?} is at capacity: {reason}; retry later")
            }
            Self::HeadersTooLarge { detail } => {
                format!("request header fields too large: {detail}")
            }
            Self::MalformedRequest => "the request is not valid HTTP".to_string(),
            Self::InvalidFraming(violation) => {
                format!(
                    "the request is not valid HTTP/1.1: {}",
                    violation.describe()
                )
            }
        }
    }

    /// The response body.
    pub(crate) fn body(&self) -> Bytes {
        Bytes::from(error_json(
            &self.message(),
            self.error_type(),
            self.param(),
            self.code(),
        ))
    }

    /// The `kvmesh_client_errors_total` reason, for errors caused by the client.
    pub(crate) fn client_reason(&self) -> Option<ClientErrorReason> {
        Some(match self {
            Self::InvalidJson(_) => ClientErrorReason::InvalidJson,
            Self::InvalidBody(_) => ClientErrorReason::InvalidBody,
            Self::MissingModel => ClientErrorReason::MissingModel,
            Self::ModelNotFound { .. } => ClientErrorReason::ModelNotFound,
            Self::BodyTooLarge { .. } => ClientErrorReason::BodyTooLarge,
            Self::MethodNotAllowed { .. } => ClientErrorReason::MethodNotAllowed,
            Self::UnknownPath { .. } => ClientErrorReason::UnknownPath,
            Self::RequestTimeout => ClientErrorReason::RequestTimeout,
            Self::InvalidPrompt(_) => ClientErrorReason::InvalidPrompt,
            Self::Unauthorized { .. } => ClientErrorReason::Unauthorized,
            Self::ModelNotAllowed { .. } => ClientErrorReason::ModelNotAllowed,
            Self::RouteNotAllowed { .. } => ClientErrorReason::RouteNotAllowed,
            Self::RateLimited { .. } => ClientErrorReason::RateLimited,
            Self::HeadersTooLarge { .. } => ClientErrorReason::HeadersTooLarge,
            Self::MalformedRequest => ClientErrorReason::MalformedRequest,
            Self::InvalidFraming(_) => ClientErrorReason::InvalidFraming,
            Self::NoHealthyInstance { .. }
            | Self::OnlyPrefillInstances { .. }
            | Self::Overloaded { .. }
            | Self::ConcurrencyLimited { .. }
            | Self::UpstreamTimeout
            | Self::UpstreamUnavailable { .. }
            | Self::PrefillFailed { .. } => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(error: &ApiError) -> serde_json::Value {
        serde_json::from_slice(&error.body()).unwrap()
    }

    #[test]
    fn bodies_have_the_openai_shape() {
        let all = [
            ApiError::InvalidJson("eof".into()),
            ApiError::InvalidBody("bad".into()),
            ApiError::MissingModel,
            ApiError::ModelNotFound {
                model: "x".into(),
                known: "a, b".into(),
            },
            ApiError::BodyTooLarge { limit: 10 },
            ApiError::MethodNotAllowed { allow: "POST" },
            ApiError::UnknownPath { path: "/x".into() },
            ApiError::RequestTimeout,
            ApiError::NoHealthyInstance {
                model: "a".into(),
                retry_after_secs: 1,
            },
            ApiError::UpstreamTimeout,
            ApiError::UpstreamUnavailable {
                detail: "refused".into(),
            },
            ApiError::InvalidPrompt("template says no".into()),
            ApiError::Overloaded {
                model: "m".into(),
                reason: "every instance is busy",
                retry_after_secs: 1,
            },
            ApiError::Unauthorized { missing: true },
            ApiError::Unauthorized { missing: false },
            ApiError::ModelNotAllowed { model: "m".into() },
            ApiError::RateLimited {
                limit: "tokens_per_minute",
                retry_after_secs: 3,
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
            let json = parse(error);
            let inner = json["error"].as_object().unwrap();
            assert_eq!(inner.len(), 4, "{json}");
            assert_eq!(inner["message"], error.message());
            assert_eq!(inner["type"], error.error_type());
            assert_eq!(inner["code"], error.code());
            assert!(inner.contains_key("param"));
            assert_eq!(
                error.client_reason().is_some(),
                error.status() < 500,
                "{error:?}"
            );
        }
    }

    #[test]
    fn statuses_and_details() {
        let missing = ApiError::MissingModel;
        assert_eq!(missing.status(), 400);
        assert_eq!(parse(&missing)["error"]["param"], "model");
        let unknown = ApiError::ModelNotFound {
            model: "gpt-9".into(),
            known: "qwen3, qwen".into(),
        };
        assert_eq!(unknown.status(), 404);
        let message = unknown.message();
        assert!(message.contains("\"gpt-9\"") && message.contains("qwen3, qwen"));
        assert_eq!(ApiError::BodyTooLarge { limit: 5 }.status(), 413);
        assert_eq!(ApiError::MethodNotAllowed { allow: "GET" }.status(), 405);
        assert_eq!(ApiError::UpstreamTimeout.status(), 504);
        assert_eq!(ApiError::UpstreamTimeout.error_type(), "timeout");
        assert_eq!(
            ApiError::UpstreamUnavailable {
                detail: String::new()
            }
            .status(),
            502
        );
        let none = ApiError::NoHealthyInstance {
            model: "m".into(),
            retry_after_secs: 3,
        };
        assert_eq!(none.status(), 503);
        assert_eq!(parse(&none)["error"]["param"], serde_json::Value::Null);
    }

    #[test]
    fn messages_are_escaped() {
        let error = ApiError::InvalidBody("a \"quoted\"\nline".into());
        let json = parse(&error);
        assert!(
            json["error"]["message"]
                .as_str()
                .unwrap()
                .contains("\"quoted\"\n")
        );
    }

    #[test]
    fn reasons_have_distinct_labels() {
        let mut labels: Vec<_> = ClientErrorReason::ALL.iter().map(|r| r.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), CLIENT_ERROR_REASONS);
    }
}
