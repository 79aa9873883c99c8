//! The lock families: each lock's state, holders and line, and each holder's
//! and waiter's times, budget, idle time and GPU memory.

use super::families::{
    HOLDER_BUDGET, HOLDER_GPU_USED, HOLDER_HELD, HOLDER_IDLE, HOLDER_OVER_BUDGET, LOCK_HOLDERS,
    LOCK_STATE, LOCK_WAITERS, WAITER_WAITING,
};
use super::{Exposition, bytes, flag, pid, seconds, text};
use crate::serve::state_name;
use crate::view::{ResourceView, State};

/// The lock families, in the order they are listed.
pub(super) fn locks(out: &mut Exposition, resources: &[ResourceView]) {
    const STATES: [State; 4] = [State::Free, State::Held, State::Shared, State::Unknown];
    out.family(
        &LOCK_STATE,
        resources
            .iter()
            .flat_map(|r| {
                STATES.iter().map(move |s| {
                    (
                        vec![r.name.clone(), state_name(*s).to_owned()],
                        flag(r.state == *s),
                    )
                })
            })
            .collect(),
    );
    out.family(
        &LOCK_HOLDERS,
        resources
            .iter()
            .map(|r| (vec![r.name.clone()], r.holders.len() as f64))
            .collect(),
    );
    out.family(
        &LOCK_WAITERS,
        resources
            .iter()
            .map(|r| (vec![r.name.clone()], r.waiters.len() as f64))
            .collect(),
    );
    holders(out, resources);
}

/// Each holder's and waiter's families (the waiters' after the holders'
/// held time, as the families are listed).
fn holders(out: &mut Exposition, resources: &[ResourceView]) {
    let holders = || {
        resources
            .iter()
            .flat_map(|r| r.holders.iter().map(move |h| (r, h)))
    };
    let who = |r: &ResourceView, h: &crate::view::Holder| {
        vec![
            r.name.clone(),
            text(h.step.as_deref()),
            text(h.user.as_deref()),
            pid(h.pid),
        ]
    };
    out.family(
        &HOLDER_HELD,
        holders()
            .map(|(r, h)| {
                let mut labels = who(r, h);
                labels.push(text(h.via.as_deref()));
                (labels, seconds(h.held_for_ms))
            })
            .collect(),
    );
    out.family(
        &WAITER_WAITING,
        resources
            .iter()
            .flat_map(|r| r.waiters.iter().map(move |w| (r, w)))
            .map(|(r, w)| {
                (
                    vec![
                        r.name.clone(),
                        text(w.step.as_deref()),
                        text(w.user.as_deref()),
                        pid(w.pid),
                        w.position.to_string(),
                    ],
                    seconds(w.waiting_for_ms),
                )
            })
            .collect(),
    );
    out.family(
        &HOLDER_BUDGET,
        holders()
            .filter_map(|(r, h)| Some((who(r, h), bytes(Some(h.mem_mib?)))))
            .collect(),
    );
    out.family(
        &HOLDER_OVER_BUDGET,
        holders()
            .filter_map(|(r, h)| Some((who(r, h), flag(h.over_budget?))))
            .collect(),
    );
    out.family(
        &HOLDER_IDLE,
        holders()
            .filter_map(|(r, h)| Some((who(r, h), h.idle_for_ms? as f64 / 1000.0)))
            .collect(),
    );
    out.family(
        &HOLDER_GPU_USED,
        holders()
            .flat_map(|(r, h)| {
                h.devices.iter().map(move |d| {
                    let mut labels = who(r, h);
                    labels.push(d.index.to_string());
                    (labels, bytes(d.used_mib))
                })
            })
            .collect(),
    );
}
