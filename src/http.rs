//! Mapping of errors to HTTP status codes, for hosts that serve over HTTP.

/// Every error type of this crate says which HTTP status a server should
/// answer with: 4xx when the client must change its request, 429/503 when it
/// may retry later, 500 when the engine failed (the request is failed and no
/// output is produced).
pub trait HttpStatus {
    /// The HTTP status code for this error.
    fn http_status(&self) -> u16;

    /// True when the client caused the error (4xx other than 429).
    fn is_client_error(&self) -> bool {
        let s = self.http_status();
        (400..500).contains(&s) && s != 429
    }
}
