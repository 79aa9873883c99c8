//! What a library take holds ([`Hold`]): its locks and budget, which
//! process took it, what a child must inherit to run inside it, and how it
//! lets go (in a forked child, only of the child's copies; past its block
//! while the device is busy, see [`Hold::release_when_device_free`]).

use std::os::fd::{AsRawFd, RawFd};

use crate::api::watch::{Ask, BudgetHeld, BudgetSink, IdleSink, Watching};
use crate::flock::entry::Taken;
use crate::flock::nesting::{self, Inherited};
use crate::flock::record::Record;
use crate::resource::Resource;
use crate::take::{HeldLock, Takes};

/// What this process's tree still uses on one of the hold's GPUs (the one
/// where it uses the most).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StillUsed {
    pub gpu: u32,
    /// MiB; `None` when the driver lists the process without a figure.
    pub mib: Option<u64>,
}

/// What a hold took, and which process took it.
#[derive(Debug)]
pub struct Hold {
    taken: Vec<(Resource, Taken)>,
    /// The resources it is for: what was asked for, or an `--any`'s picks.
    members: Vec<Resource>,
    /// Locks an enclosing hold of this process keeps, passed through.
    passed: Vec<HeldLock>,
    /// A memory budget held (`mem`): its hold is the watch's, let go after
    /// `taken` (the group first, as the command line lets go).
    budget: Option<BudgetHeld>,
    /// Its watch: usage record, idle policy and the budget's watch (none
    /// when everything passed through: the enclosing hold's record counts
    /// it).
    watch: Option<Watching>,
    pid: u32,
    /// Its label, as the take wrote it: what a relabel starts from.
    record: Record,
    probe_timeout: std::time::Duration,
}

impl Hold {
    /// The hold of what `takes` took, for `step`.
    pub(crate) fn new(
        mut taken: Vec<(Resource, Taken)>,
        takes: &Takes,
        step: &str,
        usage: Ask,
    ) -> Hold {
        let mut members = takes.members.clone();
        if takes.count > 0 {
            // An --any's picks: the members taken, not their groups.
            members.extend(
                taken
                    .iter()
                    .filter(|(_, t)| !matches!(t, Taken::Held(h) if h.request.via.is_some()))
                    .filter(|(r, _)| takes.candidates.iter().any(|c| c.name == *r))
                    .map(|(r, _)| r.clone()),
            );
        }
        members.sort();
        members.dedup();
        let budget = takes.budget.as_ref().and_then(|planned| {
            let at = taken.iter().position(|(r, t)| {
                r.gpu_index().is_some() && matches!(t, Taken::Held(h) if h.request.via.is_none())
            })?;
            let Taken::Held(held) = taken.remove(at).1 else {
                unreachable!("matched above")
            };
            Some((held, planned))
        });
        let budget_held = budget.as_ref().map(|(held, planned)| BudgetHeld {
            resource: held.request.name.clone(),
            mem_mib: planned.mem_mib,
            total_mib: planned.total(&held.request.name),
        });
        let own = budget.is_some() || taken.iter().any(|(_, t)| matches!(t, Taken::Held(_)));
        let watch = own.then(|| {
            let ask = Ask {
                mem_mib: budget_held.as_ref().map(|b| b.mem_mib),
                ..usage
            };
            Watching::start(members.clone(), step, ask, budget)
        });
        Hold {
            taken,
            members,
            passed: takes.passed.clone(),
            budget: budget_held,
            watch,
            pid: std::process::id(),
            record: Record::for_this_process(step),
            probe_timeout: takes.probe_timeout,
        }
    }

    /// The resources it is for that map to GPUs.
    pub(crate) fn gpu_resources(&self) -> Vec<Resource> {
        self.members
            .iter()
            .filter(|r| crate::gpu::gate::gpu_indices(r, &[]).is_some())
            .cloned()
            .collect()
    }

    /// How long a driver query may take for it.
    pub(crate) fn probe_timeout(&self) -> std::time::Duration {
        self.probe_timeout
    }

    /// Labels every lock it holds as kept past its block's end (since
    /// `ended_ms`, still using what `used` says; it counts as idle since
    /// then), or with `None` as held again.
    pub(crate) fn mark_kept(&self, kept: Option<(u64, StillUsed)>) {
        let mut record = self.record.clone();
        if let Some((ended_ms, used)) = kept {
            record.kept_ms = Some(ended_ms);
            record.kept_mib = used.mib;
            record.kept_gpu = Some(used.gpu);
            record.idle_since_ms = Some(ended_ms);
        }
        for (_, taken) in &self.taken {
            if let Taken::Held(held) = taken {
                let _ = held.label(&record);
            }
        }
        if let Some(w) = &self.watch {
            w.set_kept(kept.map(|(ended_ms, _)| ended_ms));
            w.with_budget(|held| held.label(&record));
        }
    }

    /// Where the idle policy (`idle_timeout`) says what it has to say, on
    /// the usage thread; what it said before this call is passed on at once.
    pub fn on_idle_event(&self, sink: IdleSink) {
        if let Some(w) = &self.watch {
            w.on_idle_event(sink);
        }
    }

    /// With `idle_timeout`: the line that said stop, once the policy said it.
    pub fn stopped_idle(&self) -> Option<String> {
        self.watch.as_ref().and_then(Watching::stopped_idle)
    }

    /// The memory budget this hold keeps (`mem`), MiB; `None` without one
    /// (or when it passed through an enclosing hold).
    pub fn budget_mib(&self) -> Option<u64> {
        self.budget.as_ref().map(|b| b.mem_mib)
    }

