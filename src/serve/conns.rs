//! The connections of `devlock serve`: one thread waits on all of them
//! (poll(2)), reads each request's head and writes each answer without
//! ever blocking on a client, and a few answerer threads compute the
//! answers ([`http`] says what is read and written).
//!
//! **Why one thread for the sockets.** Every local user can reach the
//! server, and a client that sends half a request and waits (slowloris)
//! costs a thread-per-connection server a thread for as long as it waits:
//! sixteen of them shut a server of sixteen threads. Here a waiting client
//! costs one descriptor and at most [`http::MAX_HEAD`] bytes, and the
//! threads ([`ANSWERERS`]) only ever run the handler, never wait on a
//! client. The shipped unit's `TasksMax=64` holds.
//!
//! **Deadlines.** A request's head must arrive within [`READ_TIME`] of the
//! accept (else 408), an answer must leave within [`WRITE_TIME`] (else the
//! connection is closed), and a closing connection reads what the client
//! still sends for [`LINGER`] (so closing does not reset the connection
//! under an unread answer).
//!
//! **How many.** At most [`MAX_CONNECTIONS`] connections are kept. One
//! more drops a kept one that is not being answered, in this order:
//! closing ones first, then those still sending their head, then those
//! being written to, the oldest of each first: the idle and the slow go,
//! and a client that sends its request at once is answered however many
//! connections others hold open. Only when every kept connection is being
//! answered is one more told 503 at once. Answers waiting to be written
//! hold at most [`WRITE_BUDGET`] bytes; past that the oldest writes are
//! dropped first.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant, SystemTime};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

use super::http::{self, Handler, Method, Request, Response};
use crate::messages::serve as words;

/// The longest a request's head may take to arrive, from the accept.
pub(crate) const READ_TIME: Duration = Duration::from_secs(5);
/// The longest an answer may take to leave.
pub(crate) const WRITE_TIME: Duration = Duration::from_secs(10);
/// Connections kept at once.
pub(crate) const MAX_CONNECTIONS: usize = 256;
/// Threads computing answers (they wait for one snapshot together).
pub(crate) const ANSWERERS: usize = 4;
/// How long a closing connection reads what the client still sends.
const LINGER: Duration = Duration::from_millis(500);
/// The most that closing connection reads.
const LINGER_BYTES: usize = 64 * 1024;
/// The most bytes of answers waiting to be written.
pub(crate) const WRITE_BUDGET: usize = 32 * 1024 * 1024;

/// Where a connection is.
#[derive(Debug)]
enum Phase {
    /// Its head so far.
    Reading(Vec<u8>),
    /// With an answerer; a HEAD's answer is sent without its body.
    Answering { head_only: bool },
    /// The answer, and how much of it has left.
    Writing { bytes: Vec<u8>, sent: usize },
    /// Answered and shut for writing; what has been read since.
    Lingering { drained: usize },
}

#[derive(Debug)]
struct Conn {
    stream: TcpStream,
    accepted: Instant,
    /// When the phase must be over (none while answering: the handler's
    /// work is the server's own, bounded by the snapshot's).
    deadline: Option<Instant>,
    phase: Phase,
}

impl Conn {
    fn interest(&self) -> Option<PollFlags> {
        match self.phase {
            Phase::Reading(_) | Phase::Lingering { .. } => Some(PollFlags::POLLIN),
            Phase::Writing { .. } => Some(PollFlags::POLLOUT),
            Phase::Answering { .. } => None,
        }
    }

    /// Which connections go first when one must: lower first; `None` for
    /// one being answered.
    fn drop_rank(&self) -> Option<u8> {
        match self.phase {
            Phase::Lingering { .. } => Some(0),
            Phase::Reading(_) => Some(1),
            Phase::Writing { .. } => Some(2),
            Phase::Answering { .. } => None,
        }
    }

    fn unsent(&self) -> usize {
        match &self.phase {
            Phase::Writing { bytes, sent } => bytes.len() - sent,
            _ => 0,
        }
    }

    /// Starts writing `response` (its head only for a HEAD).
    fn answer(&mut self, response: &Response, head_only: bool, now: Instant) {
        let mut bytes = http::head(response, SystemTime::now());
        if !head_only {
            bytes.extend_from_slice(&response.body);
        }
        self.phase = Phase::Writing { bytes, sent: 0 };
        self.deadline = Some(now + WRITE_TIME);
    }
}

