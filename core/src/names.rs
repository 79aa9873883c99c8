//! The limits of a resource name, shared by the name's grammar
//! ([`crate::resource`]) and the MIG instance names within it
//! ([`crate::resource::mig`]), which the grammar parses with.

/// Longest accepted resource name.
pub(crate) const MAX_NAME_LEN: usize = 64;

/// Largest GPU index a `gpu:N` name may carry: far above any machine's
/// count, small enough for every consumer (`CUDA_VISIBLE_DEVICES`, u16).
pub(crate) const MAX_GPU_INDEX: u32 = 65535;
