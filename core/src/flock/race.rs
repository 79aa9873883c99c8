//! The one race of blocking calls on threads of their own, under `--any`
//! (each candidate's line), `--slots` (each slot) and budgets (each holder
//! that may leave, each turn that may come): the first to end wins, and
//! every other is interrupted and waited for before the race returns.

use std::sync::{Barrier, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::interrupt::Stop;
use crate::sys::signal::Thread;

/// Runs `job` on each item, each on a thread of its own that sleeps in the
/// kernel (its lock calls interrupted by its own [`Stop`]), and returns the
/// first to succeed, with its index; `None` when `until` passed first. A
/// job that fails leaves the others racing; when every one has failed, the
/// first failure is returned. Before it returns, every other thread is
/// stopped and has ended, and what a late winner took is dropped (which
/// leaves its line and lets go of it). A stop of `outer` (a library's
/// cancel or timeout) reaches every thread at once.
pub(crate) fn first_of<I: Send, T: Send>(
    items: Vec<I>,
    outer: &Stop,
    until: Option<Duration>,
    job: impl Fn(I, &Stop) -> Result<T> + Sync,
) -> Result<Option<(usize, T)>> {
    crate::interrupt::install();
    let deadline = until.map(|u| Instant::now() + u);
    let (tx, rx) = mpsc::channel::<(usize, Result<T>)>();
    let stops: Vec<Stop> = items.iter().map(|_| Stop::default()).collect();
    let threads: Mutex<Vec<Option<Thread>>> = Mutex::new(vec![None; items.len()]);
    let threads_now = || threads.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let started = Barrier::new(items.len() + 1);
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for (index, item) in items.into_iter().enumerate() {
            let tx = tx.clone();
            let stop = stops[index].clone();
            let (job, threads, started) = (&job, &threads, &started);
            handles.push(scope.spawn(move || {
                crate::interrupt::unblock_here();
                crate::interrupt::let_job_stops_in_here();
                threads.lock().unwrap_or_else(|e| e.into_inner())[index] = Some(Thread::current());
                started.wait();
                let result = {
                    // However the job ends, a panic included, so that the
                    // decider's stop never waits for it forever.
                    let _finished = stop.finished_on_drop();
                    job(item, &stop)
                };
                let _ = tx.send((index, result));
            }));
        }
        started.wait();
        drop(tx);
        // This thread sleeps in no lock call while its racers do: a stop of
        // the outer wait must reach them.
        let children: Vec<(Stop, Thread)> = stops
            .iter()
            .cloned()
            .zip(threads_now())
            .filter_map(|(s, t)| t.map(|t| (s, t)))
            .collect();
        let _adopted = outer.adopt(children);
        // A job stop must reach a thread asleep in a lock call, not this one.
        let mask = crate::interrupt::keep_job_stops_off_here();
        let mut winner = None;
        let mut first_error = None;
        let mut timed_out = false;
        // Wait for the first success (or for every job to fail).
        loop {
            let received = match deadline {
                None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            match received {
                Ok((index, Ok(value))) => {
                    winner = Some((index, value));
                    break;
                }
                Ok((_, Err(e))) => {
                    first_error.get_or_insert(e);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    timed_out = true;
                    break;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            if !outer.keep_waiting() {
                break;
            }
        }
        for (stop, thread) in stops.iter().zip(threads_now()) {
            if let Some(thread) = thread {
                stop.stop(thread);
            }
        }
        crate::interrupt::restore(&mask);
        // Late winners are dropped here, releasing what they took.
        drop(rx);
        for handle in handles {
            let _ = handle.join();
        }
        match (winner, first_error) {
            (Some(w), _) => Ok(Some(w)),
            (None, _) if timed_out => Ok(None),
            (None, Some(e)) => Err(e),
            (None, None) => Err(anyhow::anyhow!("interrupted")),
        }
    })
}