/// The connection to drop for a new one ([`Conn::drop_rank`], then the
/// oldest), if any may be.
fn to_drop<'a>(conns: impl Iterator<Item = (&'a u64, &'a Conn)>) -> Option<u64> {
    conns
        .filter_map(|(id, c)| Some(((c.drop_rank()?, c.accepted), *id)))
        .min()
        .map(|(_, id)| id)
}

/// A request handed to an answerer.
struct Job {
    id: u64,
    request: Request,
}

/// Its answer, handed back.
struct Done {
    id: u64,
    response: Response,
}

/// Answers connections on `listener` until a failure of the server itself
/// (poll, or no answerer thread could start), which it returns.
pub(crate) fn serve(listener: TcpListener, handler: Handler) -> std::io::Error {
    match run(listener, handler) {
        Ok(never) => match never {},
        Err(err) => err,
    }
}

fn run(listener: TcpListener, handler: Handler) -> std::io::Result<std::convert::Infallible> {
    let local_only = listener.local_addr().is_ok_and(|a| a.ip().is_loopback());
    listener.set_nonblocking(true)?;
    let (wake_rx, wake_tx) = UnixStream::pair()?;
    wake_rx.set_nonblocking(true)?;
    wake_tx.set_nonblocking(true)?;
    let (jobs, jobs_rx) = mpsc::channel::<Job>();
    let jobs_rx = Arc::new(Mutex::new(jobs_rx));
    let (done_tx, done) = mpsc::channel::<Done>();
    let mut started = 0;
    for _ in 0..ANSWERERS {
        let (jobs_rx, done_tx, handler) = (jobs_rx.clone(), done_tx.clone(), handler.clone());
        let wake = wake_tx.try_clone()?;
        let spawned = std::thread::Builder::new()
            .name("devlock-answer".to_owned())
            .spawn(move || answerer(&jobs_rx, &done_tx, &wake, &*handler));
        started += usize::from(spawned.is_ok());
    }
    if started == 0 {
        return Err(std::io::Error::other("no answerer thread could start"));
    }
    let mut conns: HashMap<u64, Conn> = HashMap::new();
    let mut next_id = 0u64;
    let mut accept_again_at: Option<Instant> = None;
    loop {
        let now = Instant::now();
        expire(&mut conns, now);
        let listening = accept_again_at.is_none_or(|at| now >= at);
        let timeout = conns
            .values()
            .filter_map(|c| c.deadline)
            .chain(accept_again_at.filter(|_| !listening))
            .min()
            .map_or(PollTimeout::NONE, |at| {
                // Rounded up, so a deadline is past when poll returns.
                let ms = at.saturating_duration_since(now).as_micros().div_ceil(1000);
                PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX)
            });
        let polled: Vec<(u64, PollFlags)> = conns
            .iter()
            .filter_map(|(id, c)| Some((*id, c.interest()?)))
            .collect();
        let mut fds = Vec::with_capacity(polled.len() + 2);
        fds.push(PollFd::new(wake_rx.as_fd(), PollFlags::POLLIN));
        let listen_for = if listening {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        fds.push(PollFd::new(listener.as_fd(), listen_for));
        for (id, flags) in &polled {
            fds.push(PollFd::new(conns[id].stream.as_fd(), *flags));
        }
        match poll(&mut fds, timeout) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(err) => return Err(err.into()),
        }
        let is_ready = |fd: &PollFd| fd.revents().is_none_or(|r| !r.is_empty());
        let woken = is_ready(&fds[0]);
        let incoming = listening && is_ready(&fds[1]);
        let ready: Vec<u64> = polled
            .iter()
            .zip(&fds[2..])
            .filter(|(_, fd)| is_ready(fd))
            .map(|((id, _), _)| *id)
            .collect();
        drop(fds);
        let now = Instant::now();
        if woken {
            let mut sink = [0u8; 64];
            while matches!((&wake_rx).read(&mut sink), Ok(n) if n > 0) {}
        }
        while let Ok(Done { id, response }) = done.try_recv() {
            answered(&mut conns, id, &response, now);
        }
        for id in ready {
            if let Some(conn) = conns.get_mut(&id)
                && !step(conn, id, local_only, &jobs, now)
            {
                conns.remove(&id);
            }
        }
        if incoming {
            accept_again_at = accept(&listener, &mut conns, &mut next_id, now);
        }
    }
}

