//! devlock's kernel-facing core: the lock directory and its files, flock(2)
//! and the wait in line, /proc, the GPUs and their memory budgets, usage
//! records, the plan of a take and its typed errors, all as data: no words
//! for people, no screen, no command line (the devlock crate's front ends
//! word and draw what this returns). Not a stable API: it is public for the
//! devlock crate alone.

pub mod error;
pub mod flock;
pub mod gpu;
pub mod hold_event;
pub mod hold_watch;
pub mod interrupt;
pub mod job_env;
pub mod names;
pub mod plan;
pub mod proc;
pub mod request;
pub mod resource;
pub mod show;
pub mod sys;
pub mod take;
pub mod units;
pub mod usage;
pub mod view;
pub mod walk;
