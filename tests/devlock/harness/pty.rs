//! A pseudo-terminal the tests play the user's terminal with.

use super::*;

/// A pseudo-terminal of a set width, with a process started as the leader
/// of a new session that has it as its controlling terminal (as a terminal
/// emulator starts a shell). Everything written to it is collected.
pub struct Pty {
    master: std::fs::File,
    slave: std::os::fd::OwnedFd,
    output: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Pty {
    pub fn new(columns: u16) -> Pty {
        use std::os::fd::FromRawFd;
        let (mut master, mut slave) = (0, 0);
        // SAFETY: openpty fills two descriptors we then own.
        let ok = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(ok, 0, "openpty");
        // SAFETY: descriptors openpty just gave us.
        let (master, slave) = unsafe {
            (
                std::fs::File::from_raw_fd(master),
                std::os::fd::OwnedFd::from_raw_fd(slave),
            )
        };
        let pty = Pty {
            master,
            slave,
            output: Default::default(),
        };
        pty.resize(columns);
        let mut reader = pty.master.try_clone().unwrap();
        let output = pty.output.clone();
        std::thread::spawn(move || {
            use std::io::Read;
            let mut buf = [0u8; 4096];
            // Ends with EIO once no process has the terminal open.
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                output.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        pty
    }

    /// Sets the width (the kernel sends SIGWINCH to the foreground group).
    pub fn resize(&self, columns: u16) {
        use std::os::fd::AsRawFd;
        let size = libc::winsize {
            ws_row: 24,
            ws_col: columns,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one winsize.
        let set = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
        assert_eq!(set, 0);
    }

    /// Starts `cmd` on the terminal, in a session of its own.
    pub fn spawn(&self, cmd: &mut Command) -> Child {
        use std::os::unix::process::CommandExt;
        let io = || Stdio::from(self.slave.try_clone().unwrap());
        cmd.stdin(io()).stdout(io()).stderr(io());
        // SAFETY: only async-signal-safe calls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().unwrap()
    }

    /// Types `bytes` (`b"\x03"` is Ctrl-C, `b"\x1a"` Ctrl-Z).
    pub fn type_in(&self, bytes: &[u8]) {
        use std::io::Write;
        (&self.master).write_all(bytes).unwrap();
    }

    /// Narrows the terminal to `columns` (the kernel tells the foreground
    /// group with SIGWINCH) and waits until a live line is drawn again,
    /// narrower than that.
    pub fn narrowed_and_redrawn(&self, columns: u16) {
        let mark = self.output().len();
        self.resize(columns);
        self.wait_until(&format!("a line redrawn to {columns} columns"), |out| {
            out[mark..].split("\r\x1b[K").skip(1).any(|line| {
                !line.is_empty() && devlock::testing::text::columns(line) < usize::from(columns)
            })
        });
    }

    /// Everything the terminal was sent so far.
    pub fn output(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).into_owned()
    }

    /// Waits until the output holds `needle`; returns all of it.
    pub fn wait_for(&self, needle: &str) -> String {
        self.wait_until(needle, |out| out.contains(needle))
    }

    /// Waits until `ok` holds for the output; returns all of it.
    pub fn wait_until(&self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let out = self.output();
            if ok(&out) {
                return out;
            }
            assert!(
                start.elapsed() < HANG,
                "the terminal never showed {what:?}; it shows {out:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
