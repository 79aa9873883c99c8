//! What a take asks for, checked once: the [`Plan`], built from what a front
//! end asks ([`Plan::new`]: the command line's, or the library's [`Spec`]
//! through [`Plan::from_spec`]), and then looked at against this machine
//! ([`Plan::look`]: the caller's `CUDA_VISIBLE_DEVICES`, MIG, each budget's
//! device). The rules both front ends share live here, in the command line's
//! words (those of the command line alone are `cli::run`'s); both front ends
//! and both backends act on the plan they get.

use std::time::{Duration, Instant};

use crate::gpu::device::DeviceReport;
use crate::gpu::memory;
use crate::resource::Resource;
use anyhow::Result;

/// Which front end a plan is for: the few rules that differ say so here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Front {
    /// `devlock RESOURCE... -- COMMAND`.
    Command,
    /// The library (and the Python package on it).
    Library,
}

/// The locks to take and how, checked.
#[derive(Debug, Clone)]
pub struct Plan {
    pub(crate) front: Front,
    /// Sorted and deduplicated; after [`Plan::look`], `--any`'s candidates
    /// are those inside the caller's `CUDA_VISIBLE_DEVICES`.
    pub resources: Vec<Resource>,
    pub(crate) shared: bool,
    /// `--slots N`.
    pub(crate) slots: Option<u16>,
    pub any: bool,
    /// `--count K` (1 unless given).
    pub count: u8,
    /// `--mem` and its companions.
    pub budget: Option<Budget>,
    /// `--require-idle`: the memory a process outside the gate may hold, MiB.
    pub idle_threshold: Option<u64>,
    /// How long a look at the GPUs may take.
    pub probe_timeout: Duration,
}

/// A memory budget (`--mem`), its sizes read and checked.
#[derive(Debug, Clone)]
pub struct Budget {
    pub mem_mib: u64,
    pub(crate) headroom_mib: u64,
    pub settle: Duration,
    pub strict: bool,
    /// Each candidate's total memory, MiB (learned by [`Plan::look`]).
    pub totals: Vec<(Resource, u64)>,
    /// The probe that learned them, and when (for the first look).
    pub seen: Option<Seen>,
}

/// What to take: the command line's `RESOURCE...` with `--shared`,
/// `--slots N`, `--any`/`--count K` and `--mem`, by the same rules (a
/// member `G:M` also takes its group `G` shared).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// The resources, as the user wrote them (checked as the command line
    /// checks them).
    pub resources: Vec<String>,
    /// `--shared`.
    pub shared: bool,
    /// `--slots N`.
    pub slots: Option<u16>,
    /// `--any`.
    pub any: bool,
    /// `--count K` (with `any`).
    pub count: u8,
    /// `--mem` (the memory budget on `gpu:N`), as the command line's text
    /// (`20GiB`, `512MiB`, a bare number of MiB).
    pub mem: Option<String>,
    /// `--mem-headroom`, as the command line's text.
    pub mem_headroom: Option<String>,
    /// `--settle`.
    pub settle: Option<Duration>,
    /// `--mem-strict`: once over budget for `settle`, the hold's
    /// [`crate::BudgetEvent::Stop`] tells the caller to stop its work.
    pub mem_strict: bool,
    /// `--idle-timeout`: once the hold's GPUs computed nothing for this
    /// long, its [`crate::IdleEvent::Idle`] warns, and after a grace (this
    /// again, at most 10 minutes) its [`crate::IdleEvent::Stop`] tells the
    /// caller to stop its work.
    pub idle_timeout: Option<Duration>,
}

impl Spec {
    /// An exclusive take of every resource named.
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(resources: I) -> Spec {
        Spec {
            resources: resources.into_iter().map(Into::into).collect(),
            shared: false,
            slots: None,
            any: false,
            count: 1,
            mem: None,
            mem_headroom: None,
            settle: None,
            mem_strict: false,
            idle_timeout: None,
        }
    }
}

