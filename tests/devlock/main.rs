//! devlock's integration tests: real processes, signals, files and flock.

mod harness;

mod core;
mod devices;
mod generated;
mod granularity;
mod status;
mod torture;
