//! Every sentence devlock says to people about locks, in one place, for
//! both backends: who holds a lock and who waits (`ns-train (pid 4242,
//! alice), held 5m03s`), what stands in the way of a request, and the busy,
//! timeout and waiting lines built from them. Built from the status model's
//! views (or, for etcd, from plain values); nothing here looks at a file.

use crate::request::Request;
use crate::status::model::{Effect, Holder, HolderSource, ResourceView, WaiterSource, WaiterView};
use crate::text::{sanitize, short_duration};
use std::time::Duration;

/// `gpu:0 is busy: held by train (pid 4242, alice) for 5m03s`, naming
/// whoever is in the way in `view`: the holders, and those already in line
/// (who would go first), such as a request for the whole group queued
/// ahead.
pub(crate) fn busy(request: &Request, view: &ResourceView) -> String {
    let who = busy_phrase(view);
    let what = match &request.via {
        Some(member) => format!("{member} is busy, through its group {}", request.name),
        None => format!("{} is busy", request.name),
    };
    format!("{what}{who}")
}

/// `gpu is busy, through its member gpu:0: held by flock (pid 4242, alice)`:
/// a whole group's request that a holder of one member's file (plain
/// flock) keeps out.
pub(crate) fn busy_through_member(
    group: &crate::Resource,
    member: &Request,
    view: &ResourceView,
) -> String {
    format!(
        "{group} is busy, through its member {}{}",
        member.name,
        busy_phrase(view)
    )
}

/// `all of gpu:0, gpu:1 are busy: gpu:0 held by ...; gpu:1 held by ...`,
/// from each candidate's label and view.
pub(crate) fn all_busy(names: &[String], each: &[(String, ResourceView)]) -> String {
    let why: Vec<String> = each
        .iter()
        .map(|(label, view)| {
            let why = in_the_way(view, &view.waiters);
            format!("{label} {}", why.trim_start_matches(": "))
                .trim_end()
                .to_owned()
        })
        .collect();
    format!("all of {} are busy: {}", names.join(", "), why.join("; "))
}

/// The library's take of nothing.
pub(crate) fn no_resource() -> anyhow::Error {
    crate::error::usage("missing RESOURCE: name at least one resource to lock")
}

/// `devlock: timed out after 10m waiting for gpu: held by ...` (with the
/// waiter's step where the line stays).
pub(crate) fn timed_out(
    waited: Duration,
    label: &str,
    in_the_way: &str,
    step: Option<&str>,
) -> String {
    let waited = humantime::format_duration(waited);
    let whose = step
        .map(|s| format!(" ({})", sanitize(s)))
        .unwrap_or_default();
    format!("devlock: timed out after {waited} waiting for {label}{in_the_way}{whose}\n")
}

/// `devlock: got gpu after 4s (train-b)`
pub(crate) fn got(label: &str, waited: Duration, step: &str) -> String {
    format!(
        "devlock: got {label} after {} ({})\n",
        short_duration(waited),
        sanitize(step)
    )
}

/// `ns-train (pid 4242, alice)`, `train (pid 4242, alice, inherited: its
/// devlock is gone) via gpu:0`.
pub(crate) fn holder_label(h: &Holder) -> String {
    let pid = h
        .pid
        .map_or("pid unknown".to_owned(), |p| format!("pid {p}"));
    let mut user = h
        .user
        .as_deref()
        .map(|u| format!(", {}", sanitize(u)))
        .unwrap_or_default();
    if h.stopped {
        user.push_str(", stopped");
    }
    if let Some(container) = &h.container {
        user.push_str(&format!(", in {}", sanitize(container)));
    }
    let inherited = if h.source == HolderSource::Inherited {
        ", inherited: its devlock is gone"
    } else {
        ""
    };
    let label = match (&h.step, &h.command) {
        (Some(step), _) => format!("{} ({pid}{user}{inherited})", sanitize(step)),
        (None, Some(cmd)) if h.source == HolderSource::NoRecord => {
            format!("{pid} ({}{user}, no record)", sanitize(&cmd.join(" ")))
        }
        _ => format!("an unknown holder ({pid}{user})"),
    };
    match &h.via {
        Some(via) => format!("{label} via {}", sanitize(via)),
        None => label,
    }
}

