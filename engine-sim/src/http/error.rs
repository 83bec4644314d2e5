//! OpenAI-shaped error responses: `{"error":{"message","type","param","code"}}`.

use http::{Response, StatusCode};
use serde::Serialize;

use super::body::{ResponseBody, json_response};
use crate::protocol::InvalidRequest;

/// An error answered to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable reason.
    pub message: String,
    /// Offending field.
    pub param: Option<&'static str>,
    /// The `type` vLLM gives this error, when it is not the status's usual one.
    pub error_type: Option<&'static str>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'static str>,
    code: u16,
}

impl ApiError {
    /// An error with `status`.
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            error_type: None,
        }
    }

    /// A 400 Bad Request.
    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// Sets the offending field.
    pub(crate) fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    /// Sets the error `type` (e.g. vLLM's `InvalidUserInput`) instead of the status's usual one.
    pub(crate) fn with_type(mut self, error_type: &'static str) -> Self {
        self.error_type = Some(error_type);
        self
    }

    /// vLLM-style error type name: the one set, else the status's usual one.
    fn kind(&self) -> &'static str {
        if let Some(kind) = self.error_type {
            return kind;
        }
        match self.status.as_u16() {
            400 => "BadRequestError",
            401 => "AuthenticationError",
            403 => "PermissionDeniedError",
            404 => "NotFoundError",
            405 => "MethodNotAllowedError",
            413 => "RequestEntityTooLargeError",
            429 => "RateLimitError",
            500 => "InternalServerError",
            503 => "ServiceUnavailableError",
            _ => "SimulatedError",
        }
    }

    /// The JSON body alone, for errors inside an SSE stream.
    pub(crate) fn body_json(&self) -> Vec<u8> {
        serde_json::to_vec(&self.body()).unwrap_or_default()
    }

    fn body(&self) -> ErrorBody<'_> {
        ErrorBody {
            error: ErrorDetail {
                message: &self.message,
                kind: self.kind(),
                param: self.param,
                code: self.status.as_u16(),
            },
        }
    }

    /// The HTTP response.
    pub(crate) fn into_response(self) -> Response<ResponseBody> {
        json_response(self.status, &self.body())
    }
}

impl From<InvalidRequest> for ApiError {
    fn from(e: InvalidRequest) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: e.message,
            param: e.param,
            error_type: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_openai_shaped() {
        let e = ApiError::bad_request("nope").with_param("prompt");
        let v: serde_json::Value = serde_json::from_slice(&e.body_json()).expect("json");
        assert_eq!(v["error"]["message"], "nope");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["param"], "prompt");
        assert_eq!(v["error"]["code"], 400);
        let e = ApiError::new(StatusCode::from_u16(418).expect("valid"), "teapot");
        let v: serde_json::Value = serde_json::from_slice(&e.body_json()).expect("json");
        assert_eq!(v["error"]["param"], serde_json::Value::Null);
        assert_eq!(v["error"]["code"], 418);
        let e = ApiError::bad_request("no").with_type("InvalidUserInput");
        let v: serde_json::Value = serde_json::from_slice(&e.body_json()).expect("json");
        assert_eq!(v["error"]["type"], "InvalidUserInput");
    }
}
