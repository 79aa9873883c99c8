//! The exec that makes devlock the command: execve(2) with devlock's own
//! environment and the job's variables over it, the environment passed on
//! by pointer, not copied.
//!
//! Why not std's `Command::exec`: with variables to set, it copies the
//! whole environment into an ordered map and then into new strings, a few
//! hundred allocations between a grant and the command's start, where every
//! microsecond is the next job's wait (bench/run, the drain).

use std::ffi::{CStr, CString, OsString, c_char};
use std::io;
use std::os::unix::ffi::OsStrExt;

unsafe extern "C" {
    /// The C runtime's environment: a NULL-terminated array of
    /// NUL-terminated `NAME=value` strings (mutable: setenv(3) moves it).
    static mut environ: *const *const c_char;
}

/// Replaces this process with `path` (or, when it is `None`, with
/// `argv[0]` looked up on `PATH`), as execvp(3) does, given `argv` and
/// devlock's own environment with `set` over it: an entry whose name `set`
/// gives is left out, and `set`'s are added after the rest (whose names
/// the caller keeps unique). The rest goes as it is, in its order, as
/// execve would pass it: a name given twice twice, an entry with no `=`
/// too. Returns only if the exec failed, with its error.
pub fn exec(path: Option<&CStr>, argv: &[OsString], set: &[(OsString, OsString)]) -> io::Error {
    let nul = |in_what| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a NUL byte in {in_what}"),
        )
    };
    let Ok(args) = argv
        .iter()
        .map(|a| CString::new(a.as_bytes()))
        .collect::<Result<Vec<_>, _>>()
    else {
        return nul("the command");
    };
    let Some(first) = args.first() else {
        return io::Error::new(io::ErrorKind::InvalidInput, "no command");
    };
    let Ok(added) = set
        .iter()
        .map(|(name, value)| {
            let mut entry = name.as_bytes().to_vec();
            entry.push(b'=');
            entry.extend_from_slice(value.as_bytes());
            CString::new(entry)
        })
        .collect::<Result<Vec<_>, _>>()
    else {
        return nul("a variable set for the command");
    };
    let replaced = |entry: &[u8]| {
        set.iter().any(|(name, _)| {
            let name = name.as_bytes();
            entry.len() > name.len() && entry.starts_with(name) && entry[name.len()] == b'='
        })
    };
    let mut envp: Vec<*const c_char> = Vec::with_capacity(64 + added.len());
    // SAFETY: `environ` is the C runtime's NULL-terminated array of
    // NUL-terminated strings. devlock never changes its environment (only
    // unit tests do, see `sys::env`), and this runs on the one thread left
    // before the exec, so nothing moves it while it is read; the pointers
    // are handed to execve unchanged, and stay valid until then.
    unsafe {
        let mut at = (&raw const environ).read();
        while !at.is_null() && !(*at).is_null() {
            if !replaced(CStr::from_ptr(*at).to_bytes()) {
                envp.push(*at);
            }
            at = at.add(1);
        }
    }
    debug_assert!(
        set.iter()
            .enumerate()
            .all(|(i, (name, _))| set[..i].iter().all(|(seen, _)| seen != name)),
        "a variable set twice for the command"
    );
    envp.extend(added.iter().map(|entry| entry.as_ptr()));
    envp.push(std::ptr::null());
    let argp: Vec<*const c_char> = args
        .iter()
        .map(|a| a.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    // execvpe for a path as well (one with a slash is not looked up): as
    // execvp, which std and util-linux flock call, it runs a file that has
    // no `#!` line with /bin/sh, where execve fails with ENOEXEC.
    let file = path.unwrap_or(first.as_c_str());
    // SAFETY: `argp` and `envp` are NULL-terminated arrays of pointers to
    // NUL-terminated strings (`args`, `added` and the environment's own),
    // and `file` is one; all alive for the call, which returns only on
    // failure.
    unsafe { libc::execvpe(file.as_ptr(), argp.as_ptr(), envp.as_ptr()) };
    io::Error::last_os_error()
}