/// `block ended 3m ago, still 19.8 GiB on gpu:0`: a library hold kept past
/// its block's end because its process still uses the device.
pub(crate) fn kept_phrase(h: &Holder) -> Option<String> {
    let ago = short_duration(Duration::from_millis(h.kept_for_ms?));
    let still = match (h.kept_mib, h.kept_gpu) {
        (Some(mib), Some(gpu)) => format!(", still {} on gpu:{gpu}", crate::gpu::memory::size(mib)),
        (None, Some(gpu)) => format!(", still on gpu:{gpu}"),
        _ => ", still on its GPU".to_owned(),
    };
    Some(format!("block ended {ago} ago{still}"))
}

/// What the library says once when a block's end keeps its hold.
pub(crate) fn kept_after_block(names: &str, mib: Option<u64>, gpu: u32) -> String {
    let uses = match mib {
        Some(mib) => format!("{} on gpu:{gpu}", crate::gpu::memory::size(mib)),
        None => format!("memory on gpu:{gpu}"),
    };
    format!(
        "{names} is kept after the block's end: this process (or one it started) still uses \
         {uses}, and the lock goes when the driver no longer lists it (free it with \
         `del model; gc.collect(); torch.cuda.empty_cache()`, or end the process; \
         release=\"block\" lets go at the block's end)"
    )
}

pub(crate) fn held_for(h: &Holder) -> Option<String> {
    h.held_for_ms
        .map(|ms| short_duration(Duration::from_millis(ms)))
}

/// `ns-train (pid 4242, alice), held 5m03s`
pub(crate) fn holder_words(h: &Holder) -> String {
    let held = held_for(h)
        .map(|d| format!(", held {d}"))
        .unwrap_or_default();
    format!("{}{held}", holder_label(h))
}

/// The first holder's words, and how many more share the lock.
pub(crate) fn holders_words(view: &ResourceView) -> String {
    let Some(first) = view.holders.first() else {
        return String::new();
    };
    match view.holders.len() {
        1 => holder_words(first),
        n => format!("{} and {} more", holder_words(first), n - 1),
    }
}

/// `pid 77, bob`, or what stands for a process this user cannot see.
pub(crate) fn who(pid: Option<u32>, user: Option<&str>) -> String {
    match (pid, user) {
        (Some(pid), Some(user)) => format!("pid {pid}, {}", sanitize(user)),
        (Some(pid), None) => format!("pid {pid}"),
        _ => crate::proc::locks::unseen_owner().to_owned(),
    }
}

/// `eval (pid 77, bob)`, `pid 77 (bob, no record)` for a process blocked
/// on the lock without a registration (util-linux flock), or `a place held
/// by pid 77, mallory, not a registered devlock` for a place in line that
/// no devlock registered; `, stopped` when it is.
pub(crate) fn waiter_label(w: &WaiterView) -> String {
    let stopped = if w.stopped { ", stopped" } else { "" };
    if w.source == WaiterSource::Unregistered {
        return format!(
            "a place held by {}{stopped}, not a registered devlock",
            who(w.pid, w.user.as_deref())
        );
    }
    let pid = w
        .pid
        .map_or("pid unknown".to_owned(), |p| format!("pid {p}"));
    let user = w
        .user
        .as_deref()
        .map(|u| format!(", {}", sanitize(u)))
        .unwrap_or_default();
    match &w.step {
        Some(step) => format!("{} ({pid}{user}{stopped})", sanitize(step)),
        None => format!(
            "{pid} ({}{stopped}, no record)",
            user.trim_start_matches(", ")
        ),
    }
}

/// The first waiter ahead, and how many more.
pub(crate) fn waiters_words(first: &WaiterView, ahead: &[WaiterView]) -> String {
    match ahead.len() {
        0 | 1 => waiter_label(first),
        n => format!("{} and {} more", waiter_label(first), n - 1),
    }
}

