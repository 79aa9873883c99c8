//! Running the command under the lock: it inherits the locked file, hears each
//! stopping signal once, and devlock waits for it whatever happens.

use std::ffi::CString;
use std::ffi::OsString;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;

use anyhow::Result;

use crate::exit::{ExitCode, coded};
use crate::tty;

/// Variables set for the command, over devlock's own environment.
pub type Env = Vec<(OsString, OsString)>;

/// The signals that ask a job to stop, which devlock passes on to its command.
pub const STOP_SIGNALS: [libc::c_int; 4] =
    [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// A signal as sigwaitinfo reported it.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub signo: libc::c_int,
    /// Sent by a process with kill(2) (as opposed to raised by the kernel,
    /// which is how a terminal's Ctrl-C arrives).
    pub from_process: bool,
    /// The sending process, when one sent it.
    pub sender: Option<libc::pid_t>,
}

/// The signal that tells the waiting display its wait is over: a real-time
/// one, sent to that thread alone, so it never eats the SIGCHLD of the
/// command (which would then never be reaped).
pub fn wake_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}

fn set_of(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data and sigemptyset initialises it.
    unsafe {
        let mut set = std::mem::zeroed::<libc::sigset_t>();
        libc::sigemptyset(&mut set);
        for &sig in signals {
            libc::sigaddset(&mut set, sig);
        }
        set
    }
}

/// Blocks the signals devlock handles itself (the stop signals, SIGCHLD,
/// SIGWINCH for the waiting line, and the wake signal) in this thread and
/// every thread it starts, so they queue up for sigwaitinfo instead of
/// killing devlock while its command still runs. Call before starting any
/// thread.
pub fn block_handled_signals() {
    let mut all = STOP_SIGNALS.to_vec();
    all.extend([libc::SIGCHLD, libc::SIGWINCH, wake_signal()]);
    let set = set_of(&all);
    // SAFETY: valid set pointer.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
}

/// Puts right what devlock may inherit from a careless parent: an ignored
/// SIGCHLD (children would be reaped behind its back and it would wait
/// forever) and closed standard descriptors (a lock file opened into fd 2
/// would become the command's stderr).
pub fn sane_start() {
    // SAFETY: plain syscalls on the calling process.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_DFL);
        for fd in 0..3 {
            if libc::fcntl(fd, libc::F_GETFD) == -1 {
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 && null != fd {
                    libc::dup2(null, fd);
                    libc::close(null);
                }
            }
        }
    }
}

/// A stopping signal that arrived before the command started (a Ctrl-C
/// during --require-idle's probe, say), taken off the queue without waiting.
pub fn pending_stop() -> Option<Received> {
    wait_in(&set_of(&STOP_SIGNALS), Some(std::time::Duration::ZERO))
}

/// The error that ends devlock when a stopping signal came before the
/// command started: nothing runs, the locks go with the process.
pub fn stopped_before_start(sig: Received) -> anyhow::Error {
    coded(
        ExitCode::Signal(sig.signo),
        format!("stopped by signal {} before the command started", sig.signo),
    )
}

/// Lets the stopping signals end devlock by their default action again.
pub fn unblock_stop_signals() {
    let set = set_of(&STOP_SIGNALS);
    // SAFETY: valid set pointer.
    unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
}

/// Takes any wake signal still pending off the queue: unblocked before an
/// exec, it would end the process (a real-time signal's default action).
pub fn discard_wakes() {
    while wait_in(&set_of(&[wake_signal()]), Some(std::time::Duration::ZERO)).is_some() {}
}

/// For the waiting display: a stopping signal, the wake signal or SIGWINCH
/// (the terminal changed size), up to `timeout`.
pub fn wait_stop_or_wake(timeout: std::time::Duration) -> Option<Received> {
    let mut signals = STOP_SIGNALS.to_vec();
    signals.extend([wake_signal(), libc::SIGWINCH]);
    wait_in(&set_of(&signals), Some(timeout))
}

/// For the supervisor: a stopping signal or SIGCHLD.
pub fn wait_signal(timeout: Option<std::time::Duration>) -> Option<Received> {
    let mut signals = STOP_SIGNALS.to_vec();
    signals.push(libc::SIGCHLD);
    wait_in(&set_of(&signals), timeout)
}