/// Runs the handler on the requests handed over, one at a time, until the
/// server is gone.
fn answerer(
    jobs: &Mutex<mpsc::Receiver<Job>>,
    done: &mpsc::Sender<Done>,
    wake: &UnixStream,
    handler: &dyn Fn(&Request) -> Response,
) {
    loop {
        let job = jobs.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok(Job { id, request }) = job else {
            return;
        };
        let response = handler(&request);
        if done.send(Done { id, response }).is_err() {
            return;
        }
        // A full pipe means a wake is pending already.
        let _ = (&*wake).write(&[1]);
    }
}

/// Hands an answer to its connection (if it was not dropped meanwhile),
/// within [`WRITE_BUDGET`]: older writes are dropped first to make room.
fn answered(conns: &mut HashMap<u64, Conn>, id: u64, response: &Response, now: Instant) {
    let Some(conn) = conns.get_mut(&id) else {
        return;
    };
    let head_only = matches!(conn.phase, Phase::Answering { head_only: true });
    conn.answer(response, head_only, now);
    loop {
        let unsent: usize = conns.values().map(Conn::unsent).sum();
        if unsent <= WRITE_BUDGET {
            return;
        }
        let oldest = conns
            .iter()
            .filter(|(other, c)| **other != id && c.unsent() > 0)
            .min_by_key(|(_, c)| c.accepted)
            .map(|(other, _)| *other);
        match oldest {
            Some(other) => conns.remove(&other),
            None => return,
        };
    }
}

/// Acts on a deadline passed: a head not in is answered 408; a write or a
/// linger not done ends the connection.
fn expire(conns: &mut HashMap<u64, Conn>, now: Instant) {
    let mut ended = Vec::new();
    for (id, conn) in conns.iter_mut() {
        if conn.deadline.is_none_or(|at| at > now) {
            continue;
        }
        match conn.phase {
            Phase::Reading(_) => {
                let late = Response::text(408, words::bad_request("it did not arrive in time"));
                conn.answer(&late, false, now);
            }
            _ => ended.push(*id),
        }
    }
    for id in ended {
        conns.remove(&id);
    }
}

/// Does what a ready connection lets: reads its head, writes its answer,
/// or reads what it sends while closing. False when it is over.
fn step(
    conn: &mut Conn,
    id: u64,
    local_only: bool,
    jobs: &mpsc::Sender<Job>,
    now: Instant,
) -> bool {
    let mut chunk = [0u8; 4096];
    match &mut conn.phase {
        Phase::Reading(head) => {
            let before = head.len();
            let Some((_, ended)) =
                read_some(&mut conn.stream, &mut chunk, head, http::MAX_HEAD + 4)
            else {
                return false;
            };
            let from = before.saturating_sub(3);
            let end = http::head_end(&head[from..]).map(|e| from + e);
            let refusal = match end {
                Some(end) if end > http::MAX_HEAD => Some(too_large()),
                Some(end) => {
                    let whole = &head[..end];
                    match http::parse(whole) {
                        Err(refusal) => Some(refusal),
                        Ok(request) => match &request.host {
                            Some(host) if local_only && !http::is_local_host(host) => {
                                Some(Response::text(403, words::foreign_host(host)))
                            }
                            _ => {
                                let head_only = request.method == Method::Head;
                                if jobs.send(Job { id, request }).is_err() {
                                    return false;
                                }
                                conn.phase = Phase::Answering { head_only };
                                conn.deadline = None;
                                return true;
                            }
                        },
                    }
                }
                // The client closed or the connection failed: nobody to
                // answer.
                None if ended => return false,
                None if head.len() > http::MAX_HEAD => Some(too_large()),
                None => return true,
            };
            if let Some(refusal) = refusal {
                conn.answer(&refusal, false, now);
            }
            true
        }
        Phase::Writing { bytes, sent } => {
            while *sent < bytes.len() {
                match conn.stream.write(&bytes[*sent..]) {
                    Ok(0) => return false,
                    Ok(n) => *sent += n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                    Err(_) => return false,
                }
            }
            if conn.stream.shutdown(Shutdown::Write).is_err() {
                return false;
            }
            conn.phase = Phase::Lingering { drained: 0 };
            conn.deadline = Some(now + LINGER);
            true
        }
        Phase::Lingering { drained } => {
            let mut sink = Vec::new();
            match read_some(&mut conn.stream, &mut chunk, &mut sink, LINGER_BYTES) {
                Some((n, false)) => {
                    *drained += n;
                    *drained < LINGER_BYTES
                }
                _ => false,
            }
        }
        Phase::Answering { .. } => true,
    }
}