/// An exclusive take of one resource, as `devlock NAME --` takes it.
impl From<&str> for Spec {
    fn from(resource: &str) -> Spec {
        Spec::new([resource])
    }
}

/// An exclusive take of one resource, as `devlock NAME --` takes it.
impl From<String> for Spec {
    fn from(resource: String) -> Spec {
        Spec::new([resource])
    }
}

/// What a front end asks for, read from its own input (flags or a
/// [`Spec`]), before the rules both share are applied ([`Plan::new`]).
#[derive(Debug)]
pub struct Asks {
    /// As given: [`Plan::new`] sorts them and drops repeats.
    pub resources: Vec<Resource>,
    pub shared: bool,
    pub slots: Option<u16>,
    pub any: bool,
    /// `--count K`, `None` when not given (1).
    pub count: Option<u8>,
    /// `--mem`, MiB.
    pub mem: Option<u64>,
    /// `--mem-headroom`, MiB.
    pub headroom: Option<u64>,
    pub settle: Option<Duration>,
    pub strict: bool,
    /// `--require-idle`'s threshold, MiB.
    pub idle_threshold: Option<u64>,
}

/// A probe's answer and when it came.
pub(crate) type Seen = (Instant, DeviceReport);

/// How long a look at the GPUs may take in the library (the command line's
/// default `--probe-timeout`): only `CUDA_VISIBLE_DEVICES` entries that are
/// UUIDs, and budgets, need one.
pub(crate) const LIBRARY_PROBE_TIMEOUT: Duration = Duration::from_secs(5);

fn usage<T>(message: &str) -> Result<T> {
    Err(crate::error::usage(message.to_owned()))
}

impl Plan {
    /// The plan of what a front end asks for, by the rules both front ends
    /// share (count, slots, budget sizes), in the command line's words.
    pub fn new(asks: Asks, front: Front, probe_timeout: Duration) -> Result<Plan> {
        let Asks {
            mut resources,
            shared,
            slots,
            any,
            count,
            mem,
            headroom,
            settle,
            strict,
            idle_threshold,
        } = asks;
        if resources.is_empty() {
            // The library has no command line whose usage to show.
            return usage(match front {
                Front::Command => {
                    "missing RESOURCE: usage: devlock [OPTIONS] RESOURCE... -- COMMAND..."
                }
                Front::Library => "missing RESOURCE: name at least one resource to lock",
            });
        }
        resources.sort();
        resources.dedup();
        check_count(count.unwrap_or(1), count.is_some(), any, &resources)?;
        check_slots(slots, any, shared, &resources)?;
        let budget = check_budget(&Shape {
            mem,
            headroom,
            settle,
            strict,
            shared,
            slots: slots.is_some(),
            any,
            count: count.unwrap_or(1),
            resources: &resources,
        })?;
        if idle_threshold.is_some()
            && !resources
                .iter()
                .any(|r| crate::gpu::gate::gpu_indices(r, &[]).is_some())
        {
            return usage("--require-idle needs a GPU resource (gpu or gpu:N) to check");
        }
        Ok(Plan {
            front,
            resources,
            shared,
            slots,
            any,
            count: count.unwrap_or(1),
            budget,
            idle_threshold,
            probe_timeout,
        })
    }

    /// The library's plan of `spec`, by the command line's rules and in its
    /// words (the sizes read as `--mem` reads them; the library words its
    /// errors its own way, `messages::in_library_words`).
    pub fn from_spec(spec: &Spec) -> Result<Plan> {
        let names: Vec<std::ffi::OsString> = spec.resources.iter().map(Into::into).collect();
        let mem = spec.mem.as_deref().map(|t| size("--mem", t)).transpose()?;
        let headroom = spec
            .mem_headroom
            .as_deref()
            .map(|t| size("--mem-headroom", t))
            .transpose()?;
        let asks = Asks {
            resources: Resource::parse_all(&names)?,
            shared: spec.shared,
            slots: spec.slots,
            any: spec.any,
            count: (spec.count != 1).then_some(spec.count),
            mem,
            headroom,
            settle: spec.settle,
            strict: spec.mem_strict,
            idle_threshold: None,
        };
        Plan::new(asks, Front::Library, LIBRARY_PROBE_TIMEOUT)
    }