fn wait_in(set: &libc::sigset_t, timeout: Option<std::time::Duration>) -> Option<Received> {
    // SAFETY: siginfo_t is plain data filled by the kernel.
    let mut info = unsafe { std::mem::zeroed::<libc::siginfo_t>() };
    let signo = match timeout {
        None => unsafe { libc::sigwaitinfo(set, &mut info) },
        Some(t) => {
            let ts = libc::timespec {
                tv_sec: t.as_secs() as libc::time_t,
                tv_nsec: t.subsec_nanos() as libc::c_long,
            };
            // SAFETY: valid pointers.
            unsafe { libc::sigtimedwait(set, &mut info, &ts) }
        }
    };
    let from_process = info.si_code <= 0;
    (signo > 0).then(|| Received {
        signo,
        from_process,
        // SAFETY: a signal sent by a process carries its pid.
        sender: from_process.then(|| unsafe { info.si_pid() }),
    })
}

/// Where the command runs, which decides which signals reach it without
/// devlock: see the module's [`Placement::choose`].
#[derive(Debug)]
pub enum Placement {
    /// In a process group of its own, so that whatever is sent to devlock
    /// or to devlock's group reaches the command only through devlock,
    /// once. When devlock's job had the terminal to itself, the command's
    /// group gets the terminal (a prompt and `python -i` work, Ctrl-C and
    /// Ctrl-Z reach it), and gives it back when it stops or ends.
    OwnGroup {
        terminal: Option<tty::Terminal>,
        hand_over: bool,
    },
    /// In devlock's process group, which is the terminal's foreground
    /// group and shared with others (make -j, xargs -P, a script): the
    /// terminal's signals (Ctrl-C) and its input reach the command as
    /// they would without devlock; devlock passes on only what a process
    /// sent, and a signal sent to the whole group arrives twice.
    Shared,
}

impl Placement {
    /// The command gets a group of its own unless devlock's group is the
    /// terminal's foreground group and holds other processes too: then
    /// taking the terminal from that group would leave the others (make,
    /// its other jobs) without Ctrl-C, and leaving the command outside it
    /// would stop it on its first read of the terminal.
    pub fn choose() -> Placement {
        let terminal = tty::Terminal::open();
        let foreground = terminal.as_ref().is_some_and(tty::Terminal::is_ours);
        if foreground && !tty::alone_in_group() {
            return Placement::Shared;
        }
        Placement::OwnGroup {
            terminal,
            hand_over: foreground,
        }
    }

    fn own_group(&self) -> bool {
        matches!(self, Placement::OwnGroup { .. })
    }

    #[cfg(feature = "etcd")]
    /// For a start by other means than [`spawn`]: whether the command gets
    /// a group of its own, and the terminal it is to take before it execs.
    pub fn spawn_settings(&self) -> (bool, Option<RawFd>) {
        (
            self.own_group(),
            self.hand_over().map(tty::Terminal::raw_fd),
        )
    }

    fn terminal(&self) -> Option<&tty::Terminal> {
        match self {
            Placement::OwnGroup { terminal, .. } => terminal.as_ref(),
            Placement::Shared => None,
        }
    }

    fn hand_over(&self) -> Option<&tty::Terminal> {
        match self {
            Placement::OwnGroup {
                terminal: Some(terminal),
                hand_over: true,
            } => Some(terminal),
            _ => None,
        }
    }
}

/// A running command.
#[derive(Debug)]
pub struct Child {
    pid: libc::pid_t,
    placement: Placement,
}

impl Child {
    #[cfg(feature = "etcd")]
    /// A child started some other way (in a group of its own when
    /// `placement` says so), for [`supervise`] to wait for.
    pub fn adopt(pid: u32, placement: Placement) -> Child {
        Child {
            pid: pid as libc::pid_t,
            placement,
        }
    }

    pub fn id(&self) -> u32 {
        self.pid as u32
    }