/// What stands in the way of one lock, in parts: the holders (`held by
/// ns-train (pid 4242, alice) for 5m03s`), the devlocks and flock callers
/// `ahead` in line (`eval (pid 77, bob) waits in line first`), and what is
/// not devlock's: places in line among `ahead` that nobody registered, and
/// locks on the queue file that hold the line up.
pub(crate) fn obstacles(
    view: &ResourceView,
    ahead: &[WaiterView],
) -> (Option<String>, Vec<String>) {
    let held = view.holders.first().map(|h| {
        let held = match kept_phrase(h) {
            Some(kept) => format!(": {kept}"),
            None => held_for(h).map(|d| format!(" for {d}")).unwrap_or_default(),
        };
        let note = h
            .note
            .as_deref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default();
        let more = match view.holders.len() {
            1 => String::new(),
            n => format!(" and by {} more", n - 1),
        };
        format!("held by {}{held}{note}{more}", holder_label(h))
    });
    let mut line = Vec::new();
    let known: Vec<WaiterView> = ahead
        .iter()
        .filter(|w| w.source != WaiterSource::Unregistered)
        .cloned()
        .collect();
    if let Some(first) = known.first() {
        let waits = if known.len() > 1 { "wait" } else { "waits" };
        line.push(format!(
            "{} {waits} in line first",
            waiters_words(first, &known)
        ));
    }
    for w in ahead
        .iter()
        .filter(|w| w.source == WaiterSource::Unregistered)
    {
        let stopped = if w.stopped { ", stopped" } else { "" };
        line.push(format!(
            "a place in line held by {}{stopped}, not a registered devlock",
            who(w.pid, w.user.as_deref())
        ));
    }
    for l in view
        .foreign_locks
        .iter()
        .filter(|l| l.effect != Effect::None)
    {
        line.push(format!(
            "a lock that is not devlock's on bytes {} of {} ({}) {}",
            l.range,
            sanitize(&l.path),
            who(l.pid, l.user.as_deref()),
            l.effect.words()
        ));
    }
    (held, line)
}

/// `: held by ns-train (pid 4242, alice) for 5m03s`, `; eval (pid 77, bob)
/// waits in line first` when someone is ahead in line, what else holds the
/// line up (a place or a lock that is not devlock's), or nothing when the
/// way is clear.
pub(crate) fn in_the_way(view: &ResourceView, ahead: &[WaiterView]) -> String {
    let (held, line) = obstacles(view, ahead);
    let parts: Vec<String> = held.into_iter().chain(line).collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(": {}", parts.join("; "))
    }
}

/// For `-n`, where everyone in line is ahead: [`in_the_way`], or when
/// nobody holds the lock but the line is not empty, `: 2 already waiting in
/// line (...)` with who they are.
pub(crate) fn busy_phrase(view: &ResourceView) -> String {
    if !view.holders.is_empty() || view.waiters.is_empty() {
        return in_the_way(view, &view.waiters);
    }
    let (_, line) = obstacles(view, &view.waiters);
    let who = if line.is_empty() {
        String::new()
    } else {
        format!(" ({})", line.join("; "))
    };
    format!(": {} already waiting in line{who}", view.waiters.len())
}

/// The etcd backend's sentences (`--etcd`): the same kinds of lines, about
/// keys in etcd rather than files.
#[cfg(feature = "etcd")]
pub(crate) mod etcd {
    use std::path::Path;
    use std::time::Duration;

    use crate::text::{human_duration, sanitize, short_duration};

    /// `train (pid 12 on host-a, alice) for 3s`
    pub(crate) fn holder(step: &str, pid: u32, host: &str, user: &str, held: Duration) -> String {
        format!(
            "{} (pid {pid} on {}, {}) for {}",
            sanitize(step),
            sanitize(host),
            sanitize(user),
            short_duration(held)
        )
    }

    /// Who holds a key in a resource's line that devlock did not write:
    /// `etcdctl lock` (etcd's `concurrency.Mutex`) puts exactly such keys.
    pub(crate) const FOREIGN_CLIENT: &str = "etcdctl lock or another client";

    /// A key in a resource's line that devlock did not write, with what
    /// etcd says of it: its key and the revision it joined the line at.
    pub(crate) fn foreign_key(key: &str, revision: i64) -> String {
        format!(
            "{FOREIGN_CLIENT} (key {}, in line since revision {revision})",
            sanitize(key)
        )
    }

    /// Why `--mem` is refused with `--etcd`.
    pub(crate) fn mem_refused() -> String {
        "--mem is not available with --etcd: a budget is admitted by measuring the GPU's \
         memory on the machine that has it, and a job on another machine can neither be \
         measured nor use that memory; take gpu:N whole with --etcd, or use --mem without \
         --etcd on the GPU's machine"
            .to_owned()
    }

