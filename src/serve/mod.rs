//! `devlock serve`: this machine's locks and GPUs, read-only over HTTP: a
//! page for a browser (`/`, [`page`]), the Prometheus text format
//! (`/metrics`, [`metrics`]) and `devlock status --json`'s document
//! (`/status.json`), all three from one [`snapshot`] of the status model,
//! served by a small HTTP/1.1 server of its own ([`http`], [`conns`]).
//!
//! It shows what `devlock status` shows the user it runs as, less every
//! command line, and it changes nothing: no lock is taken and no file is
//! written, except the registrations of dead waiters that status removes
//! too. None of it is reached from a run under a lock (`devlock R --
//! CMD`): the server, the page and the metrics are code of this module
//! alone, and it adds no dependency to the crate.

mod conns;
mod http;
mod metrics;
mod page;
mod snapshot;

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;

use crate::cli::ServeArgs;
use crate::exit::ExitCode;
use crate::messages::serve as words;
use http::{Request, Response};
use snapshot::Snapshots;

/// Listens on `--listen` and answers until the process is stopped.
pub(crate) fn run(args: &ServeArgs, dir: &Path, probe_timeout: Duration) -> Result<ExitCode> {
    let listener = TcpListener::bind(args.listen)
        .map_err(|err| crate::error::other(words::cannot_listen(args.listen, &err)))?;
    let address = listener.local_addr()?;
    let host = nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "this machine".to_owned());
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
    let snapshots = Snapshots::new(dir, probe_timeout);
    eprintln!("{}", words::serving(address));
    let failed = conns::serve(
        listener,
        Arc::new(move |request: &Request| answer(&snapshots, &host, request)),
    );
    Err(crate::error::other(words::stopped(&failed)))
}

/// The answer to one request.
fn answer(snapshots: &Snapshots, host: &str, request: &Request) -> Response {
    let render: fn(&snapshot::Snapshot, &str) -> Result<Response> = match request.path.as_str() {
        "/" | "/index.html" => |s, host| {
            Ok(
                Response::new(200, page::CONTENT_TYPE, page::render(s, host))
                    .with("Content-Security-Policy", page::CONTENT_SECURITY_POLICY)
                    .with("Referrer-Policy", "no-referrer"),
            )
        },
        "/metrics" => |s, _| {
            Ok(Response::new(
                200,
                metrics::CONTENT_TYPE,
                metrics::render(s),
            ))
        },
        "/status.json" => |s, _| Ok(Response::new(200, "application/json", s.json()?)),
        path => return Response::text(404, words::no_such_page(path)),
    };
    match snapshots.get().and_then(|s| render(&s, host)) {
        Ok(response) => response,
        Err(err) => Response::text(500, words::no_status(&err)),
    }
}

/// A lock's state as the page and `/metrics` both name it (one spelling,
/// so that a label on the page matches the metric's).
fn state_name(state: crate::view::State) -> &'static str {
    use crate::view::State;
    match state {
        State::Free => "free",
        State::Held => "held",
        State::Shared => "shared",
        State::Unknown => "unknown",
    }
}
