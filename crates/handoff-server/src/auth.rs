//! Tenants from API keys.
//!
//! `--api-keys FILE` holds one `KEY TENANT_ID` pair per line (blank lines
//! and lines starting with `#` are skipped). A request's tenant is looked
//! up from its `Authorization: Bearer KEY` header on the server; nothing
//! in the request body can name a tenant. A missing or unknown key is a
//! 401. Without the flag the server is open (loopback only, see
//! `args.rs`) and every request is tenant 0.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use handoff::TenantId;

use crate::access::Answered;
use crate::errors::ApiError;
use crate::metrics::endpoint_label;
use crate::routes::AppState;

/// How requests are mapped to tenants.
#[derive(Debug)]
pub enum Auth {
    /// No keys: every request is this tenant.
    Open(TenantId),
    Keys(HashMap<String, TenantId>),
}

impl Auth {
    /// Reads a key file; a malformed line is an error naming it.
    pub fn from_file(path: &Path) -> Result<Auth, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("--api-keys {}: {e}", path.display()))?;
        let mut keys = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let at = || format!("{}:{}", path.display(), n + 1);
            let mut parts = line.split_whitespace();
            let (Some(key), Some(tenant), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format!("{}: expected `KEY TENANT_ID`", at()));
            };
            let tenant: u32 = tenant
                .parse()
                .map_err(|e| format!("{}: tenant id {tenant:?}: {e}", at()))?;
            if keys.insert(key.to_string(), TenantId(tenant)).is_some() {
                return Err(format!("{}: this key is listed twice", at()));
            }
        }
        if keys.is_empty() {
            return Err(format!(
                "--api-keys {}: no keys in the file: every request would be refused",
                path.display()
            ));
        }
        Ok(Auth::Keys(keys))
    }

    /// The tenant behind an `Authorization` header value.
    pub fn tenant(&self, authorization: Option<&str>) -> Result<TenantId, ApiError> {
        match self {
            Auth::Open(t) => Ok(*t),
            Auth::Keys(keys) => {
                let Some(value) = authorization else {
                    return Err(ApiError::unauthorized(
                        "no API key: send `Authorization: Bearer KEY`",
                    ));
                };
                let key = bearer(value).ok_or_else(|| {
                    ApiError::unauthorized("the Authorization header is not `Bearer KEY`")
                })?;
                keys.get(key)
                    .copied()
                    .ok_or_else(|| ApiError::unauthorized("unknown API key"))
            }
        }
    }
}

/// The key of an `Authorization: Bearer KEY` value.
fn bearer(value: &str) -> Option<&str> {
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
}

/// Whether an `Authorization` header value carries `key` (`--metrics-key`):
/// compared in time that does not depend on where they differ.
pub fn carries_key(authorization: Option<&str>, key: &str) -> bool {
    let Some(given) = authorization.and_then(bearer) else {
        return false;
    };
    given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

/// Middleware: puts the request's [`TenantId`] in its extensions, or
/// answers 401.
pub async fn require_tenant(
    State(state): State<Arc<AppState>>,
    mut req: Request,
    next: Next,
) -> Response {
    let header = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match state.auth.tenant(header) {
        Ok(tenant) => {
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        Err(e) => {
            Answered {
                tenant: None,
                endpoint: endpoint_label(req.uri().path()),
                outcome: e.outcome,
                status: e.status,
                prompt_tokens: 0,
                completion_tokens: 0,
                elapsed: Duration::ZERO,
            }
            .record(&state.metrics);
            e.into_response()
        }
    }
}
