//! `POST /v1/audio/transcriptions`, shaped as vLLM serves it: a multipart form with the
//! audio in `file` and the `model` (checked like every route's), read as it streams in.
//! The simulator transcribes nothing: its `text` names the file and its size and SHA-256,
//! so a test can tell the bytes arrived whole and in order.

use std::sync::Arc;

use http::{Request, Response, StatusCode};
use http_body_util::BodyDataStream;
use hyper::body::Incoming;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::body::{ResponseBody, json_response};
use super::error::ApiError;
use super::generation::resolve_model;
use super::state::EngineState;

/// vLLM's `TranscriptionResponse` (`response_format: json`).
#[derive(Debug, Serialize)]
struct Transcription {
    text: String,
}

/// Answers one transcription request.
pub(crate) async fn handle(
    state: &Arc<EngineState>,
    req: Request<Incoming>,
) -> Result<Response<ResponseBody>, ApiError> {
    let content_type = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("");
    let boundary = multer::parse_boundary(content_type)
        .map_err(|_| ApiError::bad_request("expected a multipart/form-data body"))?;
    let mut form = multer::Multipart::new(BodyDataStream::new(req.into_body()), boundary);
    let unreadable = |error: multer::Error| ApiError::bad_request(format!("invalid form: {error}"));
    let mut model = None;
    let mut file = None;
    while let Some(mut field) = form.next_field().await.map_err(unreadable)? {
        match field.name() {
            Some("model") => model = Some(field.text().await.map_err(unreadable)?),
            Some("file") => {
                let name = field.file_name().unwrap_or("file").to_string();
                let (mut digest, mut bytes) = (Sha256::new(), 0usize);
                while let Some(chunk) = field.chunk().await.map_err(unreadable)? {
                    digest.update(&chunk);
                    bytes += chunk.len();
                }
                file = Some((name, bytes, digest.finalize()));
            }
            _ => {}
        }
    }
    resolve_model(state, model.as_deref())?;
    let Some((name, bytes, digest)) = file else {
        return Err(ApiError::bad_request("the form has no `file`").with_param("file"));
    };
    let hex: String = digest.iter().map(|byte| format!("{byte:02x}")).collect();
    let text = format!("{bytes} bytes of {name}, sha256 {hex}");
    Ok(json_response(StatusCode::OK, &Transcription { text }))
}