    /// What became of the command, if anything did: its exit code once it
    /// has ended, or the signal that stopped it (in a group of its own,
    /// where its stops are devlock's to pass on).
    fn poll(&self) -> std::io::Result<Option<Ended>> {
        let mut status = 0;
        let flags = if self.placement.own_group() {
            libc::WNOHANG | libc::WUNTRACED
        } else {
            libc::WNOHANG
        };
        // SAFETY: waitpid on our own, not yet reaped, child.
        match unsafe { libc::waitpid(self.pid, &mut status, flags) } {
            0 => Ok(None),
            -1 => Err(std::io::Error::last_os_error()),
            _ if libc::WIFSTOPPED(status) => Ok(Some(Ended::Stopped(libc::WSTOPSIG(status)))),
            _ => Ok(code_of(status).map(Ended::Exited)),
        }
    }

    /// Reaps every other child that has ended; the command's status if it
    /// was among them.
    fn reap_others(&self) -> std::io::Result<Option<ExitCode>> {
        loop {
            let mut status = 0;
            // SAFETY: waitpid on any child of ours.
            match unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } {
                0 => return Ok(None),
                -1 if std::io::Error::last_os_error().raw_os_error() == Some(libc::ECHILD) => {
                    return Ok(None);
                }
                -1 => return Err(std::io::Error::last_os_error()),
                pid if pid == self.pid => {
                    if let Some(code) = code_of(status) {
                        return Ok(Some(code));
                    }
                }
                _ => {}
            }
        }
    }

    /// Passes a stopping signal on: to the command's whole group when it
    /// has one (what a job's group would have got), else to the command.
    fn forward(&self, signo: libc::c_int) {
        // SAFETY: kill of our own child, or of the group it leads (its pid
        // names the group as long as it is unreaped).
        unsafe {
            if !self.placement.own_group() || libc::kill(-self.pid, signo) != 0 {
                libc::kill(self.pid, signo);
            }
        }
    }

    /// Whether the command (or a process of its own group) sent `sig`:
    /// passing that back would have the command stop itself (as sudo
    /// reasons; think of `kill(-1, SIGTERM)`).
    fn sent_by_command(&self, sig: &Received) -> bool {
        let Some(sender) = sig.sender else {
            return false;
        };
        // SAFETY: getpgid only reads.
        sender == self.pid
            || (self.placement.own_group() && unsafe { libc::getpgid(sender) } == self.pid)
    }

    /// The command stopped, in a group of its own. A terminal's job-control
    /// stop (Ctrl-Z, or a read of the terminal from the background) would
    /// have stopped devlock's group with it: so devlock stops its group the
    /// same way (the shell then sees the job stopped and takes the
    /// terminal back), and once continued (fg, bg) hands the terminal back
    /// if it is in the foreground, and continues the command. A stop sent
    /// to the command alone (SIGSTOP, a debugger) is left alone.
    fn stopped(&self, signo: libc::c_int) {
        let Some(terminal) = self.placement.terminal() else {
            return;
        };
        let commands = terminal.foreground() == Some(self.pid);
        match signo {
            // Raced the hand-over: it has the terminal now.
            libc::SIGTTIN | libc::SIGTTOU if commands => {}
            libc::SIGTTIN | libc::SIGTTOU => self.stop_as_a_job(signo, terminal),
            libc::SIGTSTP if commands => self.stop_as_a_job(signo, terminal),
            _ => return,
        }
        // SAFETY: continues the group our unreaped child leads.
        unsafe { libc::kill(-self.pid, libc::SIGCONT) };
    }

    fn stop_as_a_job(&self, signo: libc::c_int, terminal: &tty::Terminal) {
        // SAFETY: getpgrp cannot fail.
        let own = unsafe { libc::getpgrp() };
        if terminal.foreground() == Some(self.pid) {
            terminal.give_to(own);
        }
        // Stops devlock here until SIGCONT; the kernel discards it when
        // nobody could continue the group (an orphaned group), and then
        // devlock goes straight on.
        // SAFETY: a signal to our own process group.
        unsafe { libc::kill(0, signo) };
        if terminal.is_ours() {
            terminal.give_to(self.pid);
        }
    }

    /// A job stop (Ctrl-Z) that reached devlock while it held job stops
    /// back, just before the command started: the whole job stops, the
    /// command with it. A command that has the terminal is stopped through
    /// its group, which the loop in [`supervise`] relays as a stop of the
    /// job (devlock takes the terminal back, stops, and on `fg` hands it
    /// over again). Otherwise devlock stops as the signal would have stopped
    /// it, and a command in devlock's own group gets its copy too. Call
    /// with job stops at their default action.
    pub fn pass_on_job_stop(&self, signo: libc::c_int) {
        // SAFETY: kill of the group our unreaped child leads, of the child
        // itself, or of devlock.
        unsafe {
            if self.placement.hand_over().is_some() {
                if libc::kill(-self.pid, signo) == 0 {
                    return;
                }
            } else if !self.placement.own_group() {
                libc::kill(self.pid, signo);
            }
            libc::raise(signo);
        }
    }

    /// Takes the terminal back from the command's group once it has ended,
    /// before devlock says anything or exits.
    fn take_terminal_back(&self) {
        if let Some(terminal) = self.placement.terminal()
            && terminal.foreground() == Some(self.pid)
        {
            // SAFETY: getpgrp cannot fail.
            terminal.give_to(unsafe { libc::getpgrp() });
        }
    }
}

