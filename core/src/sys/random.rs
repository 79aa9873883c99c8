//! Random bytes from the kernel (getrandom(2)), for names another user must
//! not be able to guess.

/// 128 random bits from the kernel's pool (blocking only before it is
/// first initialised at boot).
pub(crate) fn random_u128() -> std::io::Result<u128> {
    let mut buf = [0u8; 16];
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: the pointer and length name the unfilled tail of `buf`,
        // which lives across the call; getrandom writes at most that many
        // bytes and returns how many it wrote, or -1.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        filled += n as usize;
    }
    Ok(u128::from_ne_bytes(buf))
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_draws_differ() {
        assert_ne!(super::random_u128().unwrap(), super::random_u128().unwrap());
    }
}
