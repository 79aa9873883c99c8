//! Who holds a lease on a file: the `LEASE` lines of `/proc/locks`, which
//! setup reads before it takes over or replaces a declared file.

use crate::proc::lock_entry::FileId;

/// The pids holding a lease on the file (`LEASE` lines of `/proc/locks`,
/// which [`LockTable`] leaves out: a lease is no lock, but it makes every
/// open for writing wait for the kernel's lease-break time).
///
/// [`LockTable`]: crate::proc::locks::LockTable
pub(super) fn lease_holders(id: FileId) -> Vec<u32> {
    match std::fs::read_to_string("/proc/locks") {
        Ok(text) => leases_in(&text, id),
        Err(_) => Vec::new(),
    }
}

/// [`lease_holders`] in the text of `/proc/locks`: `2: LEASE  ACTIVE
/// READ 10064 fe:00:10035432 0 EOF` (`BREAKING` or `BREAKER` while one is
/// broken; `->` before a request that waits).
fn leases_in(text: &str, id: FileId) -> Vec<u32> {
    text.lines()
        .filter_map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            let at = usize::from(words.get(1) == Some(&"->"));
            if words.get(1 + at) != Some(&"LEASE") {
                return None;
            }
            let pid: u32 = words.get(4 + at)?.parse().ok()?;
            let mut dev = words.get(5 + at)?.split(':');
            let major = u32::from_str_radix(dev.next()?, 16).ok()?;
            let minor = u32::from_str_radix(dev.next()?, 16).ok()?;
            let ino: u64 = dev.next()?.parse().ok()?;
            (FileId { major, minor, ino } == id).then_some(pid)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_found_by_file_and_locks_are_not_leases() {
        let text = "1: FLOCK  ADVISORY  WRITE 5026 fe:00:10027111 0 EOF\n\
                    2: LEASE  ACTIVE    READ 10064 fe:00:10035432 0 EOF\n\
                    3: LEASE  BREAKING  READ 10065 fe:00:10035432 0 EOF\n\
                    4: LEASE  ACTIVE    READ 10066 fe:01:10035432 0 EOF\n";
        let id = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10_035_432,
        };
        assert_eq!(leases_in(text, id), [10064, 10065]);
        let flocked = FileId {
            major: 0xfe,
            minor: 0,
            ino: 10_027_111,
        };
        assert!(leases_in(text, flocked).is_empty());
    }
}