/// What became of the command.
enum Ended {
    Exited(ExitCode),
    Stopped(libc::c_int),
}

fn code_of(status: libc::c_int) -> Option<ExitCode> {
    if libc::WIFEXITED(status) {
        Some(ExitCode::Command(libc::WEXITSTATUS(status)))
    } else if libc::WIFSIGNALED(status) {
        Some(ExitCode::Signal(libc::WTERMSIG(status)))
    } else {
        None
    }
}

/// Starts `command` with the lock descriptors `keep` inherited across exec,
/// placed as `placement` says.
///
/// posix_spawn rather than fork: no page tables to copy, on every start and
/// every hand-off. The child gets an empty signal mask (devlock blocks the
/// signals it handles); signals the caller ignored stay ignored (`nohup`),
/// and devlock's own handlers vanish at exec as always. The lock
/// descriptors lose close-on-exec in the parent just before. A command in a
/// group of its own that is to have the terminal takes it itself before it
/// execs (glibc 2.35's tcsetpgrp file action), so it never reads the
/// terminal from the background; without that, devlock hands it over just
/// after, and a read that came first is continued.
pub fn spawn(
    command: &[OsString],
    keep: &[RawFd],
    env: &Env,
    placement: Placement,
) -> Result<Child> {
    for &fd in keep {
        // SAFETY: fcntl on a descriptor we own.
        let ok = unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            flags >= 0 && libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) == 0
        };
        if !ok {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    let program = &command[0];
    let c_strings = |items: Vec<Vec<u8>>| -> Result<Vec<CString>> {
        items
            .into_iter()
            .map(|b| {
                CString::new(b)
                    .map_err(|_| coded(ExitCode::Usage, "an argument contains a NUL byte"))
            })
            .collect()
    };
    let argv = c_strings(command.iter().map(|a| a.as_bytes().to_vec()).collect())?;
    let mut vars: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| !env.iter().any(|(name, _)| k == name))
        .collect();
    vars.extend(env.iter().cloned());
    let envp = c_strings(
        vars.iter()
            .map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes()].concat())
            .collect(),
    )?;
    let mut argv_ptrs: Vec<*mut libc::c_char> = argv.iter().map(|a| a.as_ptr() as *mut _).collect();
    argv_ptrs.push(std::ptr::null_mut());
    let mut envp_ptrs: Vec<*mut libc::c_char> = envp.iter().map(|e| e.as_ptr() as *mut _).collect();
    envp_ptrs.push(std::ptr::null_mut());

    let own_group = placement.own_group();
    let terminal = placement.hand_over().map(tty::Terminal::raw_fd);
    let start = |terminal: Option<RawFd>| -> (libc::c_int, libc::pid_t) {
        let mut pid: libc::pid_t = 0;
        // SAFETY: attrs and file actions are initialised before use and
        // destroyed after; every pointer passed stays alive for the call.
        let err = unsafe {
            let mut attrs = std::mem::zeroed::<libc::posix_spawnattr_t>();
            libc::posix_spawnattr_init(&mut attrs);
            let empty = set_of(&[]);
            libc::posix_spawnattr_setsigmask(&mut attrs, &empty);
            let mut flags = libc::POSIX_SPAWN_SETSIGMASK;
            if own_group {
                flags |= libc::POSIX_SPAWN_SETPGROUP;
                libc::posix_spawnattr_setpgroup(&mut attrs, 0);
            }
            libc::posix_spawnattr_setflags(&mut attrs, flags as libc::c_short);
            let mut actions = std::mem::zeroed::<libc::posix_spawn_file_actions_t>();
            libc::posix_spawn_file_actions_init(&mut actions);
            let with_actions = terminal.is_some_and(|fd| add_tcsetpgrp(&mut actions, fd));
            let err = libc::posix_spawnp(
                &mut pid,
                argv[0].as_ptr(),
                if with_actions {
                    &actions
                } else {
                    std::ptr::null()
                },
                &attrs,
                argv_ptrs.as_ptr(),
                envp_ptrs.as_ptr(),
            );
            libc::posix_spawn_file_actions_destroy(&mut actions);
            libc::posix_spawnattr_destroy(&mut attrs);
            err
        };
        (err, pid)
    };
    let (mut err, mut pid) = start(terminal);
    if err != 0 && terminal.is_some() {
        // The terminal refused (it went away, say): start it without.
        (err, pid) = start(None);
    }
    if err != 0 {
        return Err(cannot_start(
            program,
            &std::io::Error::from_raw_os_error(err),
        ));
    }
    if let Some(terminal) = placement.hand_over()
        && terminal.foreground() != Some(pid)
    {
        terminal.give_to(pid);
    }
    Ok(Child { pid, placement })
}

