//! GPUs: one device model ([`device`]) that every source fills: [`nvml`]
//! in-process, [`nvidia_smi`] and [`amd`] as vendor tools run under a
//! deadline ([`tool`]); the choice between them ([`source`]), MIG instances
//! as devices ([`mig`]), which processes work inside a lock's gate and
//! whether a device is idle ([`gate`]), the caller's `CUDA_VISIBLE_DEVICES`
//! ([`cuda`]), and device memory for `--mem` budgets ([`memory`]).

pub(crate) mod amd;
pub mod cuda;
pub mod device;
pub mod gate;
pub mod memory;
// The MIG name grammar is the resource's (see `crate::resource::mig`).
pub(crate) mod nvidia_smi;
pub(crate) mod nvml;
pub mod source;
pub(crate) mod tool;
