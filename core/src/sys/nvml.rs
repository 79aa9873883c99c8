//! The raw NVML binding: `libnvidia-ml.so.1` opened with dlopen(3), the few entry points devlock calls, and a safe method for each.
//!
//! Every `unsafe` block of the NVML source ([`crate::gpu::nvml`]) is in
//! this file, each with its `// SAFETY:` line. The ABI (signatures, struct layouts, return codes, buffer
//! sizes) follows NVIDIA's nvml.h, NVML API version 13, as vendored in the
//! nvml-wrapper-sys crate (github.com/rust-nvml/nvml-wrapper,
//! `nvml-wrapper-sys/nvml.h` at commit aee24c0); the functions used have
//! kept their signatures since the versions named (`_v2`, `_v3`) appeared.
//!
//! The library is opened once and never closed: a thread that was abandoned
//! inside a hung NVML call is still executing the library's code, so
//! unmapping it would be a crash waiting to happen.
//!
//! **Why not the nvml-wrapper crate.** It does load lazily enough (its
//! generated `NvmlLib` dlsyms some 400 entry points at init and keeps a
//! missing one as an error until it is called, so a fake with only the used
//! symbols initialises), and it has `_v3` process info with GPU/compute
//! instance ids and the MIG handle calls. But: it has no wrapper for
//! `nvmlDeviceGetGpuInstanceId`/`nvmlDeviceGetComputeInstanceId` (they are in
//! its `unwrapped_functions.txt`), so devlock would call the raw bindings
//! unsafely anyway; its `memory_info` is `nvmlDeviceGetMemoryInfo_v2`, absent
//! before driver R510, where v1 works everywhere; dropping its `Nvml` calls
//! `nvmlShutdown` and closes the library, which must never happen under an
//! abandoned thread (it would have to be leaked); and it costs, measured
//! here (clean release build with devlock's profile, one core): 21 crates
//! and 21.6 s against 5.0 s for the same program over `libc` alone, and a
//! 475 KiB binary against 309 KiB. The binding below is some 450 lines over
//! `libc`, which devlock already depends on.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `nvmlReturn_t` (an `int`-sized enum in nvml.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Code(pub c_int);

impl Code {
    pub(crate) const SUCCESS: Code = Code(0);
    pub(crate) const NOT_SUPPORTED: Code = Code(3);
    pub(crate) const NOT_FOUND: Code = Code(6);
    pub(crate) const INSUFFICIENT_SIZE: Code = Code(7);
}

/// `nvmlDevice_t`: an opaque handle NVML hands out (a whole GPU or a MIG device).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handle(*mut c_void);

// SAFETY: an nvmlDevice_t is an opaque token that NVML validates on every
// call and that any thread may pass (NVML is thread-safe); devlock never
// dereferences it.
unsafe impl Send for Handle {}

/// `nvmlMemory_t` (v1): bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Memory {
    pub(crate) total: u64,
    pub(crate) free: u64,
    pub(crate) used: u64,
}

/// `nvmlUtilization_t`: percent over the last sample period.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

/// `nvmlProcessInfo_t` (= `nvmlProcessInfo_v2_t`), what the `_v2` and `_v3`
/// process listings fill.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProcessInfo {
    pub(crate) pid: c_uint,
    /// Bytes; `NOT_AVAILABLE` when the driver cannot say.
    pub(crate) used_gpu_memory: u64,
    /// `NO_INSTANCE` outside MIG.
    pub(crate) gpu_instance_id: c_uint,
    pub(crate) compute_instance_id: c_uint,
}

const _: () = assert!(std::mem::size_of::<Memory>() == 24);
const _: () = assert!(std::mem::size_of::<Utilization>() == 8);
const _: () = assert!(std::mem::size_of::<ProcessInfo>() == 24);

/// `NVML_VALUE_NOT_AVAILABLE` ((-1)) as an unsigned long long.
pub(crate) const NOT_AVAILABLE: u64 = u64::MAX;
/// A process's GPU/compute instance id outside MIG.
pub(crate) const NO_INSTANCE: c_uint = 0xFFFF_FFFF;
const UUID_BUFFER: usize = 96; // NVML_DEVICE_UUID_V2_BUFFER_SIZE
const NAME_BUFFER: usize = 96; // NVML_DEVICE_NAME_V2_BUFFER_SIZE
const DRIVER_BUFFER: usize = 80; // NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE

