//! `--slots N`: a semaphore of N slot files beside the lock, one taken
//! exclusively by each holder (with the lock itself shared), so that up to N
//! run at once and a plain holder of the lock excludes them all.

use anyhow::Result;

use crate::flock::dir::ScratchDir;
use crate::flock::file::{LockFile, TryLock};
use crate::flock::race::first_of;
use crate::interrupt::Stop;
use crate::request::Request;
use crate::resource::Resource;

/// A semaphore slot held: its number (from 1) and its lock file.
#[derive(Debug)]
pub struct Slot {
    pub number: u64,
    pub(crate) lock: LockFile,
}

/// Takes the first free slot of `request` without waiting, if any.
pub(crate) fn try_any(dir: &ScratchDir, request: &Request) -> Result<Option<Slot>> {
    for number in 1..=request.slots {
        let lock = LockFile::open(dir, &slot_file(&request.name, number))?;
        if lock.try_lock(true)? == TryLock::Taken {
            return Ok(Some(Slot { number, lock }));
        }
    }
    Ok(None)
}

/// Waits for any free slot of a semaphore, without polling.
pub(crate) fn wait_for_slot(dir: &ScratchDir, request: &Request, stop: &Stop) -> Result<Slot> {
    if let Some(slot) = try_any(dir, request)? {
        return Ok(slot);
    }
    let slots: Vec<Slot> = (1..=request.slots)
        .map(|number| {
            let lock = LockFile::open(dir, &slot_file(&request.name, number))?;
            Ok(Slot { number, lock })
        })
        .collect::<Result<_>>()?;
    let raced = first_of(slots, stop, None, |slot, stop| {
        slot.lock.lock(true, &|| stop.keep_waiting())?;
        Ok(slot)
    })?;
    let (_, taken) = raced.ok_or_else(|| anyhow::anyhow!("interrupted"))?;
    Ok(taken)
}

/// A semaphore slot's lock file: a dot file, never a resource of its own.
pub fn slot_file(resource: &Resource, slot: u64) -> String {
    format!(".{resource}.slot{slot}")
}
