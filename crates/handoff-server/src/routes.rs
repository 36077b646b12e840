//! The HTTP routes: `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions` (behind the API-key check), `/metrics` (open, or
//! behind `--metrics-key`), `/health` (the process is up) and `/ready` (the
//! model is loaded and the server takes requests).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, State};
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use handoff::sampling::TokenLogprobs;
use handoff::service::Submitter;
use handoff::{Event, FinishReason, Outcome, Request, RequestId, TenantId};
use serde_json::{Value, json};
use tracing::{Instrument, info_span};

use crate::access::Answered;
use crate::auth::{self, Auth};
use crate::codec::TextCodec;
use crate::errors::ApiError;
use crate::generation::{self, Generation};
use crate::logprobs::LogprobJson;
use crate::metrics::Metrics;
use crate::reply::{Api, Detok, Reply, usage};
use crate::{sse, wire};

/// What every handler shares.
pub struct AppState {
    pub submitter: Submitter,
    pub codec: Arc<dyn TextCodec>,
    pub auth: Auth,
    pub metrics: Metrics,
    pub model_name: String,
    pub window: usize,
    /// Unix seconds at startup (`created` of the model).
    pub created: u64,
    pub next_id: AtomicU64,
    /// Mixed into each request's default seed.
    pub seed_base: u64,
    /// Set at SIGTERM/Ctrl-C: new requests get 503.
    pub draining: AtomicBool,
    pub disaggregated: bool,
    /// `--metrics-key`: `/metrics` then needs `Authorization: Bearer KEY`.
    pub metrics_key: Option<String>,
}

pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_tenant,
        ));
    Router::new()
        .merge(api)
        .route("/metrics", get(metrics))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .fallback(not_found)
        .with_state(state)
}

async fn models(
    State(st): State<Arc<AppState>>,
    Extension(tenant): Extension<TenantId>,
) -> Response {
    Answered {
        tenant: Some(tenant),
        endpoint: "models",
        outcome: "finished",
        status: 200,
        prompt_tokens: 0,
        completion_tokens: 0,
        elapsed: Duration::ZERO,
    }
    .record(&st.metrics);
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.model_name,
            "object": "model",
            "created": st.created,
            "owned_by": "handoff",
            "max_model_len": st.window,
        }],
    }))
    .into_response()
}

async fn metrics(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Some(key) = &st.metrics_key {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if !auth::carries_key(given, key) {
            return ApiError::unauthorized("/metrics needs `Authorization: Bearer METRICS_KEY`")
                .into_response();
        }
    }
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.draining.load(Ordering::Acquire) {
        ApiError::shutting_down().into_response()
    } else {
        "ok\n".into_response()
    }
}

/// Serving: the model is loaded (the loading gate answers 503 before) and
/// the server is not draining.
async fn ready(State(st): State<Arc<AppState>>) -> Response {
    if st.draining.load(Ordering::Acquire) {
        ApiError::shutting_down().into_response()
    } else {
        "ready\n".into_response()
    }
}

async fn not_found() -> Response {
    ApiError::new(
        404,
        "no such route: see /v1/models, /v1/completions, /v1/chat/completions",
    )
    .into_response()
}

async fn completions(
    State(st): State<Arc<AppState>>,
    Extension(tenant): Extension<TenantId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, tenant, Api::Completions, body).await
}

async fn chat(
    State(st): State<Arc<AppState>>,
    Extension(tenant): Extension<TenantId>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    handle(st, tenant, Api::Chat, body).await
}

/// One request, in its own span: parse, check, admit, answer.
async fn handle(
    st: Arc<AppState>,
    tenant: TenantId,
    api: Api,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let id = st.next_id.fetch_add(1, Ordering::Relaxed);
    let span = info_span!("request", id, tenant = tenant.0, endpoint = api.label());
    let started = Instant::now();
    async move {
        match run(&st, tenant, api, id, body).await {
            Ok(r) => r,
            // Refused before admission (or at it): nothing was generated.
            Err(e) => {
                Answered {
                    tenant: Some(tenant),
                    endpoint: api.label(),
                    outcome: e.outcome,
                    status: e.status,
                    prompt_tokens: 0,
                    completion_tokens: 0,
                    elapsed: started.elapsed(),
                }
                .record(&st.metrics);
                e.into_response()
            }
        }
    }
    .instrument(span)
    .await
}

