//! One take for both front ends: a [`Plan`]'s locks in the one global order
//! (a member `G:M` with its group `G` shared), `--any`'s picks and `--mem`
//! budgets, taken by the flock backend with the caller's observer; a busy
//! lock comes back as the backend's typed busy, which the front ends word
//! (the devlock crate's `messages::worded`).

use anyhow::Result;

use crate::error::{Busy, Holder};
use crate::flock::entry::{Context, Taken};
use crate::flock::in_the_way::InTheWay;
use crate::plan::{Budget, Plan, Seen};
use crate::request::Request;
use crate::resource::Resource;
use crate::view as status;

/// One lock an enclosing hold keeps or passed through: a take made inside
/// that hold by this process passes through it instead of waiting for
/// itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLock {
    /// The lock's resource (a group taken on a member's behalf is one too).
    pub resource: String,
    /// Held exclusively (a `--slots` or `--shared` hold is not).
    pub exclusive: bool,
}

/// The requests a plan stands for, in the one global order, less what an
/// enclosing hold covers.
#[derive(Debug, Clone)]
pub struct Takes {
    /// Taken in order, each waiting in its line.
    pub(crate) fixed: Vec<Request>,
    /// `--any`'s candidates (not passed through), and how many to pick.
    pub candidates: Vec<Request>,
    pub count: usize,
    /// The resources asked for, or an `--any`'s picks that passed through.
    pub members: Vec<Resource>,
    /// What an enclosing hold covers.
    pub passed: Vec<HeldLock>,
    /// A memory budget on the one `gpu:N` of `fixed`, or on each candidate.
    pub budget: Option<Budget>,
    pub probe_timeout: std::time::Duration,
}

impl Takes {
    /// The takes of `plan` for `resources` (its resources, or with `--any
    /// --require-idle` the idle ones among them), leaving out what an
    /// enclosing hold in `inside` covers.
    pub fn new(plan: &Plan, resources: &[Resource], inside: &[HeldLock]) -> Result<Takes> {
        let exclusive = plan.exclusive();
        let slots = u64::from(plan.slots.unwrap_or(0));
        let mut takes = Takes {
            fixed: Vec::new(),
            candidates: Vec::new(),
            count: 0,
            members: Vec::new(),
            passed: Vec::new(),
            budget: plan.budget.clone(),
            probe_timeout: plan.probe_timeout,
        };
        if plan.any {
            let mut count = usize::from(plan.count);
            for resource in resources {
                let request = Request {
                    name: resource.clone(),
                    exclusive,
                    via: None,
                    slots,
                    for_group: false,
                };
                // A candidate an enclosing hold keeps is a pick that passes through.
                if count > 0 && covered(&request, inside)? {
                    count -= 1;
                    takes.passed.push(HeldLock {
                        resource: resource.to_string(),
                        exclusive: exclusive && slots == 0,
                    });
                    takes.members.push(resource.clone());
                } else {
                    takes.candidates.push(request);
                }
            }
            takes.count = count;
            return Ok(takes);
        }
        for request in crate::request::in_order(resources, exclusive, slots) {
            if covered(&request, inside)? {
                takes.passed.push(HeldLock {
                    resource: request.name.to_string(),
                    exclusive: request.exclusive && request.slots == 0,
                });
            } else {
                takes.fixed.push(request);
            }
        }
        takes.members = resources.to_vec();
        Ok(takes)
    }

    /// What the waiting lines call the whole take, before any wait names a part.
    pub fn label(&self) -> String {
        match self.fixed.last() {
            Some(last) => last.label(),
            None => {
                let names: Vec<&str> = self.candidates.iter().map(|r| r.name.as_str()).collect();
                format!("any of {}", names.join(" "))
            }
        }
    }

    /// Takes every lock, in order, each in its line (a budget's `gpu:N` by
    /// admission), then `--any`'s picks; `seen` is the probe's first answer
    /// for a budget's first look. With `label`, each lock is labelled with
    /// this process's record as soon as it is held. A lock that is busy for
    /// a take that may not wait is a [`Busy`] with what is in the way, as
    /// data (a member taken for its group's take names the group): the
    /// front ends word it.
    pub fn take(
        &self,
        ctx: &Context,
        seen: Option<Seen>,
        label: bool,
    ) -> Result<Vec<(Resource, Taken)>> {
        let labelled = |took: &Taken| {
            if let (true, Taken::Held(held)) = (label, took) {
                held.label(&ctx.record());
            }
        };
        let mut taken = Vec::new();
        for request in &self.fixed {
            let took = match &self.budget {
                Some(b) if request.via.is_none() => self.admit(ctx, request, b, seen.clone()),
                _ => crate::flock::take::take(ctx, request),
            }?;
            ctx.observer.took()?;
            labelled(&took);
            let whole_group = request.exclusive && request.slots == 0 && request.via.is_none();
            let held = matches!(took, Taken::Held(_));
            taken.push((request.name.clone(), took));
            // A name with a colon is a member, never a group: no look at
            // the directory on the common `gpu:N` path.
            if whole_group && held && request.name.group().is_none() {
                taken.extend(take_members(ctx, &request.name, &labelled)?);
            }
        }
        if self.count == 0 {
            return Ok(taken);
        }
        for (name, took) in self.pick(ctx, seen)? {
            labelled(&took);
            taken.push((name, took));
        }
        Ok(taken)
    }

