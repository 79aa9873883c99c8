//! The command line as the C entry point receives it.

use std::ffi::{CStr, OsString, c_char, c_int};
use std::os::unix::ffi::OsStrExt;

/// The arguments `main(argc, argv)` was given, as `OsString`s, byte for
/// byte: nothing depends on glibc's std start-up having filled
/// `std::env::args`.
///
/// # Safety
///
/// `argv` must point to `argc` pointers to NUL-terminated strings that stay
/// valid for the call, as the C runtime hands them to `main`.
pub unsafe fn from_main(argc: c_int, argv: *const *const c_char) -> Vec<OsString> {
    let count = usize::try_from(argc).unwrap_or(0);
    if argv.is_null() {
        return Vec::new();
    }
    (0..count)
        .map(|i| {
            // SAFETY: i < argc, and the caller promises argc valid pointers.
            let arg = unsafe { *argv.add(i) };
            if arg.is_null() {
                return OsString::new();
            }
            // SAFETY: each is a NUL-terminated string valid for the call.
            let bytes = unsafe { CStr::from_ptr(arg) }.to_bytes();
            std::ffi::OsStr::from_bytes(bytes).to_owned()
        })
        .collect()
}
