//! How a gRPC inference request can fail, and the status each failure becomes: a gRPC
//! status for ModelInfer, an `error_message` on a ModelStreamInfer stream, and the HTTP
//! status of the same outcome for the request metrics.

use kvmesh_wire::kserve::invalid::InvalidInput;
use tonic::{Code, Status};

use crate::openai::api_error::{ApiError, ClientErrorReason};

/// Status label of a request whose client left (as on the HTTP side).
const CLIENT_CLOSED: u16 = 499;

/// Why one inference request failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The proxy answered itself (model lookup, routing, no instance, busy, timeouts).
    Api(ApiError),
    /// The request's tensors or parameters are malformed.
    Invalid(InvalidInput),
    /// The model is served, but not in this version.
    NoSuchVersion {
        /// The model.
        model: String,
        /// The version asked for.
        version: String,
    },
    /// The engine answered with an error status.
    Engine {
        /// Its HTTP status.
        status: u16,
        /// Its error message.
        message: String,
    },
    /// The engine's answer broke off or could not be read.
    EngineBroke(String),
    /// The client's deadline passed.
    Deadline,
    /// The client went away.
    Cancelled,
}

impl Failure {
    /// The gRPC status code.
    pub(crate) fn code(&self) -> Code {
        match self {
            Self::Api(error) => match error {
                ApiError::ModelNotFound { .. } | ApiError::UnknownPath { .. } => Code::NotFound,
                ApiError::Unauthorized { .. } => Code::Unauthenticated,
                ApiError::ModelNotAllowed { .. } => Code::PermissionDenied,
                ApiError::Overloaded { .. }
                | ApiError::ConcurrencyLimited { .. }
                | ApiError::RateLimited { .. }
                | ApiError::BodyTooLarge { .. } => Code::ResourceExhausted,
                ApiError::NoHealthyInstance { .. }
                | ApiError::UpstreamUnavailable { .. }
                | ApiError::PrefillFailed { .. } => Code::Unavailable,
                ApiError::UpstreamTimeout | ApiError::RequestTimeout => Code::DeadlineExceeded,
                ApiError::MethodNotAllowed { .. } => Code::Unimplemented,
                _ if error.status() < 500 => Code::InvalidArgument,
                _ => Code::Internal,
            },
            Self::Invalid(_) => Code::InvalidArgument,
            Self::NoSuchVersion { .. } => Code::NotFound,
            Self::Engine { status, .. } => match status {
                400 | 422 => Code::InvalidArgument,
                429 => Code::ResourceExhausted,
                503 => Code::Unavailable,
                _ => Code::Internal,
            },
            Self::EngineBroke(_) => Code::Internal,
            Self::Deadline => Code::DeadlineExceeded,
            Self::Cancelled => Code::Cancelled,
        }
    }

    /// The message for the client.
    pub(crate) fn message(&self) -> String {
        match self {
            Self::Api(error) => error.message(),
            Self::Invalid(invalid) => invalid.0.clone(),
            Self::NoSuchVersion { model, version } => {
                format!("model {model:?} has no version {version:?}; its only version is \"1\"")
            }
            Self::Engine { status, message } => {
                format!("the engine answered {status}: {message}")
            }
            Self::EngineBroke(detail) => detail.clone(),
            Self::Deadline => "the deadline passed before the answer was complete".to_string(),
            Self::Cancelled => "the client cancelled the request".to_string(),
        }
    }

    /// The gRPC status (ModelInfer's answer).
    pub(crate) fn status(&self) -> Status {
        Status::new(self.code(), self.message())
    }

    /// A stream's `error_message`: `CODE: message`, with the request id when it has one
    /// (several requests share a stream).
    pub(crate) fn stream_message(&self, id: &str) -> String {
        let code = code_name(self.code());
        if id.is_empty() {
            format!("{code}: {}", self.message())
        } else {
            format!("request {id:?}: {code}: {}", self.message())
        }
    }

    /// The `status` label of the request metrics: the HTTP status the same outcome has on
    /// the HTTP side (502 for an engine that broke off mid-answer).
    pub(crate) fn http_status(&self) -> u16 {
        match self {
            Self::Api(error) => error.status(),
            Self::Invalid(_) => 400,
            Self::NoSuchVersion { .. } => 404,
            Self::Engine { status, .. } => *status,
            Self::EngineBroke(_) => 502,
            Self::Deadline => 504,
            Self::Cancelled => CLIENT_CLOSED,
        }
    }

