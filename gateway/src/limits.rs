//! The open-file limit: every websocket is a file descriptor.
//!
//! Many systems start processes with a soft limit of 1 024 open files and a far
//! higher hard limit; left alone, such a node would refuse its 1 000th client.
//! Raising the soft limit to the hard one is what an unprivileged process may do.

use tracing::{info, warn};

/// Descriptors kept back from websockets: listeners, the store, node-to-node
/// and application-server HTTP connections.
const RESERVED: u64 = 256;

/// Raise the soft open-file limit to the hard limit; returns the limit in force.
pub fn raise_open_files() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read or write the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        warn!("cannot read the open-file limit; assuming 1024");
        return 1024;
    }
    let before = limit.rlim_cur;
    if limit.rlim_cur < limit.rlim_max {
        limit.rlim_cur = limit.rlim_max;
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } == 0 {
            info!(
                from = before,
                to = limit.rlim_cur,
                "raised the open-file limit"
            );
            return limit.rlim_cur;
        }
        warn!(limit = before, "cannot raise the open-file limit");
        return before;
    }
    before
}

/// The default `--max-connections`: what the open-file limit leaves after the
/// reserve.
pub fn default_max_connections(open_files: u64) -> usize {
    usize::try_from(open_files.saturating_sub(RESERVED).max(1)).unwrap_or(usize::MAX)
}
