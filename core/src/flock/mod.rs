//! The flock backend: machine-wide locks as files in one scratch directory.
//! This is its on-disk protocol; every devlock, the library and util-linux
//! `flock` on the same files meet in it.
//!
//! # Files
//!
//! For a resource `R` (a name of 1-64 `[A-Za-z0-9._:-]`, never starting
//! with `.` or `-`, so that no resource file is a dot file):
//!
//! | file | what it is | kept by |
//! |---|---|---|
//! | `R.lock` | the lock: flock(2) on it, exclusive or shared | every holder |
//! | `.R.queue` | the fair line: OFD byte-range locks only | everyone in line |
//! | `.R.slotN` | semaphore slot N of `--slots` (1..=N) | that slot's holder |
//! | `.R@PID.K.wait` | a waiter's registration | the waiting devlock |
//! | `.R@PID.K.hold` | a shared holder's label | the holder (and its command) |
//! | `.R@PID.K.lost` | a holder whose `R.lock` was renamed away | that holder |
//! | `.names` | the names `devlock setup` declared, one a line (root's, 0644) | root |
//!
//! No file is ever deleted or replaced by devlock while it might be held
//! (deleting a lock file lets two holders in), and none is truncated or
//! written before its lock is held. Files are opened relative to the
//! directory's descriptor with `O_NOFOLLOW|O_NONBLOCK|O_NOCTTY`, and only
//! regular files are used ([`file`]): a symlink, FIFO, socket, device or
//! directory at a devlock path is refused with exit 74, naming it.
//!
//! ## `R.lock`
//!
//! A plain request takes `flock(LOCK_EX)` (`--shared`: `LOCK_SH`), then
//! checks that the path still names the inode it locked (`fstat` against
//! `fstatat`) and takes the new file if not. The command inherits the
//! descriptor, so the kernel holds the lock until the command and everything
//! that inherited it have exited, whatever happens to devlock.
//!
//! An exclusive plain holder writes its record ([`record`]) into the file
//! once it holds the lock, and again once the command runs (its pid joins),
//! and truncates the file to nothing before it lets go. It writes only into
//! a file that is empty or holds a devlock record of any version (never
//! somebody's data, `--dir .` with a `Cargo.lock`), that it may write, and
//! that has one link unless everyone may write it anyway.
//!
//! ## `.names`
//!
//! Written by `devlock setup` (and `devlock forget`) and believed only as a
//! regular file root owns that nobody else may write ([`declared`]): then a
//! run refuses a name it does not list unless `--new`. Nothing else reads
//! it; without it every name is open.
//!
//! ## `.R.queue`: the line and the slot agreement
//!
//! Nothing in the queue file is ever read: everything is an OFD
//! (open-file-description) byte-range lock, so whatever anyone writes into
//! it changes nothing, and a dead process's locks vanish with it.
//!
//! ```text
//! byte 0 ............ 4095   unused (the old header: ignored)
//! byte 4096 + N              slot agreement: a read lock for --slots N
//!                            (N = 0 for a plain lock), 4096..4096+65535
//! byte 2^20 + T              ticket T (1 ..= 2^32): a write lock, one byte
//! ```
//!
//! - **Joining** ([`queue::Ticket::take`]): read-lock the agreement byte of
//!   your size, then look (`F_OFD_GETLK`) for a single-byte read lock on any
//!   other agreement byte: another size in use is a usage error. Then take
//!   the byte one past the highest ticket byte anyone holds (an exponential
//!   then binary search of `F_OFD_GETLK` queries, no counter), stepping past
//!   a lock in the way, at most 1000 steps.
//! - **The turn** ([`queue::Ticket::wait_turn`]): one blocking read lock
//!   (`F_OFD_SETLKW`) over every earlier ticket byte, granted by the kernel
//!   once each earlier request has left or died; released at once.
//! - **Holding**: an exclusive holder keeps its ticket byte, so those behind
//!   wait for it; a shared holder (and a slot holder) unlocks its ticket
//!   byte at once ("steps aside"), so the next reader can join it and a
//!   writer behind waits for `R.lock` itself. Everyone keeps the agreement
//!   byte for as long as it waits or holds.
//! - **The uncontended take** skips the line: one `F_OFD_GETLK` over every
//!   byte from 4097 to the end of the file; if nobody is in line and nobody
//!   uses the resource with slots, it tries `R.lock` directly. A request
//!   arriving just after takes a ticket, finds nobody ahead, and waits for
//!   `R.lock` itself.
//!
//! ## `.R.slotN`
//!
//! `--slots N`: a holder takes one free `.R.slotK` exclusively (trying each,
//! then racing one blocking waiter thread per slot) and `R.lock` shared, so
//! a plain exclusive holder of `R` excludes every slot holder.
//!
//! ## Registrations (`.R@PID.K.{wait,hold,lost}`)
//!
//! Made by their owner with `O_CREAT|O_EXCL` (K counts up per process; a
//! name already taken, planted or left by a dead process with the same pid,
//! is skipped, never opened), mode 0644, then `flock(LOCK_EX)` and the
//! holder's tag (see Strangers) for as long as they live, and the owner's
//! record written into them. Status believes
//! one only when the kernel shows its flock held by the very process it
//! names (pid and start time). On release the owner truncates, then unlinks
//! it; one whose owner died is unlinked by whoever can take its flock (which
//! proves the owner is gone). A waiter registers once it has waited 100 ms (a
//! `--slots`, `--any` or `--mem` one as it starts to wait; see `late`: a
//! place in line nobody registered is named from the kernel too); a
//! shared holder keeps `.hold` as its label (its command inherits it); a
//! holder that finds its `R.lock` renamed away registers `.lost`, so status
//! can say that exclusion is broken.
//!
//! ## The record (version 2)
//!
//! One JSON object on one line, written in one `pwrite` and then cut to its
//! length, at most 16 KiB:
//!
//! ```text
//! {"magic":"devlock-record","v":2,"check":"<16 hex digits>",<members>}\n
//! ```
//!
//! `check` is the 64-bit FNV-1a of `{<members>}`, so a torn read (two
//! records mixed mid-update) is told from a whole one, and readers retry a
//! few times. The members are `step`, `pid`, `pid_start` (clock ticks since
//! boot: pid plus start time name one process), `since_ms`, and where they
//! apply `child`/`child_start` (the command), `boot_id`, `ticket`, `slot` and
//! `via` (the member a group is held for). Unknown members, absurd numbers
//! and anything over 16 KiB are refused. A record is a label only: no
//! command line and no user name (those come live from `/proc` and the
//! kernel). Version 1 records (`{"check":"...`) are never believed, but are
//! devlock's to overwrite.
//!
//! # Strangers
//!
//! Every file here can be written, linked, renamed or locked by another
//! user (a sticky world-writable directory protects a file only from users
//! other than its owner). What they can and cannot do:
//!
//! - **Write into any file**: changes nothing the protocol reads but a
//!   record, which is a label checked against the kernel (a forged record
//!   names nobody the kernel does not back, and never reaches a terminal
//!   unsanitised).
//! - **Lock bytes of the queue file, a slot file, or lease a file**: a
//!   lock devlock did not take on a byte that matters counts as someone
//!   holding or waiting, exactly as a real job would. A lock on a ticket
//!   byte is a place in line like any other. A lock that leaves no ticket
//!   to take (over every ticket to the end, or on the top ticket byte), or
//!   a read lock on an agreement byte that no devlock the kernel backs
//!   holds, keeps the request out of the line while it is there: `-n` is
//!   busy (exit 75) naming it, anyone else drops its own agreement byte
//!   (two such requests must not wait for each other's) and looks again
//!   every 50 ms, shown, bounded by `-w` and ended by a stopping signal
//!   ([`queue::Blocked`]). Another size is a usage error only when the
//!   process holding that agreement byte (per its fdinfo) is named, pid
//!   and start time, by the lock file's record or a registration that the
//!   kernel backs. A plain `flock` on a slot file is that slot's holder. A
//!   file lease (only a file's owner can take one, so only in an open
//!   directory) makes opens for writing fail at once: busy for `-n`, else
//!   waited out with a blocking open that the kernel makes the lease's
//!   holder answer within `lease-break-time`, kept open until the take is
//!   done so that a read lease cannot be taken again ([`file::Leased`]).
//!   Status shows each of these held or in line, never free.
//! - **Be named**: only from the kernel: `/proc/locks`, the `lock:` lines
//!   of `/proc/PID/fdinfo/FD` (readable by root and the owner), and the
//!   start time in `/proc/PID/stat`. One pass over every process's fdinfo
//!   answers a whole look (and every look for 250 ms), linear in processes
//!   times descriptors, cut short by a pending stopping signal
//!   ([`crate::proc::fdinfo::fd_scan`]); where this user cannot see an owner
//!   it says so, never a guess. The process `/proc/locks` names as a
//!   flock's taker is believed to hold it only where its fdinfo says so,
//!   where a record names it by pid and start time (a chain-loaded holder
//!   is its command), or, for a registration (a waiter's, a shared
//!   holder's label), where it carries the tag: a POSIX read lock on byte
//!   2^40 of that file, which the kernel lists under its pid for every user
//!   and drops when it ends; not taken on filesystems where flock is made
//!   of POSIX locks (NFS). A reused pid (even in the same clock tick) is
//!   named by no record its predecessor left. The lock file carries no
//!   tag (it would stop a whole-file `lockf` and end at any close of the
//!   file in the command), so a user who gets a dead holder's pid while a
//!   child keeps the lock can write a record naming its own process, and
//!   those who can read neither's fdinfo are shown it
//!   (`a_record_forged_for_a_reused_pid_fools_only_who_cannot_read_descriptors`).
//! - **Plant files named as registrations**: only files whose inode the
//!   kernel shows flocked are opened (the directory entry's `d_ino`); at
//!   most 16 others are swept per look.
//! - **Hold `R.lock`** (util-linux flock): that is taking the lock, which
//!   is allowed; status shows the holder from the kernel.
//! - **Rename or remove a file they own**: only the owner of a file can, in
//!   a sticky directory. Whoever created `R.lock` first could let a second
//!   holder in this way; devlock warns once per run that such a file is
//!   another user's, the holder checks every second that its path still
//!   names its file (and says so, even with `-q`, if not), and `devlock
//!   setup` (root) makes the directory and the declared files root's, so no
//!   user can. See [`trust`].
//! - **Plant a file of another type** (FIFO, symlink, socket, directory):
//!   refused with exit 74 before it is opened in a way that could block.
//! - **Link a file**: a file with several links is still used as a gate
//!   (refusing it would let anyone disable a resource), but a record is
//!   written into it only when everyone could write it anyway.
//!
//! Exclusion itself rests only on the kernel's flock of the inode the path
//! names, checked after locking; the line only orders the takers, and
//! everything in it dies with its owner.

pub(crate) mod any;
pub mod budget;
pub mod declared;
pub mod dir;
pub mod entry;
pub mod file;
pub mod in_the_way;
pub(crate) mod late;
pub mod made;
pub mod nesting;
pub mod queue;
pub(crate) mod race;
pub mod record;
pub mod registration;
pub mod slots;
pub(crate) mod take;
pub mod trust;
pub mod wait;