/// A seed for a request that names none: distinct per request.
fn default_seed(base: u64, id: u64) -> u64 {
    // splitmix64's finalizer.
    let mut z = base ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

async fn run(
    st: &Arc<AppState>,
    tenant: TenantId,
    api: Api,
    id: u64,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    if st.draining.load(Ordering::Acquire) {
        return Err(ApiError::shutting_down());
    }
    let body = body.map_err(|e| ApiError::new(e.status().as_u16(), e.body_text()))?;
    let seed = default_seed(st.seed_base, id);
    let codec = &*st.codec;
    let (prompt, mut ask) = match api {
        Api::Completions => {
            let b: wire::CompletionBody = wire::parse(&body)?;
            let mut g = wire::check_common(&b.common, &st.model_name, seed)?;
            wire::completion_logprobs(&b, &mut g)?;
            (wire::completion_prompt(&b, codec)?, g)
        }
        Api::Chat => {
            let b: wire::ChatBody = wire::parse(&body)?;
            let mut g = wire::check_common(&b.common, &st.model_name, seed)?;
            wire::chat_max_tokens(&b, &mut g)?;
            wire::chat_logprobs(&b, &mut g)?;
            let msgs = wire::chat_messages(&b)?;
            // The chat template is the model's code: it renders on a
            // blocking thread, under its fuel, output cap and deadline, so
            // a hostile one costs this request alone.
            let codec = st.codec.clone();
            let ids = tokio::task::spawn_blocking(move || codec.render_chat(&msgs))
                .await
                .map_err(|e| {
                    ApiError::new(500, format!("the chat template's task failed: {e}"))
                })??;
            (ids, g)
        }
    };
    if !codec.has_text() && !ask.stops.is_empty() {
        return Err(ApiError::bad_param(
            "stop",
            "this model is served without a tokenizer: stop strings cannot be matched",
        ));
    }
    // OpenAI's defaults: 16 tokens for completions; a chat may use the
    // rest of the window.
    let max_new = ask.max_tokens.unwrap_or(match api {
        Api::Completions => 16,
        Api::Chat => st.window.saturating_sub(prompt.len()).max(1),
    });
    ask.sampling.stop_ids = codec.stop_ids();
    let logprobs = ask
        .sampling
        .logprobs
        .map(|_| LogprobJson::new(api, st.codec.clone()));
    let detok = Detok::new(codec, ask.stops)?;
    let req = Request::new(RequestId(id), tenant, prompt, max_new).with_sampling(ask.sampling);
    let g = generation::start(st, req, api.label(), api.prompt_param()).await?;
    let reply = Reply::new(
        api,
        id,
        st.created,
        &st.model_name,
        ask.return_token_ids || !codec.has_text(),
    );
    Ok(if ask.stream {
        sse::respond(g, reply, detok, ask.include_usage, logprobs).await
    } else {
        collect(g, reply, detok, logprobs).await
    })
}

/// A non-streaming answer: the whole text once generation ended, or the
/// error that ended it (never a 200 with partial text); with each token's
/// log-probabilities when asked (`lp`).
async fn collect(
    mut g: Generation,
    reply: Reply,
    mut detok: Detok,
    mut lp: Option<LogprobJson>,
) -> Response {
    let mut text = String::new();
    let mut entries = Vec::new();
    let mut keep = |e: TokenLogprobs, lp: &Option<LogprobJson>| {
        if lp.as_ref().is_some_and(|l| l.shown(e.token)) {
            entries.push(e);
        }
    };
    let finish = loop {
        match g.next().await {
            Event::Token(t) => {
                let (piece, stopped) = detok.token(t);
                text.push_str(&piece);
                if stopped {
                    // The stopping token's log-probabilities follow it.
                    if lp.is_some()
                        && let Event::Logprobs(e) = g.next().await
                    {
                        keep(e, &lp);
                    }
                    break "stop";
                }
            }
            Event::Logprobs(e) => keep(e, &lp),
            Event::Done(Outcome::Finished(reason)) => {
                let (piece, stopped) = detok.finish();
                text.push_str(&piece);
                break match reason {
                    _ if stopped => "stop",
                    FinishReason::Stop(_) => "stop",
                    _ => "length",
                };
            }
            Event::Done(o) => {
                let e = ApiError::from_outcome(&o, reply.api.prompt_param());
                g.answer(e.outcome, e.status);
                return e.into_response();
            }
        }
    };
    g.answer("finished", 200);
    let u = usage(g.prompt_tokens(), g.tokens);
    let logprobs = lp.as_mut().map_or(Value::Null, |l| l.value(&entries));
    Json(reply.full(&text, detok.ids(), finish, u, logprobs)).into_response()
}
