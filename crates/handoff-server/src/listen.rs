//! The HTTP/1.1 listener, with the bounds a hostile client meets:
//!
//! - **header-read timeout**: hyper's own (`http1::Builder::
//!   header_read_timeout`, on tokio's timer). The clock starts when the
//!   connection starts waiting for a request's head, so a connection that
//!   sends part of a head, or none, or sits idle between keep-alive
//!   requests, is closed when it runs out;
//! - **request-body idle timeout**: tower-http's `RequestBodyTimeout`,
//!   the longest pause between two pieces of a body (the request then
//!   fails with 408/400 as axum's body extractor reports it);
//! - **connection cap**: at most `max_connections` connections are open;
//!   the next one is accepted when one closes (it waits in the kernel's
//!   backlog meanwhile), so descriptors never run out under a flood and
//!   the process keeps answering as the timeouts free slots.
//!
//! At shutdown the listener closes, open connections are told to finish
//! the request in flight and close (hyper-util's graceful shutdown), and
//! [`serve`] returns once all of them have.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower_http::timeout::RequestBodyTimeout;
use tracing::{debug, warn};

/// The bounds of [`serve`].
#[derive(Clone, Copy, Debug)]
pub struct ConnLimits {
    pub header_timeout: Duration,
    pub body_idle_timeout: Duration,
    pub max_connections: usize,
}

/// Serves `app` on `listener` until `shutdown` completes, then drains the
/// open connections (see the module documentation).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    shutdown: impl std::future::Future<Output = ()>,
) {
    let service = TowerToHyperService::new(RequestBodyTimeout::new(app, limits.body_idle_timeout));
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    tokio::pin!(shutdown);
    loop {
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or a connection reset before it
                    // was accepted: wait a moment rather than spin.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let conn = http.serve_connection(TokioIo::new(stream), service.clone());
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                debug!(error = %e, "connection closed with an error");
            }
            drop(slot);
        });
    }
    // No new connections; the open ones finish their request and close.
    drop(listener);
    graceful.shutdown().await;
}
