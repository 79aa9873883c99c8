//! The system interface: the only layer with `unsafe`. Each call that nix
//! covers goes through nix; what it does not cover (OFD byte-range locks,
//! flock(2) without nix's unlocking `Drop`, the watcher's double fork, the
//! exec that passes the environment on by pointer, POSIX timers aimed at
//! one thread, pidfds, NVML loaded with dlopen) is a thin
//! wrapper here, each `unsafe` block with the reason it is sound.
//! Everything above works on owned descriptors and safe types.

// The one layer allowed it (see Cargo.toml's [lints]).
#![allow(unsafe_code)]

pub mod args;
#[cfg(any(test, feature = "testing"))]
pub mod env;
pub mod exec;
pub mod fds;
pub mod fs;
pub mod listing;
pub(crate) mod nvml;
pub mod process;
pub(crate) mod random;
pub mod signal;
pub mod tty;