    // The budget's and `--any`'s takes are out of line (as is
    // `take_members`): inlined, they made this function 31 kB, most of it
    // among the code every take runs, which a waiting devlock keeps
    // resident (bench/run, section 5).

    /// A budget's `gpu:N`, by admission.
    #[inline(never)]
    fn admit(
        &self,
        ctx: &Context,
        request: &Request,
        budget: &Budget,
        seen: Option<Seen>,
    ) -> Result<Taken> {
        let ask = budget.ask(&request.name, self.probe_timeout, seen);
        crate::flock::budget::admit::take(ctx, request, &ask)
    }

    /// `--any`'s picks.
    #[inline(never)]
    fn pick(&self, ctx: &Context, seen: Option<Seen>) -> Result<Vec<(Resource, Taken)>> {
        match &self.budget {
            Some(b) => {
                let asks: Vec<_> = self
                    .candidates
                    .iter()
                    .map(|r| {
                        let ask = b.ask(&r.name, self.probe_timeout, seen.clone());
                        (r.clone(), ask)
                    })
                    .collect();
                crate::flock::budget::admit::take_any(ctx, &asks)
            }
            None => crate::flock::any::take_any(ctx, &self.candidates, self.count),
        }
    }
}

/// After a whole group (`gpu`) is held exclusively, each of its members'
/// lock files there is (`gpu:0.lock`, ...) taken exclusively too, in
/// order: no devlock can hold a member without holding its group shared,
/// so what a member's file can still be held by is plain util-linux
/// flock, whose holder the group's request then waits for (or, with `-n`,
/// names) as a member's request waits for a group's holder.
#[inline(never)]
fn take_members(
    ctx: &Context,
    group: &Resource,
    labelled: &dyn Fn(&Taken),
) -> Result<Vec<(Resource, Taken)>> {
    let mut members: Vec<Resource> = ctx
        .dir
        .entries_starting_with(&format!("{}:", group.as_str()))?
        .iter()
        .filter_map(|name| Resource::from_file_name(name))
        .filter(|r| r.group().as_ref() == Some(group))
        .collect();
    members.sort();
    let mut taken = Vec::new();
    for member in members {
        let request = Request {
            name: member.clone(),
            exclusive: true,
            via: None,
            slots: 0,
            for_group: true,
        };
        let took = crate::flock::take::take(ctx, &request).map_err(|mut e| {
            // Busy: the front ends word it in the group's words.
            if let Some(busy) = e.downcast_mut::<Busy>()
                && let InTheWay::Lock {
                    group: taken_for, ..
                } = &mut *busy.in_the_way
            {
                *taken_for = Some(group.clone());
            }
            e
        })?;
        ctx.observer.took()?;
        labelled(&took);
        taken.push((member, took));
    }
    Ok(taken)
}

/// Whether an enclosing hold of this process covers `request`: the same
/// lock held in a mode at least as strong, or the request's group held
/// exclusively. The same lock held only shared while this asks for it
/// exclusively is refused: waiting would wait for ourselves.
fn covered(request: &Request, inside: &[HeldLock]) -> Result<bool> {
    let wants_exclusive = request.exclusive && request.slots == 0;
    let group_exclusive = request.name.group().is_some_and(|g| {
        inside
            .iter()
            .any(|h| h.exclusive && h.resource == g.as_str())
    });
    if group_exclusive {
        return Ok(true);
    }
    match inside.iter().find(|h| h.resource == request.name.as_str()) {
        None => Ok(false),
        Some(h) if h.exclusive || !wants_exclusive => Ok(true),
        Some(_) => Err(crate::flock::nesting::held_only_shared_here(&request.name)),
    }
}

/// Who holds a lock, as a [`Busy`] names them.
pub fn holder_of(h: &status::Holder) -> Holder {
    Holder {
        step: h.step.clone(),
        pid: h.pid,
        user: h.user.clone(),
    }
}