type Ret = c_int;
type Device = *mut c_void;

/// The MIG entry points (R450 and later), present all together or not at all.
struct Mig {
    mode: unsafe extern "C" fn(Device, *mut c_uint, *mut c_uint) -> Ret,
    max_count: unsafe extern "C" fn(Device, *mut c_uint) -> Ret,
    by_index: unsafe extern "C" fn(Device, c_uint, *mut Device) -> Ret,
    parent: unsafe extern "C" fn(Device, *mut Device) -> Ret,
    is_mig: unsafe extern "C" fn(Device, *mut c_uint) -> Ret,
    gpu_instance_id: unsafe extern "C" fn(Device, *mut c_uint) -> Ret,
    compute_instance_id: unsafe extern "C" fn(Device, *mut c_uint) -> Ret,
}

/// The opened library: its entry points, resolved once.
pub(crate) struct Library {
    init: unsafe extern "C" fn() -> Ret,
    error_string: unsafe extern "C" fn(Ret) -> *const c_char,
    driver_version: Option<unsafe extern "C" fn(*mut c_char, c_uint) -> Ret>,
    count: unsafe extern "C" fn(*mut c_uint) -> Ret,
    by_index: unsafe extern "C" fn(c_uint, *mut Device) -> Ret,
    index: Option<unsafe extern "C" fn(Device, *mut c_uint) -> Ret>,
    uuid: unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Ret,
    name: unsafe extern "C" fn(Device, *mut c_char, c_uint) -> Ret,
    memory: unsafe extern "C" fn(Device, *mut Memory) -> Ret,
    utilization: Option<unsafe extern "C" fn(Device, *mut Utilization) -> Ret>,
    /// `_v3`, else `_v2` (same struct): `(function, its name)`.
    processes: Option<(
        unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> Ret,
        &'static str,
    )>,
    mig: Option<Mig>,
}

/// Why the library could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum OpenError {
    /// dlopen(3) failed: not installed, or not loadable.
    NotLoadable(String),
    /// It loaded but lacks an entry point devlock needs: not an NVML.
    Missing(&'static str),
}

impl fmt::Display for OpenError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpenError::NotLoadable(why) => f.write_str(why),
            OpenError::Missing(symbol) => write!(f, "it has no {symbol}, so it is no NVML"),
        }
    }
}

/// The last dlerror(3) message of this thread.
fn dl_error() -> String {
    // SAFETY: dlerror takes no arguments and returns NULL or a NUL-terminated
    // thread-local string that stays valid until the next dl* call on this
    // thread; it is copied out before any such call.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        return "dlopen failed".to_owned();
    }
    // SAFETY: non-null, NUL-terminated (above).
    let text = unsafe { CStr::from_ptr(message) };
    crate::show::sanitize(&text.to_string_lossy())
}

/// Resolves one symbol, as a function pointer of type `F`.
///
/// # Safety
/// `F` must be an `unsafe extern "C" fn` type matching the C declaration of
/// `name` in nvml.h.
unsafe fn symbol<F: Copy>(handle: *mut c_void, name: &'static CStr) -> Option<F> {
    const { assert!(std::mem::size_of::<F>() == std::mem::size_of::<*mut c_void>()) };
    // SAFETY: `handle` came from a successful dlopen and is never closed;
    // `name` is NUL-terminated.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if address.is_null() {
        return None;
    }
    // SAFETY: the caller promises `F` is the function pointer type of this
    // symbol; a function pointer and a data pointer have one size and
    // representation on every target devlock builds for (asserted above).
    Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

macro_rules! required {
    ($handle:expr, $name:literal) => {
        // SAFETY: the field's type is the nvml.h declaration of $name.
        unsafe { symbol($handle, $name) }.ok_or(OpenError::Missing(
            // The literal is a C string; the message wants it as text.
            match $name.to_str() {
                Ok(text) => text,
                Err(_) => "an NVML entry point",
            },
        ))?
    };
}