fn too_large() -> Response {
    Response::text(431, words::bad_request("its head is over 8 KiB"))
}

/// Reads what the socket has now into `into`, up to `most` bytes in all:
/// how many were read and whether the stream has ended, or `None` on a
/// failure.
fn read_some(
    stream: &mut TcpStream,
    chunk: &mut [u8],
    into: &mut Vec<u8>,
    most: usize,
) -> Option<(usize, bool)> {
    let mut read = 0;
    while into.len() < most {
        let room = chunk.len().min(most - into.len());
        match stream.read(&mut chunk[..room]) {
            Ok(0) => return Some((read, true)),
            Ok(n) => {
                read += n;
                into.extend_from_slice(&chunk[..n]);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Some((read, false)),
            Err(_) => return None,
        }
    }
    Some((read, false))
}

/// Accepts what is waiting, making room as [`to_drop`] says; when out of
/// descriptors with none to drop, when to try again.
fn accept(
    listener: &TcpListener,
    conns: &mut HashMap<u64, Conn>,
    next_id: &mut u64,
    now: Instant,
) -> Option<Instant> {
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return None,
            Err(e) => {
                // Out of descriptors or memory: give up an idle connection
                // for the next, or let the others finish for a moment
                // rather than spin on the same failure.
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                ) && let Some(id) = to_drop(conns.iter())
                {
                    conns.remove(&id);
                    return None;
                }
                return Some(now + Duration::from_millis(100));
            }
        };
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        let _ = stream.set_nodelay(true);
        if conns.len() >= MAX_CONNECTIONS {
            match to_drop(conns.iter()) {
                Some(id) => {
                    conns.remove(&id);
                }
                None => {
                    refuse_busy(stream);
                    continue;
                }
            }
        }
        conns.insert(
            *next_id,
            Conn {
                stream,
                accepted: now,
                deadline: Some(now + READ_TIME),
                phase: Phase::Reading(Vec::new()),
            },
        );
        *next_id += 1;
    }
}

/// A 503 written without waiting (a fresh socket's buffer takes it whole),
/// then what of the request has come is read (closing over unread bytes
/// would reset the connection, and the client might lose the 503).
fn refuse_busy(mut stream: TcpStream) {
    let response = Response::text(503, words::too_busy(MAX_CONNECTIONS)).with("Retry-After", "1");
    let mut answer = http::head(&response, SystemTime::now());
    answer.extend_from_slice(&response.body);
    let _ = stream.write_all(&answer);
    let _ = stream.shutdown(Shutdown::Write);
    let mut sink = [0u8; 2048];
    for _ in 0..4 {
        if !matches!(stream.read(&mut sink), Ok(n) if n > 0) {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn(stream: &TcpStream, age_s: u64, phase: Phase, now: Instant) -> Conn {
        Conn {
            stream: stream.try_clone().unwrap(),
            accepted: now - Duration::from_secs(age_s),
            deadline: None,
            phase,
        }
    }

    #[test]
    fn the_idle_and_the_slow_are_dropped_first_and_the_answered_never() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let now = Instant::now() + Duration::from_secs(100);
        let mut conns = HashMap::new();
        conns.insert(
            1,
            conn(&stream, 9, Phase::Answering { head_only: false }, now),
        );
        conns.insert(
            2,
            conn(
                &stream,
                8,
                Phase::Writing {
                    bytes: vec![1],
                    sent: 0,
                },
                now,
            ),
        );
        conns.insert(3, conn(&stream, 2, Phase::Reading(Vec::new()), now));
        conns.insert(4, conn(&stream, 3, Phase::Reading(b"GET".to_vec()), now));
        assert_eq!(to_drop(conns.iter()), Some(4), "the oldest still sending");
        conns.insert(5, conn(&stream, 1, Phase::Lingering { drained: 0 }, now));
        assert_eq!(to_drop(conns.iter()), Some(5), "one closing goes before");
        for id in [5, 4, 3] {
            conns.remove(&id);
        }
        assert_eq!(to_drop(conns.iter()), Some(2), "then a slow reader");
        conns.remove(&2);
        assert_eq!(to_drop(conns.iter()), None, "never one being answered");
    }
}
