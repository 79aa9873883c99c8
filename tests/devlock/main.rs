//! devlock's integration tests: real processes, signals, files and flock.

// The tests play the terminal, the attacker and the signal sender with raw
// calls (openpty, kill, setsid); the crate's own `unsafe` is in src/sys/.
#![allow(unsafe_code)]
// A test binary: its modules' items are for each other.
#![allow(unreachable_pub)]

mod harness;

mod core;
mod devices;
mod display;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
mod etcd_server;
mod generated;
mod granularity;
mod manners;
mod shared_machine;
mod signals;
mod status;
mod torture;
