//! The native module `devlock._devlock`: a thin layer over the devlock
//! library's public take ([`devlock::Acquiring`], [`devlock::Hold`]) and
//! status document, and the package's exception classes, raised from the
//! library's typed error. Every wait releases the GIL; the Python package
//! around it (devlock/__init__.py) owns the context manager, nesting and the
//! display.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

mod errors;

use errors::to_py;

fn seconds(value: f64, what: &str) -> PyResult<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| PyValueError::new_err(format!("{what} must be a number of seconds >= 0")))
}

/// A take in progress (see devlock::Acquiring).
#[pyclass(module = "devlock._devlock", name = "Acquiring")]
struct PyAcquiring {
    inner: Mutex<Option<devlock::Acquiring>>,
}

#[pymethods]
impl PyAcquiring {
    /// Whether the take had to wait in line (it was not free at once).
    fn is_waiting(&self) -> bool {
        self.inner
            .lock()
            .unwrap()
            .as_ref()
            .is_some_and(devlock::Acquiring::is_waiting)
    }

    /// Waits up to `seconds` with the GIL released: the hold once taken,
    /// None while still waiting; raises the error's exception when the take
    /// failed.
    fn wait(&self, py: Python<'_>, seconds: f64) -> PyResult<Option<PyHold>> {
        let limit = self::seconds(seconds, "the poll interval")?;
        let outcome = py.detach(|| {
            let mut inner = self.inner.lock().unwrap();
            let acquiring = inner.as_mut()?;
            let outcome = acquiring.wait(limit);
            if outcome.is_some() {
                // The display's last words need the label and the time.
                let done = acquiring.done_line();
                let waited = acquiring.is_waiting();
                inner.take();
                return outcome.map(|o| (o, done, waited));
            }
            None
        });
        match outcome {
            None => Ok(None),
            Some((Ok(hold), done, waited)) => Ok(Some(PyHold {
                inner: Mutex::new(Some(hold)),
                done_line: waited.then_some(done),
            })),
            Some((Err(e), _, _)) => Err(to_py(py, e)),
        }
    }

    /// A descriptor readable once the outcome is there (for an event loop's
    /// add_reader), or None when nothing waits.
    fn ready_fd(&self) -> Option<i32> {
        self.inner.lock().unwrap().as_ref()?.ready_fd()
    }

    /// Seconds until the take's timeout runs out, or None without one.
    fn time_left(&self) -> Option<f64> {
        let deadline = self.inner.lock().unwrap().as_ref()?.deadline()?;
        Some(
            deadline
                .saturating_duration_since(std::time::Instant::now())
                .as_secs_f64(),
        )
    }

    /// Leaves the line (GIL released); a lock taken at that moment is let go.
    fn cancel(&self, py: Python<'_>) {
        py.detach(|| {
            if let Some(acquiring) = self.inner.lock().unwrap().take() {
                acquiring.cancel();
            }
        });
    }

    /// The command line's waiting line (GIL released while it reads /proc):
    /// with `width`, as on a terminal line of its own; else as in a log.
    #[pyo3(signature = (width=None))]
    fn waiting_line(&self, py: Python<'_>, width: Option<usize>) -> String {
        py.detach(|| {
            self.inner
                .lock()
                .unwrap()
                .as_mut()
                .map(|a| a.waiting_line(width))
                .unwrap_or_default()
        })
    }
}

/// What a take holds (see devlock::Hold).
#[pyclass(module = "devlock._devlock", name = "Hold")]
struct PyHold {
    inner: Mutex<Option<devlock::Hold>>,
    done_line: Option<String>,
}

impl PyHold {
    fn with<T>(&self, f: impl FnOnce(&devlock::Hold) -> T, empty: T) -> T {
        self.inner.lock().unwrap().as_ref().map_or(empty, f)
    }
}

#[pymethods]
impl PyHold {
    /// The resources the take was for (an any's picks), groups left out.
    fn resources(&self) -> Vec<String> {
        self.with(devlock::Hold::resources, Vec::new())
    }

    /// (resource, exclusive) for every lock it keeps or passed through.
    fn locks(&self) -> Vec<(String, bool)> {
        self.with(
            |h| {
                h.locks()
                    .into_iter()
                    .map(|l| (l.resource, l.exclusive))
                    .collect()
            },
            Vec::new(),
        )
    }

    /// The descriptors a child process must inherit to run inside the hold.
    fn fds(&self) -> Vec<i32> {
        self.with(devlock::Hold::fds, Vec::new())
    }

    /// The semaphore slot (slots=N), from 1.
    fn slot(&self) -> Option<u64> {
        self.with(devlock::Hold::slot, None)
    }

