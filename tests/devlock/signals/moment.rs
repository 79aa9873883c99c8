//! Catching devlock at one moment: the pid of a process by its command
//! line, whether it is in write(2), a pipe that is full (so a write lasts),
//! and a thread that drains it when the moment is over.

use super::*;

/// The pid of the process whose command line starts with `argv0` and
/// holds `word`.
pub(super) fn pid_running(argv0: &str, word: &str) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .find_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
            let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
            (args.first() == Some(&argv0.as_bytes()) && args.contains(&word.as_bytes()))
                .then_some(pid)
        })
}

/// Whether `pid`'s main thread is in write(2) on `fd`.
pub(super) fn writing_to(pid: u32, fd: u32) -> bool {
    let syscall = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
    let mut words = syscall.split_whitespace();
    words.next().and_then(|n| n.parse::<libc::c_long>().ok()) == Some(libc::SYS_write)
        && words.next() == Some(&format!("{fd:#x}"))
}

/// A directory `d` another user made (the one line devlock says before it
/// starts the command is about it).
pub(super) fn made_by_another_user(d: &str) {
    assert!(
        as_user(USER_A, "mkdir")
            .args(["-m", "1777", d])
            .status()
            .unwrap()
            .success()
    );
}

/// A fifo at `fifo` whose pipe is full; the reading end, which does not
/// block.
pub(super) fn a_full_fifo(fifo: &std::path::Path) -> std::fs::File {
    nix::unistd::mkfifo(fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    let reader = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo)
            .unwrap()
    };
    {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let mut fill = std::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo)
            .unwrap();
        let block = [b'.'; 4096];
        while fill.write(&block).is_ok() {}
    }
    reader
}

/// Reads all `reader` is given, in a thread, until its writers close it.
pub(super) fn drain_in_a_thread(reader: std::fs::File) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        use std::io::Read;
        let mut reader = reader;
        let mut said = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => said.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(e) => panic!("{e}"),
            }
        }
        String::from_utf8_lossy(&said).into_owned()
    })
}
