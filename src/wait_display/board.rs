//! What a wait shows: who stands in the way of each lock waited for, as
//! the waiting line and the timeout say it, and the board the library's
//! waits post it on.

use std::sync::Mutex;
use std::time::Duration;

use anyhow::Result;

use crate::error::Busy;
use crate::flock::wait::{Observer, Wait, Watch};
use crate::interrupt::Stop;
use crate::messages::busy::{holders_words, in_the_way, waiters_words};
use crate::show::sanitize;
use crate::text::{fit, ordinal, short_duration};
use crate::view::{self as status, ResourceView, WaiterView};

/// The figures a budget waits on, once it has looked.
pub(super) fn room_text(watch: &Watch) -> Option<String> {
    let note = watch.room.as_ref()?.lock().ok()?.clone();
    let text = crate::messages::busy::room_note(&note);
    (!text.is_empty()).then_some(text)
}

/// The figures without the resource's name in front, where the line has
/// named it already.
pub(super) fn unnamed<'t>(watch: &Watch, room: &'t str) -> &'t str {
    room.strip_prefix(watch.resource.as_str())
        .and_then(|r| r.strip_prefix(": "))
        .unwrap_or(room)
}

/// Who stands in the way of one watched lock, as of now.
pub(super) struct Seen {
    view: ResourceView,
    /// Registered waiters ahead of us in line, nearest the front first.
    ahead: Vec<WaiterView>,
    /// 1 for the first in line.
    place: Option<usize>,
}

/// How far back in line a waiting line still names who is ahead. Naming
/// them reads every registration ahead (and each waiter's descriptors):
/// in a line of hundreds each waiter's look cost as much as the line is
/// long, and all of them starting together kept the machine busy for a
/// minute. Further back, the line says the holder and the place.
pub(super) const NAMES_AHEAD_UP_TO: usize = 16;

/// Who stands in the way of `watch` now; `bounded`: for a waiting line,
/// naming who is ahead only within [`NAMES_AHEAD_UP_TO`] (a timeout's
/// message, said once, names them from any place).
pub(super) fn seen(watch: &Watch, bounded: bool) -> Seen {
    let place = watch.ticket.and_then(|ticket| {
        let name = watch.resource.file_name();
        crate::flock::queue::count_ahead(&watch.dir, &name, ticket)
            .ok()
            .map(|n| n + 1)
    });
    // Naming who is ahead needs the registrations; only read them when
    // somebody is.
    if place.is_some_and(|p| p > 1 && (!bounded || p <= NAMES_AHEAD_UP_TO + 1)) {
        let view =
            status::describe_in_line(&watch.lock, &watch.dir, &watch.resource, watch.agreement);
        let me = std::process::id();
        let ahead: Vec<WaiterView> = match view.waiters.iter().position(|w| w.pid == Some(me)) {
            Some(mine) => view.waiters[..mine].to_vec(),
            None => view
                .waiters
                .iter()
                .take(place.unwrap_or(1) - 1)
                .cloned()
                .collect(),
        };
        return Seen { view, ahead, place };
    }
    Seen {
        view: status::describe_holders(&watch.lock, &watch.dir, &watch.resource, watch.agreement),
        ahead: Vec::new(),
        place,
    }
}

#[derive(Debug)]
pub(super) struct Shown {
    pub(super) label: String,
    pub(super) watches: Vec<Watch>,
}

/// What a wait that its caller shows (the library's, for the Python
/// package) waits for now: posted by the take with handles of its own, read
/// on another thread by whoever draws the line, in the command line's words.
#[derive(Debug, Default)]
pub(crate) struct Board(Mutex<Option<Shown>>);

impl Board {
    pub(super) fn shown(&self) -> std::sync::MutexGuard<'_, Option<Shown>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A wait begins: what it is for and the handles to watch it with.
    pub(super) fn post(&self, label: String, watches: Vec<Watch>) {
        *self.shown() = Some(Shown { label, watches });
    }

    /// The wait is over.
    pub(super) fn clear(&self) {
        *self.shown() = None;
    }

    /// The label of the wait now.
    pub(crate) fn label(&self) -> Option<String> {
        self.shown().as_ref().map(|s| s.label.clone())
    }

    /// The command line's waiting line for the wait now, after `waited`:
    /// with `width`, as drawn on a terminal line of its own (fitted, no
    /// step); without, as a log line, naming `step`.
    pub(crate) fn line(
        &self,
        waited: Duration,
        step: &str,
        width: Option<usize>,
    ) -> Option<String> {
        let shown = self.shown();
        let shown = shown.as_ref()?;
        let parts = shown.parts(waited, width.is_none().then_some(step));
        let parts: Vec<(&str, bool)> = parts.iter().map(|(p, s)| (p.as_str(), *s)).collect();
        Some(match width {
            Some(width) => fit(&parts, width.saturating_sub(1).max(1)),
            None => parts.iter().map(|(p, _)| *p).collect(),
        })
    }

