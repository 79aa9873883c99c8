//! What stands in the way of a take that may not wait, as the backend finds
//! it: the data the one [`Busy`] carries ([`Busy::in_the_way`]), made here
//! with a plain line (`gpu:0 is busy`) that the front ends word in full.

use std::sync::Arc;

use crate::error::{Backend, Busy, Locks};
use crate::flock::file::LockFile;
use crate::flock::wait::RoomNote;
use crate::request::Request;
use crate::resource::Resource;

/// Who or what keeps a take out, as data. The open lock files are shared
/// ([`Arc`]: a [`Busy`] is cloned by the library and by Python): a front
/// end reads through them who holds the lock (`view::describe`), without
/// opening its path again.
#[derive(Debug, Clone, Default)]
pub enum InTheWay {
    /// Nothing more than its line says: a lock devlock did not take (a
    /// stranger's byte lock on a line, a file lease: the line names it and
    /// its owner), a wait that ran out of time (the line names who was in
    /// the way as the wait last saw it), a busy etcd lock, `forget`'s.
    #[default]
    Said,
    /// One lock is held, or has others ahead in line: its lock file (the
    /// take is out of line), to name who. `budget`: a budget's request,
    /// which names a job still starting under its budget. `group`: the
    /// group a member was taken for, on behalf of that group's exclusive
    /// take (worded in the group's words).
    Lock {
        request: Request,
        lock: Arc<LockFile>,
        budget: bool,
        group: Option<Resource>,
    },
    /// `--any`: every candidate, and for each the label, lock and file of
    /// what stands in its way (its group's, or its own).
    Any {
        names: Vec<String>,
        each: Vec<(String, Resource, Arc<LockFile>)>,
    },
    /// `--mem`: no room for the budget, in figures; the one device's lock,
    /// or none for `--any`'s candidates (`names`).
    NoRoom {
        figures: Vec<RoomNote>,
        lock: Option<(Request, Arc<LockFile>)>,
        names: Vec<String>,
    },
}

/// What a [`Busy`] carries is this module's type: the error module, which
/// every module below the locks imports, names it through [`Backend`].
impl Backend for Locks {
    type InTheWay = InTheWay;
}

impl InTheWay {
    /// The busy error of a take that may not wait, with this as what is in
    /// the way and a plain line (`gpu:0 is busy`, `all of gpu:0, gpu:1 are
    /// busy`) that the front ends word with who is in the way.
    pub(crate) fn busy(self) -> anyhow::Error {
        let resource = match &self {
            InTheWay::Lock { request, .. }
            | InTheWay::NoRoom {
                lock: Some((request, _)),
                ..
            } => request.name.to_string(),
            InTheWay::Any { names, .. } | InTheWay::NoRoom { names, .. } => names.join(" "),
            InTheWay::Said => String::new(),
        };
        let message = match &self {
            InTheWay::Lock { request, .. } => format!("{} is busy", request.name),
            InTheWay::Any { names, .. } | InTheWay::NoRoom { names, .. } if !names.is_empty() => {
                format!("all of {} are busy", names.join(", "))
            }
            _ => "busy".to_owned(),
        };
        anyhow::Error::new(Busy {
            resource,
            holder: None,
            timed_out: false,
            message,
            in_the_way: Box::new(self),
        })
    }
}