macro_rules! optional {
    ($handle:expr, $name:literal) => {
        // SAFETY: the field's type is the nvml.h declaration of $name.
        unsafe { symbol($handle, $name) }
    };
}

impl Library {
    /// Opens `path` (a bare name is looked up as dlopen(3) does, a path is
    /// taken as is) and resolves the entry points. Never closed.
    pub(crate) fn open(path: &Path) -> Result<&'static Library, OpenError> {
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| OpenError::NotLoadable("the path has a NUL byte".to_owned()))?;
        // SAFETY: a NUL-terminated path; loading NVML runs its initialisers,
        // which is what NVML's users do. RTLD_LOCAL keeps its symbols out of
        // the global namespace.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(OpenError::NotLoadable(dl_error()));
        }
        let mig = (|| {
            Some(Mig {
                mode: optional!(handle, c"nvmlDeviceGetMigMode")?,
                max_count: optional!(handle, c"nvmlDeviceGetMaxMigDeviceCount")?,
                by_index: optional!(handle, c"nvmlDeviceGetMigDeviceHandleByIndex")?,
                parent: optional!(handle, c"nvmlDeviceGetDeviceHandleFromMigDeviceHandle")?,
                is_mig: optional!(handle, c"nvmlDeviceIsMigDeviceHandle")?,
                gpu_instance_id: optional!(handle, c"nvmlDeviceGetGpuInstanceId")?,
                compute_instance_id: optional!(handle, c"nvmlDeviceGetComputeInstanceId")?,
            })
        })();
        let processes = optional!(handle, c"nvmlDeviceGetComputeRunningProcesses_v3")
            .map(|f| (f, "nvmlDeviceGetComputeRunningProcesses_v3"))
            .or_else(|| {
                optional!(handle, c"nvmlDeviceGetComputeRunningProcesses_v2")
                    .map(|f| (f, "nvmlDeviceGetComputeRunningProcesses_v2"))
            });
        let library = Library {
            init: required!(handle, c"nvmlInit_v2"),
            error_string: required!(handle, c"nvmlErrorString"),
            driver_version: optional!(handle, c"nvmlSystemGetDriverVersion"),
            count: required!(handle, c"nvmlDeviceGetCount_v2"),
            by_index: required!(handle, c"nvmlDeviceGetHandleByIndex_v2"),
            index: optional!(handle, c"nvmlDeviceGetIndex"),
            uuid: required!(handle, c"nvmlDeviceGetUUID"),
            name: required!(handle, c"nvmlDeviceGetName"),
            memory: required!(handle, c"nvmlDeviceGetMemoryInfo"),
            utilization: optional!(handle, c"nvmlDeviceGetUtilizationRates"),
            processes,
            mig,
        };
        Ok(Box::leak(Box::new(library)))
    }

    /// NVML's own words for `code`, cleaned for a terminal.
    pub(crate) fn describe(&self, code: Code) -> String {
        // SAFETY: nvmlErrorString takes any value and returns a pointer to a
        // static NUL-terminated string (or NULL, checked).
        let text = unsafe { (self.error_string)(code.0) };
        if text.is_null() {
            return format!("NVML error {}", code.0);
        }
        // SAFETY: non-null, NUL-terminated, static (above).
        let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
        format!("{} (NVML error {})", crate::show::sanitize(&text), code.0)
    }

    /// `nvmlInit_v2`: call once per process.
    pub(crate) fn init(&self) -> Result<(), Code> {
        // SAFETY: no arguments; NVML may be initialised from any thread.
        check(unsafe { (self.init)() })
    }

    /// `nvmlSystemGetDriverVersion`; `None` when this NVML lacks it.
    pub(crate) fn driver_version(&self) -> Option<Result<String, Code>> {
        let f = self.driver_version?;
        Some(read_string::<DRIVER_BUFFER>(|buf, len| {
            // SAFETY: `buf` is writable for `len` bytes.
            unsafe { f(buf, len) }
        }))
    }

    /// `nvmlDeviceGetCount_v2`.
    pub(crate) fn count(&self) -> Result<u32, Code> {
        let mut count: c_uint = 0;
        // SAFETY: a valid out-pointer.
        check(unsafe { (self.count)(&mut count) })?;
        Ok(count)
    }

    /// `nvmlDeviceGetHandleByIndex_v2`.
    pub(crate) fn handle(&self, index: u32) -> Result<Handle, Code> {
        let mut device: Device = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; NVML checks the index.
        check(unsafe { (self.by_index)(index, &mut device) })?;
        Ok(Handle(device))
    }

    /// `nvmlDeviceGetIndex`; `None` when this NVML lacks it.
    pub(crate) fn index(&self, device: Handle) -> Option<Result<u32, Code>> {
        let f = self.index?;
        let mut index: c_uint = 0;
        // SAFETY: a handle NVML gave out, and a valid out-pointer.
        Some(check(unsafe { f(device.0, &mut index) }).map(|()| index))
    }

    /// `nvmlDeviceGetUUID`.
    pub(crate) fn uuid(&self, device: Handle) -> Result<String, Code> {
        read_string::<UUID_BUFFER>(|buf, len| {
            // SAFETY: a handle NVML gave out; `buf` is writable for `len` bytes.
            unsafe { (self.uuid)(device.0, buf, len) }
        })
    }

    /// `nvmlDeviceGetName`.
    pub(crate) fn name(&self, device: Handle) -> Result<String, Code> {
        read_string::<NAME_BUFFER>(|buf, len| {
            // SAFETY: a handle NVML gave out; `buf` is writable for `len` bytes.
            unsafe { (self.name)(device.0, buf, len) }
        })
    }

    /// `nvmlDeviceGetMemoryInfo` (v1), bytes.
    pub(crate) fn memory(&self, device: Handle) -> Result<Memory, Code> {
        let mut memory = Memory::default();
        // SAFETY: a handle NVML gave out, and a valid out-pointer to an nvmlMemory_t.
        check(unsafe { (self.memory)(device.0, &mut memory) })?;
        Ok(memory)
    }

    /// `nvmlDeviceGetUtilizationRates`: the GPU's percentage; `None` when
    /// this NVML lacks it.
    pub(crate) fn utilization(&self, device: Handle) -> Option<Result<u32, Code>> {
        let f = self.utilization?;
        let mut utilization = Utilization::default();
        // SAFETY: a handle NVML gave out, and a valid out-pointer to an nvmlUtilization_t.
        Some(check(unsafe { f(device.0, &mut utilization) }).map(|()| utilization.gpu))
    }

    /// The name of the process listing this NVML has (`_v3` or `_v2`).
    pub(crate) fn processes_call(&self) -> Option<&'static str> {
        self.processes.map(|(_, name)| name)
    }

    /// The compute processes on a GPU or MIG device; `None` when this NVML
    /// has neither `_v3` nor `_v2`.
    pub(crate) fn processes(&self, device: Handle) -> Option<Result<Vec<ProcessInfo>, Code>> {
        let (f, _) = self.processes?;
        // The list can grow between asking for its size and reading it.
        let mut capacity: c_uint = 0;
        for _ in 0..4 {
            let mut infos = vec![ProcessInfo::default(); capacity as usize];
            let mut count = capacity;
            let ptr = if infos.is_empty() {
                std::ptr::null_mut()
            } else {
                infos.as_mut_ptr()
            };
            // SAFETY: a handle NVML gave out; `count` says how many elements
            // `infos` has room for (NULL is allowed with a count of 0).
            match Code(unsafe { f(device.0, &mut count, ptr) }) {
                Code::SUCCESS => {
                    infos.truncate((count as usize).min(infos.len()));
                    return Some(Ok(infos));
                }
                Code::INSUFFICIENT_SIZE if count > capacity => capacity = count + 8,
                other => return Some(Err(other)),
            }
        }
        Some(Err(Code::INSUFFICIENT_SIZE))
    }

    /// Whether this NVML knows MIG at all.
    pub(crate) fn has_mig(&self) -> bool {
        self.mig.is_some()
    }

    /// `nvmlDeviceGetMigMode`: `(current, pending)`, each 1 when enabled.
    pub(crate) fn mig_mode(&self, device: Handle) -> Option<Result<(u32, u32), Code>> {
        let mig = self.mig.as_ref()?;
        let (mut current, mut pending): (c_uint, c_uint) = (0, 0);
        // SAFETY: a handle NVML gave out, and two valid out-pointers.
        Some(
            check(unsafe { (mig.mode)(device.0, &mut current, &mut pending) })
                .map(|()| (current, pending)),
        )
    }

    /// `nvmlDeviceGetMaxMigDeviceCount`.
    pub(crate) fn max_mig_devices(&self, device: Handle) -> Option<Result<u32, Code>> {
        let mig = self.mig.as_ref()?;
        let mut count: c_uint = 0;
        // SAFETY: a handle NVML gave out, and a valid out-pointer.
        Some(check(unsafe { (mig.max_count)(device.0, &mut count) }).map(|()| count))
    }

    /// `nvmlDeviceGetMigDeviceHandleByIndex`.
    pub(crate) fn mig_device(&self, device: Handle, index: u32) -> Option<Result<Handle, Code>> {
        let mig = self.mig.as_ref()?;
        let mut out: Device = std::ptr::null_mut();
        // SAFETY: a handle NVML gave out, and a valid out-pointer; NVML checks the index.
        Some(check(unsafe { (mig.by_index)(device.0, index, &mut out) }).map(|()| Handle(out)))
    }

    /// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`.
    pub(crate) fn mig_parent(&self, device: Handle) -> Option<Result<Handle, Code>> {
        let mig = self.mig.as_ref()?;
        let mut out: Device = std::ptr::null_mut();
        // SAFETY: a handle NVML gave out, and a valid out-pointer.
        Some(check(unsafe { (mig.parent)(device.0, &mut out) }).map(|()| Handle(out)))
    }

    /// `nvmlDeviceIsMigDeviceHandle`.
    pub(crate) fn is_mig_device(&self, device: Handle) -> Option<Result<bool, Code>> {
        let mig = self.mig.as_ref()?;
        let mut is_mig: c_uint = 0;
        // SAFETY: a handle NVML gave out, and a valid out-pointer.
        Some(check(unsafe { (mig.is_mig)(device.0, &mut is_mig) }).map(|()| is_mig != 0))
    }

    /// `nvmlDeviceGetGpuInstanceId` of a MIG device.
    pub(crate) fn gpu_instance_id(&self, device: Handle) -> Option<Result<u32, Code>> {
        let mig = self.mig.as_ref()?;
        let mut id: c_uint = 0;
        // SAFETY: a handle NVML gave out, and a valid out-pointer.
        Some(check(unsafe { (mig.gpu_instance_id)(device.0, &mut id) }).map(|()| id))
    }

    /// `nvmlDeviceGetComputeInstanceId` of a MIG device.
    pub(crate) fn compute_instance_id(&self, device: Handle) -> Option<Result<u32, Code>> {
        let mig = self.mig.as_ref()?;
        let mut id: c_uint = 0;
        // SAFETY: a handle NVML gave out, and a valid out-pointer.
        Some(check(unsafe { (mig.compute_instance_id)(device.0, &mut id) }).map(|()| id))
    }
}

fn check(ret: Ret) -> Result<(), Code> {
    match Code(ret) {
        Code::SUCCESS => Ok(()),
        other => Err(other),
    }
}

/// Calls `fill(buffer, size)` with an N-byte buffer and reads the C string it wrote.
fn read_string<const N: usize>(
    fill: impl FnOnce(*mut c_char, c_uint) -> Ret,
) -> Result<String, Code> {
    let mut buffer = [0 as c_char; N];
    check(fill(buffer.as_mut_ptr(), N as c_uint))?;
    // A library that forgot the terminator still cannot make us read past the buffer.
    buffer[N - 1] = 0;
    // SAFETY: the buffer is NUL-terminated (just above) and lives to the end of this function.
    let text = unsafe { CStr::from_ptr(buffer.as_ptr()) };
    Ok(text.to_string_lossy().into_owned())
}
