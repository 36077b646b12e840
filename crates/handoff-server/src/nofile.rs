//! The descriptor limit. Every open stream holds a socket, and a soft
//! limit of 1,024 (a common default) would refuse connections long before
//! the engine is busy: at start the server raises its soft limit to the
//! hard one (the most an unprivileged process may) and logs both. Keep
//! `--max-connections` under what this reports.

/// Raises `RLIMIT_NOFILE`'s soft value to its hard value; the limit in
/// force afterwards, or why it could not be read or raised.
pub fn raise() -> Result<libc::rlim_t, String> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid, exclusive pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit through a valid pointer.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error().to_string());
        }
        lim = raised;
    }
    Ok(lim.rlim_cur)
}