    /// Why `--require-idle` is refused with `--etcd`.
    pub(crate) fn require_idle_refused() -> String {
        "--require-idle is not available with --etcd: it checks the GPU of this machine for \
         work outside the lock directory's gate, which etcd's locks are not"
            .to_owned()
    }

    /// `gpu is busy: held by ...`
    pub(crate) fn busy(name: &str, who: &str) -> String {
        format!("{name} is busy: held by {who}")
    }

    /// `devlock: waiting for gpu: held by ...; 2 ahead in line (waiting
    /// 1m00s) (train)`; `waited` after the first line.
    pub(crate) fn waiting(
        name: &str,
        who: &str,
        ahead: usize,
        waited: Option<Duration>,
        step: &str,
    ) -> String {
        let waited = waited
            .map(|w| format!(" (waiting {})", short_duration(w)))
            .unwrap_or_default();
        format!(
            "devlock: waiting for {name}: held by {who}; {ahead} ahead in line{waited} ({})",
            sanitize(step)
        )
    }

    /// `devlock: got gpu after 1.5s (train)`
    pub(crate) fn got(name: &str, waited: Duration, step: &str) -> String {
        format!(
            "devlock: got {name} after {} ({})",
            human_duration(waited),
            sanitize(step)
        )
    }

    // TLS: the files, checked before connecting.

    pub(crate) fn cert_and_key_go_together() -> String {
        "--etcd-cert and --etcd-key go together: a client certificate needs its key".to_owned()
    }

    pub(crate) fn tls_needs_https(url: &str) -> String {
        format!(
            "--etcd-ca, --etcd-cert and --etcd-key are for https:// endpoints, and {url} is not one"
        )
    }

    pub(crate) fn mixed_schemes() -> String {
        "the etcd endpoints mix http:// and https://; one cluster speaks one of them".to_owned()
    }

    pub(crate) fn cannot_read(path: &Path, err: &std::io::Error) -> String {
        format!(
            "cannot read {}: {}",
            crate::text::show_path(path),
            crate::proc::os_text(err)
        )
    }

    pub(crate) fn not_pem(path: &Path, what: &str, why: &str) -> String {
        format!(
            "{} holds no PEM {what} devlock can read: {why}",
            crate::text::show_path(path)
        )
    }

    pub(crate) fn no_certificate(path: &Path) -> String {
        format!(
            "{} holds no certificate (expected PEM, -----BEGIN CERTIFICATE-----)",
            crate::text::show_path(path)
        )
    }

    pub(crate) fn bad_certificate(path: &Path, why: &str) -> String {
        format!(
            "{} holds a certificate devlock cannot use: {why}",
            crate::text::show_path(path)
        )
    }

    pub(crate) fn client_cert_expired(path: &Path, not_after: &str) -> String {
        format!(
            "the client certificate {} expired on {not_after}",
            crate::text::show_path(path)
        )
    }

    pub(crate) fn client_cert_not_yet_valid(path: &Path, not_before: &str) -> String {
        format!(
            "the client certificate {} is not valid before {not_before}",
            crate::text::show_path(path)
        )
    }

    pub(crate) fn key_does_not_match(key: &Path, cert: &Path) -> String {
        format!(
            "the key {} does not match the certificate {}",
            crate::text::show_path(key),
            crate::text::show_path(cert)
        )
    }

    pub(crate) fn unusable_key(key: &Path, why: &str) -> String {
        format!(
            "the key {} cannot be used: {why}",
            crate::text::show_path(key)
        )
    }

    /// ssh's refusal, in devlock's words.
    pub(crate) fn key_too_open(key: &Path, mode: u32) -> String {
        format!(
            "the private key {k} can be read by others (mode {mode:04o}); like ssh, devlock \
             refuses such a key (chmod 600 {k})",
            k = crate::text::show_path(key)
        )
    }

    // TLS: the handshake.

    pub(crate) fn roots_file(path: &Path) -> String {
        crate::text::show_path(path)
    }

    pub(crate) fn system_roots() -> String {
        "the system's CA certificates".to_owned()
    }

    pub(crate) fn no_system_roots() -> String {
        "no CA certificates found on this system for https:// (install them, e.g. Debian's \
         ca-certificates, or give --etcd-ca FILE)"
            .to_owned()
    }

