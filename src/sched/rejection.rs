use crate::http::HttpStatus;
use crate::ids::RequestId;

/// Why a request was turned away at admission. Decided before anything is
/// allocated; the request is never truncated or replaced by a placeholder.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    #[error("{id}: the prompt is empty: send at least one token")]
    EmptyPrompt { id: RequestId },
    #[error(
        "{id}: prompt of {prompt} tokens exceeds the context window of {max_context}: shorten the prompt"
    )]
    PromptTooLong {
        id: RequestId,
        prompt: usize,
        max_context: usize,
    },
    #[error(
        "{id}: prompt of {prompt} tokens plus max_new_tokens {max_new} exceeds the context window of \
         {max_context}: {advice}",
        advice = match max_context.saturating_sub(*prompt) {
            0 => format!(
                "shorten the prompt to at most {} tokens to generate any",
                max_context.saturating_sub(1)
            ),
            fit => format!("lower max_new_tokens to at most {fit}"),
        }
    )]
    ExceedsWindow {
        id: RequestId,
        prompt: usize,
        max_new: usize,
        max_context: usize,
    },
    #[error(
        "{id}: {tokens} tokens can never fit this worker's KV pool of {pool_tokens} tokens: shorten the request"
    )]
    ExceedsPool {
        id: RequestId,
        tokens: usize,
        pool_tokens: usize,
    },
    #[error("{id}: token {token} at prompt index {index} is outside the vocabulary of {vocab}")]
    InvalidToken {
        id: RequestId,
        index: usize,
        token: u32,
        vocab: usize,
    },
    #[error("{id}: max_new_tokens is 0: ask for at least one token")]
    ZeroMaxNewTokens { id: RequestId },
    #[error("{id}: invalid sampling parameters: {reason}")]
    InvalidSampling { id: RequestId, reason: &'static str },
    #[error("{id}: a request with this id is already queued or running: use a fresh id")]
    DuplicateId { id: RequestId },
    #[error("{id}: the queue is full ({limit} waiting): retry later")]
    QueueFull { id: RequestId, limit: usize },
    #[error("{id}: the worker is shutting down: retry on another worker")]
    ShuttingDown { id: RequestId },
    /// A host asked to requeue a request this scheduler has not handed out
    /// (unknown, finished, or still waiting): a bug in the host.
    #[error(
        "{id}: not a request this scheduler handed out (unknown, finished or still waiting): \
         only requeue what pop_if or plan_step returned, and submit new requests"
    )]
    NotHandedOut { id: RequestId },
}

impl Rejection {
    /// The rejected request.
    pub fn request_id(&self) -> RequestId {
        match self {
            Rejection::EmptyPrompt { id }
            | Rejection::PromptTooLong { id, .. }
            | Rejection::ExceedsWindow { id, .. }
            | Rejection::ExceedsPool { id, .. }
            | Rejection::InvalidToken { id, .. }
            | Rejection::ZeroMaxNewTokens { id }
            | Rejection::InvalidSampling { id, .. }
            | Rejection::DuplicateId { id }
            | Rejection::QueueFull { id, .. }
            | Rejection::ShuttingDown { id }
            | Rejection::NotHandedOut { id } => *id,
        }
    }
}

impl HttpStatus for Rejection {
    fn http_status(&self) -> u16 {
        match self {
            Rejection::PromptTooLong { .. } | Rejection::ExceedsPool { .. } => 413,
            Rejection::DuplicateId { .. } => 409,
            Rejection::QueueFull { .. } => 429,
            Rejection::ShuttingDown { .. } => 503,
            Rejection::NotHandedOut { .. } => 500,
            Rejection::EmptyPrompt { .. }
            | Rejection::ExceedsWindow { .. }
            | Rejection::InvalidToken { .. }
            | Rejection::ZeroMaxNewTokens { .. }
            | Rejection::InvalidSampling { .. } => 400,
        }
    }
}