    /// For a timeout: the label, what stands in the way as the command
    /// line's timeout words it, the first holder in the way, and the lock
    /// waited for (the label, when several are).
    pub(crate) fn in_the_way(&self) -> Option<(String, String, Option<status::Holder>, String)> {
        let shown = self.shown();
        let shown = shown.as_ref()?;
        let (holder, resource) = shown.first_in_the_way();
        Some((shown.label.clone(), shown.in_the_way(), holder, resource))
    }
}

impl Observer for Board {
    fn shows(&self) -> bool {
        true
    }

    fn wait(&self, wait: Wait, _stop: &Stop, block: &mut dyn FnMut() -> Result<()>) -> Result<()> {
        self.post(wait.label, wait.watches);
        let result = block();
        self.clear();
        drop(wait.registrations);
        result
    }
}

impl Shown {
    /// The waiting line in parts: what the line may shrink (who is in the
    /// way) and what it keeps (how long, which place, whose step).
    pub(super) fn parts(&self, waited: Duration, step: Option<&str>) -> Vec<(String, bool)> {
        let mut parts = vec![(
            format!(
                "devlock: {} · waiting {}",
                self.label,
                short_duration(waited)
            ),
            false,
        )];
        match &self.watches[..] {
            [] => {}
            [watch] => {
                let seen = seen(watch, true);
                if let Some(room) = room_text(watch) {
                    parts.push((format!(" · {}", unnamed(watch, &room)), true));
                } else if let Some(h) = seen.view.holders.first() {
                    let ancestor = if h.pid.is_some_and(is_ancestor) {
                        " — an ancestor of this devlock: if it is the job this runs in, it did \
                         not pass its lock down (Python: close_fds=False) and this wait will \
                         not end"
                    } else {
                        ""
                    };
                    parts.push((
                        format!(" for {}{ancestor}", holders_words(&seen.view)),
                        true,
                    ));
                }
                if let Some(first) = seen.ahead.first() {
                    parts.push((
                        format!(" · behind {}", waiters_words(first, &seen.ahead)),
                        true,
                    ));
                }
                if let Some(place) = seen.place {
                    parts.push((format!(" · {} in line", ordinal(place)), false));
                }
            }
            several => {
                let each: Vec<String> = several
                    .iter()
                    .map(|watch| {
                        let seen = seen(watch, true);
                        if let Some(room) = room_text(watch) {
                            return room;
                        }
                        let who = match (seen.view.holders.first(), seen.ahead.first()) {
                            (Some(_), _) => holders_words(&seen.view),
                            (None, Some(first)) => {
                                format!("behind {}", waiters_words(first, &seen.ahead))
                            }
                            (None, None) => "in line".to_owned(),
                        };
                        format!("{}: {who}", watch.label)
                    })
                    .collect();
                parts.push((format!(" · {}", each.join("; ")), true));
            }
        }
        if let Some(step) = step {
            parts.push((format!(" ({})", sanitize(step)), false));
        }
        parts
    }

    /// The first holder in the way, and the lock waited for (the label,
    /// when several are).
    fn first_in_the_way(&self) -> (Option<status::Holder>, String) {
        let holder = self
            .watches
            .iter()
            .find_map(|w| seen(w, false).view.holders.first().cloned());
        let resource = match &self.watches[..] {
            [one] => one.resource.to_string(),
            _ => self.label.clone(),
        };
        (holder, resource)
    }

    /// The wait ran out of `timeout`: the take's error, worded as `-w`
    /// says it (naming `step` where the line stays), with who is in the way.
    pub(super) fn timed_out(&self, timeout: Duration, step: Option<&str>) -> Busy {
        let (holder, resource) = self.first_in_the_way();
        crate::messages::busy::timed_out_busy(
            timeout,
            &self.label,
            &self.in_the_way(),
            step,
            holder.as_ref().map(crate::take::holder_of),
            resource,
        )
    }

    /// `: held by ... for 5m03s` for each lock waited for, for the timeout.
    pub(super) fn in_the_way(&self) -> String {
        match &self.watches[..] {
            [] => String::new(),
            [watch] => {
                if let Some(room) = room_text(watch) {
                    return format!(": {}", unnamed(watch, &room));
                }
                let seen = seen(watch, false);
                in_the_way(&seen.view, &seen.ahead)
            }
            several => {
                let each: Vec<String> = several
                    .iter()
                    .map(|watch| {
                        if let Some(room) = room_text(watch) {
                            return room;
                        }
                        let seen = seen(watch, false);
                        let why = in_the_way(&seen.view, &seen.ahead);
                        format!("{} {}", watch.label, why.trim_start_matches(": "))
                    })
                    .collect();
                format!(": {}", each.join("; "))
            }
        }
    }
}

fn is_ancestor(pid: u32) -> bool {
    crate::proc::process::ancestors(std::process::id()).any(|(ancestor, _)| ancestor == pid)
}