    pub(crate) fn server_cert_rejected(url: &str, roots: &str, why: &str) -> String {
        format!("the certificate of etcd at {url} does not verify against {roots}: {why}")
    }

    pub(crate) fn not_tls(url: &str) -> String {
        format!("{url} does not answer in TLS (is it an http:// endpoint?)")
    }

    pub(crate) fn wants_tls(url: &str) -> String {
        format!(
            "{url} answers in TLS: use https:// (and --etcd-ca FILE unless its certificate comes \
             from a CA this system trusts)"
        )
    }

    pub(crate) fn tls_failed(url: &str, why: &str) -> String {
        format!("TLS to etcd at {url} failed: {why}")
    }

    pub(crate) fn client_cert_refused(url: &str, cert: &Path, alert: &str) -> String {
        format!(
            "etcd at {url} refused the client certificate {} (TLS alert {alert})",
            crate::text::show_path(cert)
        )
    }

    pub(crate) fn client_cert_wanted(url: &str) -> String {
        format!(
            "etcd at {url} wants a client certificate (--etcd-cert FILE --etcd-key FILE, or \
             DEVLOCK_ETCD_CERT and DEVLOCK_ETCD_KEY)"
        )
    }

    /// The status table's last line: who devlock is to etcd.
    pub(crate) fn tls_identity(
        ca: Option<&str>,
        client: Option<(&str, &str)>,
        issuer: Option<&str>,
        not_after: Option<&str>,
        user: Option<&str>,
    ) -> String {
        let roots = ca.map_or_else(system_roots, sanitize);
        let who = match client {
            Some((subject, file)) => format!(
                "client certificate {} ({}, issued by {}, valid until {})",
                sanitize(subject),
                sanitize(file),
                sanitize(issuer.unwrap_or("?")),
                not_after.unwrap_or("?")
            ),
            None => "no client certificate".to_owned(),
        };
        let user = user.map_or_else(String::new, |u| format!(", user {}", sanitize(u)));
        format!("(TLS: server checked against {roots}; {who}{user})")
    }

    /// The status table's last line without TLS, when a user is given.
    pub(crate) fn plain_identity(user: &str) -> String {
        format!("(no TLS; user {})", sanitize(user))
    }
}

/// `gpu:0: 60 GiB of 80 GiB budgeted (eval 20 GiB, eval 20 GiB, …), 12 GiB
/// outside the gate; 30 GiB asked, 2 GiB headroom`: the figures a `--mem`
/// request is admitted or refused on, for `-n`, `-w` and the waiting line.
pub(crate) fn budget_figures(
    resource: &crate::resource::Resource,
    room: &crate::gpu::memory::Room,
    ask_mib: u64,
    headroom_mib: u64,
) -> String {
    use crate::gpu::memory::size;
    const SHOWN: usize = 4;
    let mut each: Vec<String> = room
        .budgets
        .iter()
        .take(SHOWN)
        .map(|m| {
            let over = if m.used_mib > m.budget.mem_mib {
                format!(", using {}", size(m.used_mib))
            } else {
                String::new()
            };
            format!(
                "{} {}{over}",
                sanitize(&m.budget.step),
                size(m.budget.mem_mib)
            )
        })
        .collect();
    if room.budgets.len() > SHOWN {
        each.push("…".to_owned());
    }
    let list = if each.is_empty() {
        String::new()
    } else {
        format!(" ({})", each.join(", "))
    };
    format!(
        "{resource}: {} of {} budgeted{list}, {} outside the gate; {} asked, {} headroom",
        size(room.budgeted_mib()),
        size(room.total_mib),
        size(room.used_outside_mib),
        size(ask_mib),
        size(headroom_mib),
    )
}

/// `-n` with `--mem` on a device without room: what is in the way, in figures.
pub(crate) fn no_room(figures: &str) -> String {
    format!("no room for this budget on {figures}")
}

/// `warning: gpu:0: eval uses 27 GiB of its 20 GiB budget`
pub(crate) fn over_budget(
    resource: &crate::resource::Resource,
    step: &str,
    used: u64,
    mem: u64,
) -> String {
    use crate::gpu::memory::size;
    format!(
        "devlock: warning: {resource}: {} uses {} of its {} budget (over budget: other jobs on the device may run out of memory)\n",
        sanitize(step),
        size(used),
        size(mem)
    )
}