    /// The `kvmesh_client_errors_total` reason, for failures caused by the client.
    pub(crate) fn client_reason(&self) -> Option<ClientErrorReason> {
        match self {
            Self::Api(error) => error.client_reason(),
            Self::Invalid(_) => Some(ClientErrorReason::InvalidBody),
            Self::NoSuchVersion { .. } => Some(ClientErrorReason::ModelNotFound),
            _ => None,
        }
    }
}

/// The canonical name of a gRPC status code (`NOT_FOUND`).
pub(crate) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_has_its_code_and_http_status() {
        let cases = [
            (
                Failure::Api(ApiError::ModelNotFound {
                    model: "x".into(),
                    known: "m".into(),
                }),
                Code::NotFound,
                404,
            ),
            (
                Failure::Api(ApiError::MissingModel),
                Code::InvalidArgument,
                400,
            ),
            (
                Failure::Api(ApiError::InvalidPrompt("bad".into())),
                Code::InvalidArgument,
                400,
            ),
            (
                Failure::Api(ApiError::NoHealthyInstance {
                    model: "m".into(),
                    retry_after_secs: 1,
                }),
                Code::Unavailable,
                503,
            ),
            (
                Failure::Api(ApiError::Overloaded {
                    model: "m".into(),
                    reason: "busy",
                    retry_after_secs: 1,
                }),
                Code::ResourceExhausted,
                503,
            ),
            (
                Failure::Api(ApiError::UpstreamUnavailable {
                    detail: "refused".into(),
                }),
                Code::Unavailable,
                502,
            ),
            (
                Failure::Api(ApiError::UpstreamTimeout),
                Code::DeadlineExceeded,
                504,
            ),
            (
                Failure::Api(ApiError::Unauthorized { missing: true }),
                Code::Unauthenticated,
                401,
            ),
            (
                Failure::Api(ApiError::ModelNotAllowed { model: "m".into() }),
                Code::PermissionDenied,
                403,
            ),
            (
                Failure::Api(ApiError::RateLimited {
                    limit: "requests_per_second",
                    retry_after_secs: 1,
                }),
                Code::ResourceExhausted,
                429,
            ),
            (
                Failure::Api(ApiError::ConcurrencyLimited {
                    model: "m".into(),
                    reason: "full",
                    retry_after_secs: 1,
                }),
                Code::ResourceExhausted,
                503,
            ),
            (
                Failure::Invalid(InvalidInput::new("x")),
                Code::InvalidArgument,
                400,
            ),
            (
                Failure::NoSuchVersion {
                    model: "m".into(),
                    version: "2".into(),
                },
                Code::NotFound,
                404,
            ),
            (
                Failure::Engine {
                    status: 400,
                    message: "bad".into(),
                },
                Code::InvalidArgument,
                400,
            ),
            (
                Failure::Engine {
                    status: 500,
                    message: "boom".into(),
                },
                Code::Internal,
                500,
            ),
            (Failure::EngineBroke("cut".into()), Code::Internal, 502),
            (Failure::Deadline, Code::DeadlineExceeded, 504),
            (Failure::Cancelled, Code::Cancelled, 499),
        ];
        for (failure, code, http) in cases {
            assert_eq!(failure.code(), code, "{failure:?}");
            assert_eq!(failure.http_status(), http, "{failure:?}");
            assert_eq!(failure.status().code(), code);
            let proxy_rejected = matches!(
                failure,
                Failure::Api(_) | Failure::Invalid(_) | Failure::NoSuchVersion { .. }
            );
            assert_eq!(
                failure.client_reason().is_some(),
                proxy_rejected && http < 500,
                "{failure:?}"
            );
        }
    }

    #[test]
    fn stream_messages_name_the_request_and_code() {
        let failure = Failure::Engine {
            status: 500,
            message: "boom".into(),
        };
        assert_eq!(
            failure.stream_message("r7"),
            "request \"r7\": INTERNAL: the engine answered 500: boom"
        );
        assert_eq!(
            failure.stream_message(""),
            "INTERNAL: the engine answered 500: boom"
        );
    }
}