/// Adds glibc's tcsetpgrp file action (2.35 and later), looked up when
/// needed so that devlock still runs on an older glibc.
fn add_tcsetpgrp(actions: &mut libc::posix_spawn_file_actions_t, fd: RawFd) -> bool {
    type AddTcsetpgrp =
        unsafe extern "C" fn(*mut libc::posix_spawn_file_actions_t, libc::c_int) -> libc::c_int;
    static FOUND: std::sync::OnceLock<Option<AddTcsetpgrp>> = std::sync::OnceLock::new();
    let found = FOUND.get_or_init(|| {
        // SAFETY: dlsym with a NUL-terminated name; a non-null result is
        // that function, whose type glibc documents.
        unsafe {
            let symbol = libc::dlsym(
                libc::RTLD_DEFAULT,
                c"posix_spawn_file_actions_addtcsetpgrp_np".as_ptr(),
            );
            (!symbol.is_null())
                .then(|| std::mem::transmute::<*mut libc::c_void, AddTcsetpgrp>(symbol))
        }
    });
    // SAFETY: initialised file actions and a descriptor we keep open.
    found.is_some_and(|add| unsafe { add(actions, fd) } == 0)
}

/// Looks `program` up as posix_spawnp(3) will when it starts it (on `PATH`,
/// or the path itself when it has a slash) and checks that it can be
/// executed, so that a typo fails at once with 127, or 126, instead of
/// after its turn in line. The start itself still decides: this is a
/// check, not the lookup.
pub fn check_command(program: &std::ffi::OsStr) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let bytes = program.as_bytes();
    let candidates: Vec<std::path::PathBuf> = if bytes.contains(&b'/') {
        vec![program.into()]
    } else if bytes.is_empty() {
        Vec::new()
    } else {
        // glibc's default when PATH is unset; an empty entry is the
        // current directory, as execvp has it.
        let path = std::env::var_os("PATH").unwrap_or_else(|| "/bin:/usr/bin".into());
        path.as_bytes()
            .split(|&b| b == b':')
            .map(|dir| {
                let dir = if dir.is_empty() { b".".as_slice() } else { dir };
                std::path::Path::new(std::ffi::OsStr::from_bytes(dir)).join(program)
            })
            .collect()
    };
    let mut denied = false;
    for candidate in &candidates {
        let Ok(meta) = std::fs::metadata(candidate) else {
            continue;
        };
        let Ok(c_path) = CString::new(candidate.as_os_str().as_bytes()) else {
            continue;
        };
        // SAFETY: a NUL-terminated path; faccessat only reads it.
        let executable = meta.is_file()
            && meta.permissions().mode() & 0o111 != 0
            && unsafe {
                libc::faccessat(
                    libc::AT_FDCWD,
                    c_path.as_ptr(),
                    libc::X_OK,
                    libc::AT_EACCESS,
                )
            } == 0;
        if executable {
            return Ok(());
        }
        denied = true;
    }
    let err = if denied {
        std::io::Error::from_raw_os_error(libc::EACCES)
    } else {
        std::io::Error::from_raw_os_error(libc::ENOENT)
    };
    Err(cannot_start(program, &err))
}