/// `-n --mem` behind a job that is starting: `gpu:0 is busy: eval (pid
/// 4242, alice) is starting under its 20 GiB budget; the next budget waits
/// until its memory stops growing (at most --settle)`
pub(crate) fn budget_starting(resource: &crate::resource::Resource, starter: &Holder) -> String {
    let budget = starter
        .mem_mib
        .map(|m| format!(" under its {} budget", crate::gpu::memory::size(m)))
        .unwrap_or_default();
    format!(
        "{resource} is busy: {} is starting{budget}; the next budget waits until its memory \
         stops growing (at most its --settle)",
        holder_label(starter)
    )
}

/// What `--help` adds to a flag of the etcd feature in a build without it.
#[cfg(not(feature = "etcd"))]
pub(crate) const NOT_IN_THIS_BUILD: &str =
    "[not in this build: it was built without the etcd feature]";

/// How to get a devlock that has the etcd backend, from where a user is:
/// a checkout of devlock (the README's install), not the registry.
#[cfg(not(feature = "etcd"))]
pub(crate) const HOW_TO_GET_ETCD: &str = "this devlock was built without etcd support (--etcd, \
     DEVLOCK_ETCD); in a checkout of devlock, build one that has it with `cargo install --locked \
     --path . --features etcd` (needs protoc and a C compiler)";
/// `devlock serve`'s sentences: its start, what stops it from listening, and
/// the bodies of the HTTP answers that are not a page (errors and refusals).
pub(crate) mod serve {
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
            crate::text::sanitize(path)
        )
    }

    /// 405: a method other than GET and HEAD.
    pub(crate) fn read_only(method: &str) -> String {
        format!(
            "devlock serve is read-only: it answers GET and HEAD, not {}\n",
            crate::text::sanitize(method)
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
            crate::text::sanitize(host)
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
        format!("devlock: {}\n", crate::text::clean(&format!("{err:#}")))
    }
}

/// A usage error of the command line's rules, in the library's words: its
/// `Spec` fields and Python's keyword arguments (`mem=` for `--mem`,
/// `wait=False` for `-n`), which is what a library or Python user wrote.
pub(crate) fn in_library_words(err: anyhow::Error) -> anyhow::Error {
    match err.downcast::<crate::error::Error>() {
        Ok(root) => {
            let words = library_words(root.message());
            anyhow::Error::new(root.with_message(words))
        }
        Err(err) => err,
    }
}

/// The command line's flags and examples in a sentence, as keywords.
fn library_words(text: &str) -> String {
    // Whole examples first, then each flag: `name="value"` before a size,
    // `name=N` before a number, the bare name before a word of the
    // sentence, `name=` elsewhere.
    let text = text
        .replace(
            "devlock --any --count 2 gpu:0 gpu:1 gpu:2 -- ...",
            "devlock.lock(\"gpu:0\", \"gpu:1\", \"gpu:2\", any=True, count=2)",
        )
        .replace(
            "-n fails at once, -w DURATION",
            "wait=False fails at once, timeout=",
        );
    const FLAGS: [(&str, &str, Option<&str>); 11] = [
        ("--mem-headroom", "mem_headroom", None),
        ("--mem-strict", "mem_strict", Some("mem_strict=True")),
        ("--mem", "mem", None),
        ("--settle", "settle", None),
        ("--no-wait", "wait=False", Some("wait=False")),
        ("--timeout", "timeout", None),
        ("--any", "any", Some("any=True")),
        ("--count", "count", None),
        ("--slots", "slots", None),
        ("--shared", "shared", Some("shared=True")),
        ("--step", "step", None),
    ];
    // clap's wording of a value it could not read: `for '--mem <SIZE>'`.
    let mut text = text;
    for (flag, name, _) in FLAGS {
        for value in ["<SIZE>", "<DURATION>", "<N>", "<K>"] {
            text = text.replace(&format!("'{flag} {value}'"), &format!("{name}="));
        }
    }
    let mut out = String::new();
    let mut rest = text.as_str();
    'scan: while !rest.is_empty() {
        for (flag, name, switch) in FLAGS {
            let Some(after) = rest.strip_prefix(flag) else {
                continue;
            };
            if after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-') {
                continue;
            }
            let next: String = after
                .strip_prefix(' ')
                .map(|a| {
                    a.chars()
                        .take_while(|c| !c.is_whitespace() && !matches!(c, ',' | ')' | ';'))
                        .collect()
                })
                .unwrap_or_default();
            let (said, used) = match next.chars().next() {
                Some(c) if c.is_ascii_digit() && switch.is_none() => {
                    let value = if next.chars().all(|c| c.is_ascii_digit()) {
                        next.clone()
                    } else {
                        format!("\"{next}\"")
                    };
                    (format!("{name}={value}"), 1 + next.len())
                }
                Some(c) if c.is_ascii_lowercase() && !matches!(next.as_str(), "and" | "or") => {
                    (switch.unwrap_or(name).to_owned(), 0)
                }
                _ => (switch.map_or(format!("{name}="), str::to_owned), 0),
            };
            out.push_str(&said);
            rest = &after[used..];
            continue 'scan;
        }
        let c = rest.chars().next().unwrap_or_default();
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}