    /// The plan against this machine: the caller's `CUDA_VISIBLE_DEVICES`
    /// (a GPU outside it is a usage error, and `--any` skips the candidates
    /// outside it), one MIG instance per command, and each budget's device
    /// memory, asked once before any wait (in the command line's words).
    pub fn look(&mut self) -> Result<()> {
        let resources = std::mem::take(&mut self.resources);
        self.resources = self.within_visible_devices(resources)?;
        if self.front == Front::Command {
            crate::gpu::cuda::check_mig(&self.resources, self.any, usize::from(self.count))?;
        }
        if let Some(budget) = self.budget.as_mut() {
            let (totals, seen) = totals(
                budget.mem_mib,
                budget.headroom_mib,
                &self.resources,
                self.probe_timeout,
            )?;
            budget.totals = totals;
            budget.seen = Some(seen);
        }
        Ok(())
    }

    fn within_visible_devices(&self, resources: Vec<Resource>) -> Result<Vec<Resource>> {
        if !crate::gpu::cuda::concerns(&resources) {
            return Ok(resources);
        }
        let Some(visible) = crate::gpu::cuda::Visible::from_env(self.probe_timeout)? else {
            return Ok(resources);
        };
        if self.any {
            return visible.filter_candidates(&resources, usize::from(self.count));
        }
        visible.check(&resources)?;
        Ok(resources)
    }

    /// Whether the locks are taken exclusively (a budget takes its device
    /// shared).
    pub fn exclusive(&self) -> bool {
        !self.shared && self.budget.is_none()
    }

    /// The locks every resource stands for, in the one global order (the
    /// etcd backend takes them so).
    pub fn in_order(&self) -> Vec<crate::request::Request> {
        crate::request::in_order(
            &self.resources,
            self.exclusive(),
            u64::from(self.slots.unwrap_or(0)),
        )
    }
}

impl Budget {
    /// What the budget asks of `resource` (`gpu:N`), with the probe's
    /// first answer when it may still stand.
    pub fn ask(
        &self,
        resource: &Resource,
        probe_timeout: Duration,
        seen: Option<Seen>,
    ) -> crate::flock::budget::Ask {
        crate::flock::budget::Ask {
            index: resource.gpu_index().expect("checked: gpu:N"),
            mem_mib: self.mem_mib,
            headroom_mib: self.headroom_mib,
            probe_timeout,
            seen,
        }
    }

    /// The device's total memory for `resource`, MiB (0 when unknown).
    pub fn total(&self, resource: &Resource) -> u64 {
        self.totals
            .iter()
            .find(|(r, _)| r == resource)
            .map_or(0, |(_, t)| *t)
    }
}

/// `--count K` (with `--any`). `given` is whether the caller named a count
/// at all (a count without `--any` says nothing the take could honour).
fn check_count(count: u8, given: bool, any: bool, resources: &[Resource]) -> Result<()> {
    if given && !any {
        return usage(
            "--count needs --any: it says how many of the RESOURCEs --any takes \
             (devlock --any --count 2 gpu:0 gpu:1 gpu:2 -- ...)",
        );
    }
    if count == 0 {
        return usage("--count must be at least 1");
    }
    if any && usize::from(count) > resources.len() {
        return usage(&format!(
            "--count {count} needs at least that many resources after --any, got {}",
            resources.len()
        ));
    }
    Ok(())
}

