//! OpenAI-style error bodies carrying the crate's mapped HTTP status.
//!
//! Every error this server answers is `{"error": {"message", "type",
//! "param", "code"}}` with the status the library's [`HttpStatus`] gives
//! the underlying error (rejections at admission, failures while
//! generating); errors the server finds itself (bad JSON, bad parameters,
//! a missing key) use the status OpenAI uses for them. A request that fails
//! never gets a 200 with partial or invented text.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use handoff::transfer::TransferError;
use handoff::{EngineError, HttpStatus, Outcome, Rejection};
use serde_json::json;

/// Seconds a client told "queue full" (429) should wait before retrying.
pub const RETRY_AFTER_SECS: u64 = 1;

/// One error answer.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// OpenAI's `error.type`.
    pub kind: &'static str,
    /// OpenAI's `error.code` (`context_length_exceeded`, ...).
    pub code: Option<&'static str>,
    /// The request field at fault, when there is one.
    pub param: Option<&'static str>,
    /// Sent as `Retry-After` (seconds).
    pub retry_after: Option<u64>,
    /// A short label for the metrics (`rejected`, `failed`, ...).
    pub outcome: &'static str,
}

fn kind_of(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        429 => "rate_limit_error",
        500..=599 => "server_error",
        _ => "invalid_request_error",
    }
}

impl ApiError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind: kind_of(status),
            code: None,
            param: None,
            retry_after: None,
            outcome: if status >= 500 { "failed" } else { "invalid" },
        }
    }

    /// A 400 naming the request field at fault.
    pub fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param),
            code: Some("invalid_value"),
            ..ApiError::new(400, message)
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// No key, or a key the server does not know (401).
    pub fn unauthorized(message: impl Into<String>) -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            outcome: "unauthorized",
            ..ApiError::new(401, message)
        }
    }

    /// The server is draining (503): retry on another server.
    pub fn shutting_down() -> Self {
        ApiError {
            code: Some("service_unavailable"),
            outcome: "rejected",
            ..ApiError::new(
                503,
                "the server is shutting down and takes no new requests: retry on another server",
            )
        }
    }

    /// The model is still loading (503): retry shortly.
    pub fn loading() -> Self {
        ApiError {
            code: Some("service_unavailable"),
            outcome: "rejected",
            retry_after: Some(RETRY_AFTER_SECS),
            ..ApiError::new(503, "the model is loading: retry shortly")
        }
    }

    /// Admission turned the request away: the crate's status, with the
    /// code OpenAI clients know where there is one. A prompt over the
    /// context window keeps the crate's status (413 when the prompt alone
    /// can never fit, 400 when prompt plus `max_tokens` does not) and the
    /// code `context_length_exceeded` in both cases.
    pub fn from_rejection(r: &Rejection, prompt_param: &'static str) -> Self {
        let status = r.http_status();
        let mut e = ApiError {
            outcome: "rejected",
            ..ApiError::new(status, r.to_string())
        };
        match r {
            Rejection::PromptTooLong { .. } | Rejection::ExceedsPool { .. } => {
                e.code = Some("context_length_exceeded");
                e.param = Some(prompt_param);
            }
            Rejection::ExceedsWindow { .. } => {
                e.code = Some("context_length_exceeded");
                e.param = Some("max_tokens");
            }
            Rejection::EmptyPrompt { .. } | Rejection::InvalidToken { .. } => {
                e.param = Some(prompt_param);
                e.code = Some("invalid_value");
            }
            Rejection::QueueFull { .. } => {
                e.code = Some("rate_limit_exceeded");
                e.retry_after = Some(RETRY_AFTER_SECS);
            }
            Rejection::ShuttingDown { .. } => e.code = Some("service_unavailable"),
            Rejection::InvalidSampling { .. } => e.code = Some("invalid_value"),
            _ => {}
        }
        e
    }

    /// A request that ended without finishing: never answered with a 200.
    pub fn from_outcome(o: &Outcome, prompt_param: &'static str) -> Self {
        match o {
            Outcome::Rejected(r) => ApiError::from_rejection(r, prompt_param),
            Outcome::Failed(EngineError::Transfer(TransferError::Integrity(_))) => ApiError {
                code: Some("kv_integrity_failure"),
                outcome: "failed",
                ..ApiError::new(o.http_status(), o_message(o))
            },
            Outcome::Failed(EngineError::Shutdown) => ApiError {
                code: Some("service_unavailable"),
                outcome: "failed",
                ..ApiError::new(o.http_status(), o_message(o))
            },
            _ => ApiError {
                outcome: "failed",
                ..ApiError::new(o.http_status(), o_message(o))
            },
        }
    }

    /// The JSON body, also sent as an SSE event when a stream fails.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

fn o_message(o: &Outcome) -> String {
    match o {
        Outcome::Failed(e) => e.to_string(),
        Outcome::Rejected(r) => r.to_string(),
        Outcome::Cancelled => "the request was cancelled".into(),
        Outcome::Finished(_) => "the request finished".into(),
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// A short, stable label for a rejection (the metrics' `reason`).
pub fn rejection_reason(r: &Rejection) -> &'static str {
    match r {
        Rejection::EmptyPrompt { .. } => "empty_prompt",
        Rejection::PromptTooLong { .. } => "prompt_too_long",
        Rejection::ExceedsWindow { .. } => "exceeds_window",
        Rejection::ExceedsPool { .. } => "exceeds_pool",
        Rejection::InvalidToken { .. } => "invalid_token",
        Rejection::ZeroMaxNewTokens { .. } => "zero_max_tokens",
        Rejection::InvalidSampling { .. } => "invalid_sampling",
        Rejection::DuplicateId { .. } => "duplicate_id",
        Rejection::QueueFull { .. } => "queue_full",
        Rejection::ShuttingDown { .. } => "shutting_down",
        _ => "other",
    }
}