/// `timeout="5x" is not a duration (try 90, "90s", "10m" or "1h30m"; a
/// number is seconds)`: a duration the library was given as text.
pub(crate) fn library_duration(name: &str, text: &str) -> String {
    format!(
        "{name}={text:?} is not a duration (try 90, \"90s\", \"10m\" or \"1h30m\"; a number is seconds)"
    )
}

/// A name a managed directory does not declare: `GPU0 is not one of the
/// resources root declared in DIR (gpu, gpu:0, ...); did you mean gpu:0?
/// --new takes it as a new one`.
pub(crate) fn undeclared(
    name: &crate::Resource,
    dir: &str,
    declared: &[crate::Resource],
    close: Option<&crate::Resource>,
) -> String {
    let shown: Vec<&str> = declared.iter().take(12).map(|r| r.as_str()).collect();
    let more = if declared.len() > shown.len() {
        ", ..."
    } else {
        ""
    };
    let fix = match close {
        Some(close) => format!("did you mean {close}? (--new takes {name} as a new one)"),
        None => "--new takes it as a new one".to_owned(),
    };
    format!(
        "{name} is not one of the resources root declared in {} ({}{more}); {fix}",
        sanitize(dir),
        shown.join(", ")
    )
}

/// A new name close to a known one, said as its lock file is made: `GPU0
/// is a new name in DIR; did you mean gpu:0? (--new says it is meant)`.
pub(crate) fn new_name(name: &crate::Resource, dir: &str, close: &crate::Resource) -> String {
    format!(
        "{name} is a new name in {}; did you mean {close}? (--new says it is meant)",
        sanitize(dir)
    )
}

/// `devlock forget` in a directory that does not exist.
pub(crate) fn forget_nothing(dir: &str) -> String {
    format!(
        "{} does not exist: there is nothing to forget",
        sanitize(dir)
    )
}

/// `devlock forget` of a name with no lock file.
pub(crate) fn forget_unknown(name: &crate::Resource, dir: &str) -> String {
    format!(
        "{name} has no lock file in {}: there is nothing to forget",
        sanitize(dir)
    )
}

/// `devlock forget` by a user in a managed directory.
pub(crate) fn forget_needs_root(dir: &str) -> String {
    format!(
        "{} is managed (devlock setup declared its names): only root may forget one",
        sanitize(dir)
    )
}

/// `devlock forget` of a name in use: `gpu:0 is in use: held by train (pid
/// 4242, alice) for 5m03s; not forgotten`.
pub(crate) fn forget_in_use(name: &crate::Resource, view: Option<&ResourceView>) -> String {
    let who = view.map_or(String::new(), busy_phrase);
    format!("{name} is in use{who}; not forgotten")
}

/// Said once a hold's GPUs have computed nothing for its idle timeout.
pub(crate) fn idle_warning(
    names: &str,
    step: &str,
    idle: std::time::Duration,
    grace: std::time::Duration,
) -> String {
    format!(
        "devlock: warning: {names}: {} is idle: its GPUs computed nothing for {} (idle timeout); \
         it is stopped in {} unless they compute (or the job runs `devlock busy DUR`)\n",
        sanitize(step),
        short_duration(idle),
        short_duration(grace)
    )
}

