//! The library façade: what a Rust program (and the bindings built on it)
//! takes, over the same files, line and rules as the command line.

mod budget;
mod lock;
mod take;

pub use budget::{BudgetEvent, BudgetSink};
pub use lock::{Guard, Lock, Options, Wait};
pub use take::{
    Acquiring, Busy, HeldLock, Hold, Holder, NotSupported, Spec, exit_code, status_document,
};