/// `--slots N`: one resource, a semaphore of at least one slot, neither
/// `--any` nor `--shared`.
fn check_slots(slots: Option<u16>, any: bool, shared: bool, resources: &[Resource]) -> Result<()> {
    match slots {
        Some(0) => usage("--slots must be at least 1"),
        Some(_) if resources.len() != 1 || any || shared => {
            usage("--slots takes exactly one resource, without --any or --shared")
        }
        _ => Ok(()),
    }
}

/// What a budget request is, for the checks `--mem` and its companions get.
#[derive(Debug, Clone, Copy)]
struct Shape<'a> {
    mem: Option<u64>,
    headroom: Option<u64>,
    settle: Option<Duration>,
    strict: bool,
    shared: bool,
    slots: bool,
    any: bool,
    count: u8,
    resources: &'a [Resource],
}

/// `--mem` and its companions: a budget of more than nothing, on `gpu:N`
/// resources only (one, or candidates of `--any`), never with `--shared` or
/// `--slots`.
fn check_budget(shape: &Shape) -> Result<Option<Budget>> {
    let Some(mem) = shape.mem else {
        if shape.headroom.is_some() || shape.settle.is_some() || shape.strict {
            return usage(
                "--mem-headroom, --settle and --mem-strict need --mem: they shape a memory budget",
            );
        }
        return Ok(None);
    };
    if mem == 0 {
        return usage(
            "--mem must be more than 0 (e.g. --mem 20GiB); leave it out for the whole device",
        );
    }
    if shape.shared || shape.slots {
        return usage(
            "--mem cannot be combined with --shared or --slots: a budget already shares the device \
             by memory",
        );
    }
    if let Some(r) = shape.resources.iter().find(|r| r.gpu_index().is_none()) {
        return usage(&format!(
            "--mem budgets one GPU's memory: give gpu:N, not {r} (without --mem, {r} is taken whole)"
        ));
    }
    if !shape.any && shape.resources.len() > 1 {
        return usage("--mem takes one gpu:N, or several candidates with --any");
    }
    if shape.count > 1 {
        return usage("--mem with --any takes one device: --count must be 1");
    }
    Ok(Some(Budget {
        mem_mib: mem,
        headroom_mib: shape
            .headroom
            .unwrap_or(crate::units::DEFAULT_MEM_HEADROOM_MIB),
        settle: shape.settle.unwrap_or(crate::units::DEFAULT_SETTLE),
        strict: shape.strict,
        totals: Vec::new(),
        seen: None,
    }))
}

/// A size as the command line reads `--mem` and `--mem-headroom` (`20GiB`,
/// `512MiB`, `1.5G`, a bare number of MiB), failing in its words.
fn size(flag: &str, text: &str) -> Result<u64> {
    crate::units::parse_mib(text).map_err(|why| {
        crate::error::usage(format!("invalid value '{text}' for '{flag} <SIZE>': {why}"))
    })
}

/// Each candidate's total memory (MiB), asked once before any wait, and
/// the probe's answer (for the first look). A device whose memory cannot
/// be learned is exit 69; a budget that could never fit (more than the
/// device, with the headroom) is a usage error.
fn totals(
    mem: u64,
    headroom: u64,
    resources: &[Resource],
    probe_timeout: Duration,
) -> Result<(Vec<(Resource, u64)>, Seen)> {
    let report = memory::probe(probe_timeout);
    let at = Instant::now();
    let mut totals = Vec::new();
    for resource in resources {
        let index = resource.gpu_index().expect("checked: gpu:N");
        let device = memory::device(&report, index).map_err(crate::error::device)?;
        let total = device.memory_total_mib.unwrap_or(0);
        if mem + headroom > total {
            return Err(crate::error::usage(format!(
                "--mem {} with {} headroom can never fit on {resource}, which has {} in all",
                memory::size(mem),
                memory::size(headroom),
                memory::size(total)
            )));
        }
        totals.push((resource.clone(), total));
    }
    Ok((totals, (at, report)))
}