    /// What the work inside a budget learns, as a command under `devlock
    /// --mem` does: `DEVLOCK_MEM_MIB`, and `XLA_PYTHON_CLIENT_MEM_FRACTION`
    /// (the budget's share of the device) unless the process has it set
    /// already. Empty without a budget.
    pub fn budget_env(&self) -> Vec<(String, String)> {
        self.budget
            .as_ref()
            .map(BudgetHeld::env)
            .unwrap_or_default()
    }

    /// Where the budget's watch says what it has to say (over budget; with
    /// `mem_strict`, stop), on the watch's thread; what it said before this
    /// call is passed on at once. Nothing without a budget.
    pub fn on_budget_event(&self, sink: BudgetSink) {
        if let Some(w) = self.watch.as_ref().filter(|_| self.budget.is_some()) {
            w.on_budget_event(sink);
        }
    }

    /// With `mem_strict`: the line that said stop, once the watch said it.
    pub fn stopped_over_budget(&self) -> Option<String> {
        self.watch.as_ref().and_then(Watching::stopped_over_budget)
    }

    /// The resources this hold is for: what was asked for, or an `--any`'s picks.
    pub fn resources(&self) -> Vec<String> {
        self.members.iter().map(Resource::to_string).collect()
    }

    /// Every lock it keeps or passed through, for takes inside it.
    pub fn locks(&self) -> Vec<HeldLock> {
        let mut locks = self.passed.clone();
        if let Some(b) = &self.budget {
            locks.push(HeldLock {
                resource: b.resource.to_string(),
                exclusive: false,
            });
        }
        for (resource, taken) in &self.taken {
            let exclusive = match taken {
                Taken::Held(held) => held.request.exclusive && held.request.slots == 0,
                Taken::Inherited(lock) => nesting::inherited(lock, true) == Inherited::Yes,
            };
            locks.push(HeldLock {
                resource: resource.to_string(),
                exclusive,
            });
        }
        locks
    }

    /// The descriptors a child process must inherit to run inside this hold
    /// (`devlock` passes through only on an inherited descriptor that holds
    /// the lock): the lock files, the slot, a shared holder's label, and
    /// for a lock this process itself runs inside, the descriptors it
    /// inherited.
    pub fn fds(&self) -> Vec<RawFd> {
        let mut fds = Vec::new();
        for (_, taken) in &self.taken {
            match taken {
                Taken::Held(held) => {
                    fds.extend(held.inheritable_fds().iter().map(AsRawFd::as_raw_fd));
                }
                Taken::Inherited(lock) => fds.extend(nesting::inherited_fds(lock)),
            }
        }
        if let Some(w) = &self.watch {
            fds.extend(
                w.with_budget(|held| {
                    held.inheritable_fds()
                        .iter()
                        .map(AsRawFd::as_raw_fd)
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default(),
            );
        }
        fds
    }

    /// The semaphore slot (`--slots`), from 1.
    pub fn slot(&self) -> Option<u64> {
        self.taken.iter().find_map(|(_, t)| match t {
            Taken::Held(held) => held.slot().map(|s| s.number),
            Taken::Inherited(_) => None,
        })
    }

    /// `CUDA_VISIBLE_DEVICES` for this hold, as the command line sets it for
    /// its command (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`): the indices of its
    /// `gpu:N` resources; `None` when it holds none.
    pub fn cuda_visible_devices(&self) -> Option<String> {
        crate::gpu::cuda::child_env(&self.members)
            .into_iter()
            .find(|(name, _)| *name == "CUDA_VISIBLE_DEVICES")
            .map(|(_, value)| value)
    }

    /// Whether this hold took nothing of its own (everything passed through).
    pub fn is_nested(&self) -> bool {
        self.budget.is_none()
            && self
                .taken
                .iter()
                .all(|(_, t)| matches!(t, Taken::Inherited(_)))
    }

    /// The process that took it.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether this process holds it now, asked of the kernel: each lock's
    /// descriptor is open here, on the same file, with the lock granted (a
    /// forked child that closed its descriptors does not).
    pub fn holds_here(&self) -> bool {
        let budget_here = self.budget.is_none()
            || self
                .watch
                .as_ref()
                .and_then(|w| {
                    w.with_budget(|held| {
                        nesting::fd_holds(held.lock().file().as_raw_fd(), held.lock())
                    })
                })
                .unwrap_or(false);
        budget_here
            && self.taken.iter().all(|(_, taken)| match taken {
                Taken::Held(held) => nesting::fd_holds(held.lock().file().as_raw_fd(), held.lock()),
                Taken::Inherited(lock) => nesting::inherited(lock, false) != Inherited::No,
            })
    }

    /// Lets go: in the process that took it, the label is cleared and the
    /// lock released (unless a forked child or a command still has a
    /// descriptor to it); in a forked child, only the child's copies of the
    /// descriptors are closed: the label, the place in line and the hold
    /// stay with whoever still has them.
    pub fn release(self) {
        drop(self);
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if std::process::id() == self.pid {
            // The holds' own Drop lets go, in the command line's order (the
            // group, then the budget's device, which the watch lets go once
            // it stopped), then the end line, off the hand-off's path.
            drop(std::mem::take(&mut self.taken));
            drop(self.watch.take());
            return;
        }
        // A forked child: the watch closes its copy of the budget's hold.
        drop(self.watch.take());
        for (_, taken) in self.taken.drain(..) {
            match taken {
                Taken::Held(held) => held.close_copy(),
                Taken::Inherited(lock) => drop(lock),
            }
        }
    }
}
