//! The library façade: what a Rust program (and the bindings built on it)
//! takes, over the same files, line and rules as the command line.

mod lock;

pub use lock::{Guard, Lock, Options, Wait};
