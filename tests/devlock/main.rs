//! devlock's integration tests: real processes, signals, files and flock.

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