/// A job's `--idle-timeout` over the site's: `--idle-timeout 1000h is
/// longer than this machine's idle policy, 8s (/run/lock/devlock/.idle-timeout,
/// set by the administrator): ask for 8s or less, or leave it out`.
pub(crate) fn idle_over_site(
    asked: std::time::Duration,
    site: std::time::Duration,
    policy_file: &std::path::Path,
) -> String {
    let site = humantime::format_duration(site);
    format!(
        "--idle-timeout {} is longer than this machine's idle policy, {site} ({}, set by the \
         administrator with devlock setup --idle-timeout): ask for {site} or less, or leave it out",
        humantime::format_duration(asked),
        crate::text::show_path(policy_file)
    )
}

/// The longest setup warning: it fits one line of a wide terminal.
pub(crate) const SETUP_WARNING_MOST: usize = 159;

/// The one setup warning of a run in a directory other users can break
/// (the full list is `devlock status`'s and `--json`'s): `devlock: warning:
/// /run/lock/devlock is not set up: bob can let a second holder in; fix:
/// sudo devlock setup gpu:0`. At most
/// [`SETUP_WARNING_MOST`] characters: the first of `fixes` (each a whole
/// command, most precise first) that fits with the path, else with "the
/// lock directory" for it, else a shortened line.
pub(crate) fn setup_warning(
    dir: &std::path::Path,
    owners: &[&str],
    above: bool,
    fixes: &[String],
) -> String {
    let who = match owners {
        [] | [_] => owners.first().copied().unwrap_or("another user").to_owned(),
        [first, rest @ ..] => format!("{first} and {} more", rest.len()),
    };
    let said = |dir: &str, fix: &str| {
        if above {
            format!(
                "devlock: warning: {dir}, on the way to the locks, is {who}'s or open to \
                 all; choose a --dir under root's (details: devlock status)"
            )
        } else {
            format!(
                "devlock: warning: {dir} is not set up: {who} can let a second holder in; \
                 fix: {fix}"
            )
        }
    };
    let shown = crate::text::show_path(dir);
    let unnamed = if above {
        "a directory"
    } else {
        "the lock directory"
    };
    let generic = "sudo devlock setup (devlock status names what)";
    let line = fixes
        .iter()
        .map(|fix| said(&shown, fix))
        .chain(fixes.iter().map(|fix| said(unnamed, fix)))
        .chain([said(unnamed, generic)])
        .find(|line| line.chars().count() <= SETUP_WARNING_MOST)
        .unwrap_or_else(|| {
            said(unnamed, generic)
                .chars()
                .take(SETUP_WARNING_MOST)
                .collect()
        });
    format!("{line}\n")
}

/// Said as an idle hold is stopped.
pub(crate) fn idle_stop(names: &str, step: &str, idle: std::time::Duration) -> String {
    format!(
        "devlock: --idle-timeout: {names}: stopping {}: its GPUs computed nothing for {}\n",
        sanitize(step),
        short_duration(idle)
    )
}

#[cfg(test)]
mod library_words_tests {
    use super::library_words;

    #[test]
    fn flags_become_keywords() {
        assert_eq!(
            library_words("--mem must be more than 0 (e.g. --mem 20GiB); leave it out"),
            "mem must be more than 0 (e.g. mem=\"20GiB\"); leave it out"
        );
        assert_eq!(
            library_words("--mem-headroom, --settle and --mem-strict need --mem: they shape"),
            "mem_headroom=, settle= and mem_strict=True need mem=: they shape"
        );
        assert_eq!(
            library_words("--count 3 needs at least that many resources after --any, got 2"),
            "count=3 needs at least that many resources after any=True, got 2"
        );
        assert_eq!(
            library_words("--slots takes exactly one resource, without --any or --shared"),
            "slots takes exactly one resource, without any=True or shared=True"
        );
        assert_eq!(
            library_words(
                "--count needs --any: it says how many (devlock --any --count 2 gpu:0 gpu:1 gpu:2 -- ...)"
            ),
            "count needs any=True: it says how many (devlock.lock(\"gpu:0\", \"gpu:1\", \"gpu:2\", any=True, count=2))"
        );
        assert_eq!(
            library_words("a gpu:0 name --mem-x"),
            "a gpu:0 name --mem-x"
        );
    }
}
