//! A directory's names, read with getdents64(2) through a descriptor of
//! the listing's own: four system calls for a small directory, where
//! opendir(3) over a copy of the directory's descriptor made nine (the
//! copy, its checks, and a rewind of the offset the copy shared). A take
//! of a name that may be a group's lists the lock directory between the
//! grant and the command.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

use nix::fcntl::OFlag;

/// The fixed part of a `struct linux_dirent64`: inode (8 bytes), offset
/// (8), record length (2), type (1); the name follows, NUL-terminated.
const HEAD: usize = 19;

/// Calls `each` with every name in `dir` (`.` and `..` among them) and
/// its inode number, in the order the file system gives them.
pub fn each_name(dir: BorrowedFd<'_>, mut each: impl FnMut(&[u8], u64)) -> io::Result<()> {
    let listing = crate::sys::fs::openat(
        dir,
        c".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        0,
    )?;
    // A page: the lock directory's names in one call, without a heap
    // buffer; a directory that fills it (thousands of names, another
    // user's doing perhaps) is read on in 32 kB calls, as readdir(3) reads.
    // The records are read field by field from bytes, so neither buffer
    // needs any alignment.
    let mut small = [0u8; 4096];
    let mut big = Vec::new();
    loop {
        let buf: &mut [u8] = match big.is_empty() {
            true => &mut small,
            false => &mut big,
        };
        let len = buf.len();
        // SAFETY: getdents64 writes at most `len` bytes into `buf`, which
        // has that many, on a descriptor `listing` keeps open.
        let got = unsafe {
            libc::syscall(
                libc::SYS_getdents64,
                listing.as_raw_fd(),
                buf.as_mut_ptr(),
                len,
            )
        };
        let got = match usize::try_from(got) {
            Ok(0) => return Ok(()),
            Ok(got) => got.min(len),
            Err(_) => match io::Error::last_os_error() {
                e if e.kind() == io::ErrorKind::Interrupted => continue,
                e => return Err(e),
            },
        };
        records(&buf[..got], &mut each)?;
        if big.is_empty() && got > len / 2 {
            big = vec![0u8; 32 * 1024];
        }
    }
}

/// The names in a directory that are UTF-8 (another user may have made
/// any name there; none of devlock's own is anything else), but `.` and
/// `..`, with their inode numbers.
pub fn each_entry(dir: BorrowedFd<'_>, mut each: impl FnMut(&str, u64)) -> io::Result<()> {
    each_name(dir, |name, ino| {
        if let Ok(name) = std::str::from_utf8(name)
            && !matches!(name, "." | "..")
        {
            each(name, ino);
        }
    })
}

/// Calls `each` for every record in `bytes`, what one getdents64 call
/// returned: its name (up to its NUL) and inode number. A record that does
/// not fit is an error, never read past.
fn records(bytes: &[u8], each: &mut impl FnMut(&[u8], u64)) -> io::Result<()> {
    let mut at = 0;
    while at + HEAD <= bytes.len() {
        let field = |from: usize, to: usize| &bytes[at + from..at + to];
        let ino = u64::from_ne_bytes(field(0, 8).try_into().expect("8 bytes"));
        let reclen = usize::from(u16::from_ne_bytes(
            field(16, 18).try_into().expect("2 bytes"),
        ));
        if reclen < HEAD || at + reclen > bytes.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a directory entry that does not fit its listing",
            ));
        }
        let name = field(HEAD, reclen);
        let name = name.split(|&b| b == 0).next().unwrap_or(name);
        each(name, ino);
        at += reclen;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]
        /// Whatever a listing holds: no panic, no read past it, and every
        /// name given lies inside it, without a NUL.
        #[test]
        fn any_listing_bytes_give_only_names_inside_them(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600)
        ) {
            let mut given = Vec::new();
            let _ = records(&bytes, &mut |name: &[u8], _| given.push(name.to_vec()));
            for name in given {
                proptest::prop_assert!(!name.contains(&0));
                proptest::prop_assert!(name.len() + HEAD <= bytes.len());
            }
        }
    }

    /// Every name comes once with its inode, in a directory of a few names
    /// and in one of thousands (more than one getdents64 call).
    #[test]
    fn lists_every_name_once_with_its_inode() {
        use std::os::unix::fs::MetadataExt;
        for count in [3, 3000] {
            let dir = tempfile::tempdir().unwrap();
            let mut want = std::collections::BTreeMap::new();
            for i in 0..count {
                let name = format!("gpu:{i}.lock-{}", "x".repeat(i % 40));
                let path = dir.path().join(&name);
                std::fs::write(&path, "").unwrap();
                want.insert(name, std::fs::metadata(&path).unwrap().ino());
            }
            let opened = std::fs::File::open(dir.path()).unwrap();
            let mut got = std::collections::BTreeMap::new();
            each_name(std::os::fd::AsFd::as_fd(&opened), |name, ino| {
                let name = String::from_utf8(name.to_vec()).unwrap();
                assert!(got.insert(name, ino).is_none(), "a name twice");
            })
            .unwrap();
            assert_eq!(
                got.remove("."),
                Some(std::fs::metadata(dir.path()).unwrap().ino())
            );
            assert!(got.remove("..").is_some());
            assert_eq!(got, want);
        }
    }
}
