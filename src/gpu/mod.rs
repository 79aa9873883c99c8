//! GPUs: the probe ([`nvidia_smi`], one device type), which processes work
//! inside a lock's gate and whether a device is idle ([`gate`]), and the
//! caller's `CUDA_VISIBLE_DEVICES` ([`cuda`]), and device memory for `--mem`
//! budgets ([`memory`]).

pub(crate) mod cuda;
pub(crate) mod gate;
pub(crate) mod memory;
pub(crate) mod nvidia_smi;
