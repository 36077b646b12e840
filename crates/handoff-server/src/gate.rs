//! Serving while the model loads: the port is bound first, and until the
//! model is loaded every request meets the loading gate. `/health` answers
//! 200 (the process is up), `/ready` 503 (not serving yet), and every other
//! route 503 with `Retry-After`. Once the app's router is opened, each
//! request goes to it, and `/ready` answers 200 there.

use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use tower::ServiceExt;

use crate::errors::ApiError;

/// The router requests reach: the loading gate until [`Gate::open`].
#[derive(Clone, Default)]
pub struct Gate {
    app: Arc<OnceLock<Router>>,
}

impl Gate {
    /// Sends every later request to `app` (once; a second call is ignored).
    pub fn open(&self, app: Router) {
        let _ = self.app.set(app);
    }

    /// The router to serve: each request is passed to the app once open.
    pub fn router(&self) -> Router {
        let gate = self.clone();
        Router::new().fallback(move |req: Request| {
            let gate = gate.clone();
            async move {
                match gate.app.get() {
                    Some(app) => match app.clone().oneshot(req).await {
                        Ok(r) => r,
                        Err(never) => match never {},
                    },
                    None => loading(req.uri().path()),
                }
            }
        })
    }
}

/// The answer while the model loads.
fn loading(path: &str) -> Response {
    match path {
        "/health" => "ok\n".into_response(),
        _ => ApiError::loading().into_response(),
    }
}
