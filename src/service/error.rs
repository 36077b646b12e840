use thiserror::Error;

/// Why a [`Service`](super::Service) could not start or stop cleanly.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServiceError {
    /// The operating system refused a thread for the service. Nothing was
    /// started and the server was dropped: a request submitted to it before
    /// `spawn` ended as at its shutdown (503), none was lost. Check the
    /// process's thread limits.
    #[error("could not start the service thread: {0}; check the process's thread limits")]
    Spawn(#[from] std::io::Error),
    /// The service thread panicked. Its server is lost: every request it
    /// held ended with a 503 when the server was dropped during the unwind.
    /// A bug in handoff, or in a host's own `Backend` or `DecodeLink`
    /// implementation; the panic message says where.
    #[error(
        "the service thread panicked: {0}; its requests ended with 503 (a bug: please report it)"
    )]
    Panicked(String),
}

impl crate::http::HttpStatus for ServiceError {
    fn http_status(&self) -> u16 {
        500
    }
}
