//! The system interface: the only layer with `unsafe`. Each call that nix
//! covers goes through nix; what it does not cover (OFD byte-range locks,
//! flock(2) without nix's unlocking `Drop`, posix_spawn with a terminal hand
//! over, POSIX timers aimed at one thread, pidfds) is a thin wrapper here,
//! each `unsafe` block with the reason it is sound. Everything above works
//! on owned descriptors and safe types.

pub(crate) mod procfs;