    /// CUDA_VISIBLE_DEVICES for the hold's gpu:N resources.
    fn cuda_visible_devices(&self) -> Option<String> {
        self.with(devlock::Hold::cuda_visible_devices, None)
    }

    /// Whether the take took nothing of its own (it passed through).
    fn is_nested(&self) -> bool {
        self.with(devlock::Hold::is_nested, true)
    }

    /// (resources, locks, fds, slot, cuda_visible_devices, is_nested) in one call.
    #[allow(clippy::type_complexity)]
    fn info(
        &self,
    ) -> (
        Vec<String>,
        Vec<(String, bool)>,
        Vec<i32>,
        Option<u64>,
        Option<String>,
        bool,
    ) {
        self.with(
            |h| {
                (
                    h.resources(),
                    h.locks()
                        .into_iter()
                        .map(|l| (l.resource, l.exclusive))
                        .collect(),
                    h.fds(),
                    h.slot(),
                    h.cuda_visible_devices(),
                    h.is_nested(),
                )
            },
            (Vec::new(), Vec::new(), Vec::new(), None, None, true),
        )
    }

    /// The process that took it.
    fn pid(&self) -> u32 {
        self.with(devlock::Hold::pid, 0)
    }

    /// Whether this process holds it now, asked of the kernel.
    fn holds_here(&self) -> bool {
        self.with(devlock::Hold::holds_here, false)
    }

    /// `devlock: got gpu after 5s` for a take that waited, else None.
    fn done_line(&self) -> Option<String> {
        self.done_line.clone()
    }

    /// The memory budget held (mem=), MiB, else None.
    fn budget_mib(&self) -> Option<u64> {
        self.with(devlock::Hold::budget_mib, None)
    }

    /// [(name, value)] a budget's work learns (DEVLOCK_MEM_MIB, and
    /// XLA_PYTHON_CLIENT_MEM_FRACTION unless set already), read now.
    fn budget_env(&self) -> Vec<(String, String)> {
        self.with(devlock::Hold::budget_env, Vec::new())
    }

    /// Calls `callback(kind, line)` on the budget watch's thread (with the
    /// GIL) for each thing it says: kind "over" or "stop".
    fn on_budget_event(&self, py: Python<'_>, callback: Py<PyAny>) {
        let sink: devlock::BudgetSink = Box::new(move |event| {
            let (kind, line) = match event {
                devlock::BudgetEvent::OverBudget(line) => ("over", line),
                devlock::BudgetEvent::Stop(line) => ("stop", line),
            };
            Python::attach(|py| {
                if let Err(e) = callback.call1(py, (kind, line)) {
                    e.write_unraisable(py, None);
                }
            });
        });
        // Released: the sink may be called at once and take the GIL.
        py.detach(|| self.with(|h| h.on_budget_event(sink), ()));
    }

    /// Calls `callback(kind, line)` on the usage thread (with the GIL) for
    /// each thing the idle policy says: kind "idle" or "stop".
    fn on_idle_event(&self, py: Python<'_>, callback: Py<PyAny>) {
        let sink: devlock::IdleSink = Box::new(move |event| {
            let (kind, line) = match event {
                devlock::IdleEvent::Idle(line) => ("idle", line),
                devlock::IdleEvent::Stop(line) => ("stop", line),
            };
            Python::attach(|py| {
                if let Err(e) = callback.call1(py, (kind, line)) {
                    e.write_unraisable(py, None);
                }
            });
        });
        py.detach(|| self.with(|h| h.on_idle_event(sink), ()));
    }

    /// The idle stop's line, once the policy said stop (idle_timeout=).
    fn stopped_idle(&self) -> Option<String> {
        self.with(devlock::Hold::stopped_idle, None)
    }

    /// The strict stop's line, once the watch said stop (mem_strict=True).
    fn stopped_over_budget(&self) -> Option<String> {
        self.with(devlock::Hold::stopped_over_budget, None)
    }

    /// Lets go (in a forked child: of the child's copies only). Idempotent.
    fn release(&self, py: Python<'_>) {
        let hold = self.inner.lock().unwrap().take();
        py.detach(move || drop(hold));
    }

    /// Whether release_when_free asks the driver (else it lets go at once).
    fn asks_the_driver(&self) -> bool {
        self.with(devlock::Hold::asks_the_driver, false)
    }

    /// Lets go now when the driver lists neither this process nor one it
    /// started on the hold's GPUs (one query, GIL released); else keeps it
    /// until it no longer does, and returns the Kept hold. Idempotent.
    fn release_when_free(&self, py: Python<'_>) -> Option<PyKept> {
        let hold = self.inner.lock().unwrap().take()?;
        py.detach(move || hold.release_when_device_free())
            .map(|inner| PyKept { inner })
    }
}

