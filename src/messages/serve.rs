//! `devlock serve`'s sentences: its start, what stops it from listening, and
//! the bodies of the HTTP answers that are not a page (errors and refusals).

use std::net::SocketAddr;

/// The line it says once it listens (the tests read the address in it).
pub(crate) fn serving(addr: SocketAddr) -> String {
    format!(
        "devlock: serving http://{addr}/ (the status page; /metrics for Prometheus, \
             /status.json for scripts)"
    )
}

/// Why it cannot listen on `addr`, with the fix where there is one.
pub(crate) fn cannot_listen(addr: SocketAddr, err: &std::io::Error) -> String {
    let hint = match err.kind() {
        std::io::ErrorKind::AddrInUse => {
            "; something else listens there already (another devlock serve?): choose \
                 another with --listen"
        }
        std::io::ErrorKind::PermissionDenied if addr.port() < 1024 => {
            "; a port below 1024 needs root or CAP_NET_BIND_SERVICE"
        }
        std::io::ErrorKind::AddrNotAvailable => "; no interface of this machine has it",
        _ => "",
    };
    format!("cannot listen on {addr}: {err}{hint}")
}

/// `devlock serve --etcd ...`.
#[cfg(feature = "etcd")]
pub(crate) fn not_for_etcd() -> &'static str {
    "devlock serve shows this machine's lock directory, not locks in etcd: run it \
         without --etcd and DEVLOCK_ETCD"
}

/// 404: a path it does not serve.
pub(crate) fn no_such_page(path: &str) -> String {
    format!(
        "devlock serve has no page {}: it serves /, /metrics and /status.json\n",
        crate::show::sanitize(path)
    )
}

/// 405: a method other than GET and HEAD.
pub(crate) fn read_only(method: &str) -> String {
    format!(
        "devlock serve is read-only: it answers GET and HEAD, not {}\n",
        crate::show::sanitize(method)
    )
}

/// 400 and 431: a request it will not read, and why.
pub(crate) fn bad_request(why: &str) -> String {
    format!("devlock serve cannot read this request: {why}\n")
}

/// 403: a Host that is neither localhost nor an IP address, while it
/// listens on a loopback address.
pub(crate) fn foreign_host(host: &str) -> String {
    format!(
        "devlock serve on a loopback address answers requests for localhost or an IP \
             address, not for {} (a page elsewhere must not read it through DNS rebinding); \
             a reverse proxy in front should send Host: 127.0.0.1:PORT, or listen on another \
             address with --listen\n",
        crate::show::sanitize(host)
    )
}

/// 503: every connection it answers at once is taken.
pub(crate) fn too_busy(limit: usize) -> String {
    format!("devlock serve is answering {limit} requests already; try again in a moment\n")
}

/// What stopped the server once it listened (poll failed, no thread
/// could start).
pub(crate) fn stopped(err: &std::io::Error) -> String {
    format!("devlock serve stopped: {}", crate::proc::os_text(err))
}

/// 500: the status could not be read (the scratch directory is unsafe,
/// /proc cannot be read).
pub(crate) fn no_status(err: &anyhow::Error) -> String {
    format!("devlock: {}\n", crate::show::clean(&format!("{err:#}")))
}