/// Why `program` could not be started, with the shell's exit code: 127 when
/// it is not found, 126 when it cannot be executed.
pub fn cannot_start(program: &std::ffi::OsStr, err: &std::io::Error) -> anyhow::Error {
    let shown = program.to_string_lossy();
    match err.kind() {
        std::io::ErrorKind::NotFound => {
            coded(ExitCode::NotFound, format!("{shown}: command not found"))
        }
        std::io::ErrorKind::PermissionDenied => coded(
            ExitCode::CannotExecute,
            format!("{shown}: cannot execute: permission denied"),
        ),
        _ => coded(
            ExitCode::CannotExecute,
            format!("{shown}: cannot execute: {err}"),
        ),
    }
}

/// Waits for the command to end and returns the exit code devlock should end
/// with, calling `tick` about once a second while the command runs
/// (the holder's check that its lock files are still where they were).
pub fn supervise_watching(
    child: Child,
    pending: Option<Received>,
    tick: &mut dyn FnMut(),
) -> ExitCode {
    supervise_loop(child, pending, false, Some(tick)).0
}

#[cfg(feature = "etcd")]
/// [`supervise_watching`] without a tick, also reaping other children as they end when `reap_all`
/// (devlock as a subreaper collects what the command left behind), and
/// saying which stopping signal, if any, came meanwhile.
///
/// Which signals devlock passes on follows from where the command runs.
/// In a group of its own, nothing sent to devlock or to its group, nor the
/// terminal's signals to that group, reaches the command but through
/// devlock: each first stopping signal goes on to the command's group
/// (once: a second copy, such as timeout(1)'s to its whole group, is
/// absorbed). Sharing devlock's group, the command already got whatever
/// the terminal sent: devlock passes on only what a process sent (and the
/// hang-up a terminal sends its session leader alone). Signals sent by
/// the command itself are never passed back to it.
pub fn supervise_reaping(
    child: Child,
    pending: Option<Received>,
    reap_all: bool,
) -> (ExitCode, Option<Received>) {
    supervise_loop(child, pending, reap_all, None)
}

fn supervise_loop(
    child: Child,
    pending: Option<Received>,
    reap_all: bool,
    mut tick: Option<&mut dyn FnMut()>,
) -> (ExitCode, Option<Received>) {
    // The first stopping signal reaches the command once; later ones are
    // absorbed, so a second Ctrl-C or kill does not cut its clean-up short.
    let mut first = None;
    // SAFETY: getsid and getpid cannot fail for the calling process.
    let session_leader = unsafe { libc::getsid(0) == libc::getpid() };
    let mut on_signal = |sig: Received, child: &Child| {
        if matches!(sig.signo, libc::SIGCHLD | libc::SIGWINCH)
            || first.is_some()
            || child.sent_by_command(&sig)
        {
            return;
        }
        first = Some(sig);
        let hang_up_for_leader = sig.signo == libc::SIGHUP && session_leader;
        if child.placement.own_group() || sig.from_process || hang_up_for_leader {
            child.forward(sig.signo);
        }
    };
    if let Some(sig) = pending {
        on_signal(sig, &child);
    }
    let code = loop {
        match child.poll() {
            Ok(Some(Ended::Exited(code))) => break code,
            Ok(Some(Ended::Stopped(signo))) => {
                child.stopped(signo);
                continue;
            }
            Ok(None) => {}
            Err(_) => break ExitCode::GeneralError,
        }
        if reap_all {
            match child.reap_others() {
                Ok(Some(code)) => break code,
                Ok(None) => {}
                Err(_) => break ExitCode::GeneralError,
            }
        }
        let every = tick.is_some().then_some(std::time::Duration::from_secs(1));
        match wait_signal(every) {
            Some(sig) => on_signal(sig, &child),
            None => {
                if let Some(tick) = tick.as_mut() {
                    tick();
                }
            }
        }
    };
    child.take_terminal_back();
    (code, first)
}