/// A hold kept past its block's end while the device is busy (see
/// devlock::Kept).
#[pyclass(module = "devlock._devlock", name = "Kept", frozen)]
struct PyKept {
    inner: devlock::Kept,
}

#[pymethods]
impl PyKept {
    /// Why it is kept, and the remedies, in one line.
    fn line(&self) -> String {
        self.inner.line().to_owned()
    }

    /// Whether the keeper still holds it.
    fn is_held(&self) -> bool {
        self.inner.is_held()
    }

    /// The hold back from the keeper (a new block of this process runs
    /// inside it), or None once let go.
    fn take_back(&self, py: Python<'_>) -> Option<PyHold> {
        py.detach(|| self.inner.take_back()).map(|hold| PyHold {
            inner: Mutex::new(Some(hold)),
            done_line: None,
        })
    }

    /// Lets go now (GIL released).
    fn release(&self, py: Python<'_>) {
        py.detach(|| self.inner.release());
    }

    /// In a forked child: closes the child's copies of its descriptors.
    fn forget_in_child(&self) {
        self.inner.forget_in_child();
    }
}

/// A duration given as text (`"2s"`, `"10m"`, `"90"`), in seconds, as the
/// command line reads one; a usage error in Python's words otherwise.
#[pyfunction]
fn seconds_of(py: Python<'_>, name: &str, text: &str) -> PyResult<f64> {
    devlock::duration_of(name, text)
        .map(|d| d.as_secs_f64())
        .map_err(|e| to_py(py, e))
}

/// Starts a take (GIL released): checks the options, takes at once when
/// free, else (unless wait is false) waits in line on a thread of its own.
#[pyfunction]
#[pyo3(signature = (resources, *, dir, step, wait, timeout, shared, slots, any, count, mem, mem_headroom, settle, mem_strict, inside, idle_timeout=None))]
#[allow(clippy::too_many_arguments)]
fn start(
    py: Python<'_>,
    resources: Vec<String>,
    dir: PathBuf,
    step: String,
    wait: bool,
    timeout: Option<f64>,
    shared: bool,
    slots: Option<u16>,
    any: bool,
    count: u8,
    mem: Option<String>,
    mem_headroom: Option<String>,
    settle: Option<f64>,
    mem_strict: bool,
    inside: Vec<(String, bool)>,
    idle_timeout: Option<f64>,
) -> PyResult<PyAcquiring> {
    let wait = match (wait, timeout) {
        (false, Some(_)) => {
            return Err(PyValueError::new_err(
                "wait=False and timeout= exclude each other (as -n and -w do)",
            ));
        }
        (false, None) => devlock::Wait::NoWait,
        (true, None) => devlock::Wait::Block,
        (true, Some(t)) => devlock::Wait::Timeout(seconds(t, "timeout")?),
    };
    let spec = devlock::Spec {
        resources,
        shared,
        slots,
        any,
        count,
        mem,
        mem_headroom,
        settle: settle.map(|t| seconds(t, "settle")).transpose()?,
        mem_strict,
        idle_timeout: idle_timeout
            .map(|t| seconds(t, "idle_timeout"))
            .transpose()?,
    };
    let options = devlock::Options { dir, wait, step };
    let inside: Vec<devlock::HeldLock> = inside
        .into_iter()
        .map(|(resource, exclusive)| devlock::HeldLock {
            resource,
            exclusive,
        })
        .collect();
    let acquiring = py
        .detach(|| devlock::Acquiring::start(&spec, &options, &inside))
        .map_err(|e| to_py(py, e))?;
    Ok(PyAcquiring {
        inner: Mutex::new(Some(acquiring)),
    })
}

/// The JSON text of `devlock status --json [RESOURCE...]` (GIL released).
#[pyfunction]
#[pyo3(signature = (dir, resources, probe_timeout))]
fn status(
    py: Python<'_>,
    dir: PathBuf,
    resources: Vec<String>,
    probe_timeout: Option<f64>,
) -> PyResult<String> {
    let probe = probe_timeout
        .map(|t| seconds(t, "probe_timeout"))
        .transpose()?;
    py.detach(|| devlock::status_document(&dir, &resources, probe))
        .map_err(|e| to_py(py, e))
}

#[pymodule]
fn _devlock(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::add_to(m)?;
    m.add("DEFAULT_DIR", devlock::DEFAULT_DIR)?;
    m.add("VERSION", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<PyAcquiring>()?;
    m.add_class::<PyHold>()?;
    m.add_class::<PyKept>()?;
    m.add_function(wrap_pyfunction!(seconds_of, m)?)?;
    m.add_function(wrap_pyfunction!(start, m)?)?;
    m.add_function(wrap_pyfunction!(status, m)?)?;
    Ok(())
}
