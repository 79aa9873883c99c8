//! What a hold's watch (its budget, its idleness) has to say to the caller:
//! kept until the caller sets a sink, then passed on outside the lock (the
//! sink may wait for the interpreter while the caller holds it and asks the
//! outbox).

use std::sync::Mutex;

/// An event that may be the stop of the job it is about.
pub(crate) trait Event {
    /// The line that says why the job was stopped, if this is its stop.
    fn stop_line(&self) -> Option<&String>;
}

pub(crate) struct Outbox<E> {
    pub sink: Option<Box<dyn FnMut(E) + Send>>,
    /// Said before a sink was set.
    pub pending: Vec<E>,
    pub stopped: Option<String>,
}

impl<E> Default for Outbox<E> {
    fn default() -> Self {
        Outbox {
            sink: None,
            pending: Vec::new(),
            stopped: None,
        }
    }
}

/// Passes `event` to the sink, outside the outbox's lock.
pub(crate) fn deliver<E: Event>(outbox: &Mutex<Outbox<E>>, event: E) {
    let sink = {
        let mut o = outbox.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(line) = event.stop_line() {
            o.stopped = Some(line.clone());
        }
        match o.sink.take() {
            Some(sink) => sink,
            None => {
                o.pending.push(event);
                return;
            }
        }
    };
    let mut sink = sink;
    sink(event);
    let mut o = outbox.lock().unwrap_or_else(|e| e.into_inner());
    if o.sink.is_none() {
        o.sink = Some(sink);
    }
}
