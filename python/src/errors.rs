//! The package's exception classes (`devlock.Error` and its kinds, and
//! `Holder`), made in the native module and raised from the library's
//! typed error.

use devlock::exit::ExitCode;
use pyo3::exceptions::{PyException, PyNotImplementedError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The package's exception classes (`devlock.Error` and its kinds), made in
/// this module and raised from the library's typed error.
struct Classes {
    error: Py<PyType>,
    usage: Py<PyType>,
    not_supported: Py<PyType>,
    unsafe_file: Py<PyType>,
    device_unknown: Py<PyType>,
    busy: Py<PyType>,
    timeout: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// An exception class of the package: `name` with `bases`, `doc`, the exit
/// code the command line ends with for it, and `extra` class attributes.
fn class<'py>(
    py: Python<'py>,
    name: &str,
    bases: &[Bound<'py, PyAny>],
    doc: &str,
    code: ExitCode,
    extra: &[(&str, Bound<'py, PyAny>)],
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "devlock")?;
    namespace.set_item("__doc__", doc)?;
    namespace.set_item("exit_code", code.code())?;
    for (key, value) in extra {
        namespace.set_item(*key, value)?;
    }
    let made = py
        .get_type::<PyType>()
        .call1((name, PyTuple::new(py, bases)?, namespace))?;
    Ok(made.cast_into::<PyType>()?.unbind())
}

/// The one line an exception says: its first argument.
#[pyfunction]
fn message_of(exc: &Bound<'_, PyAny>) -> PyResult<Py<PyAny>> {
    let args = exc.getattr("args")?;
    match args.len()? {
        0 => Ok("".into_pyobject(exc.py())?.into_any().unbind()),
        _ => Ok(args.get_item(0)?.unbind()),
    }
}

fn classes<'py>(m: &Bound<'py, PyModule>) -> PyResult<&'py Classes> {
    let py = m.py();
    CLASSES.get_or_try_init(py, || {
        let property = py.import("builtins")?.getattr("property")?;
        let message = property.call1((wrap_pyfunction!(message_of, m)?,))?;
        let error = class(
            py,
            "Error",
            &[py.get_type::<PyException>().into_any()],
            "Any failure of devlock; ``exit_code`` is what the command line would exit with, \
             ``message`` its one line.",
            ExitCode::GeneralError,
            &[("message", message)],
        )?;
        let base = error.bind(py).clone().into_any();
        let busy = class(
            py,
            "Busy",
            std::slice::from_ref(&base),
            "Someone else holds the lock and the block was not to wait (``wait=False``, the \
             command line's ``-n``): ``holder`` names them, ``resource`` is the lock in the way.",
            ExitCode::Busy,
            &[
                ("resource", py.None().into_bound(py)),
                ("holder", Bound::new(py, Holder::default())?.into_any()),
            ],
        )?;
        Ok(Classes {
            usage: class(
                py,
                "UsageError",
                &[base.clone(), py.get_type::<PyValueError>().into_any()],
                "A bad resource name or a bad combination of options (the command line's usage error).",
                ExitCode::Usage,
                &[],
            )?,
            not_supported: class(
                py,
                "NotSupported",
                &[base.clone(), py.get_type::<PyNotImplementedError>().into_any()],
                "An option that this build of devlock does not have yet.",
                ExitCode::Usage,
                &[],
            )?,
            unsafe_file: class(
                py,
                "UnsafeFile",
                std::slice::from_ref(&base),
                "The scratch directory or a lock file is unsafe or unusable: a symbolic link, a \
                 FIFO, a directory where a lock file belongs, a network filesystem, a directory \
                 that cannot be created.",
                ExitCode::IoError,
                &[],
            )?,
            device_unknown: class(
                py,
                "DeviceUnknown",
                std::slice::from_ref(&base),
                "A memory budget's device whose memory cannot be learned (no driver, nvidia-smi \
                 missing, failed or timed out), as the command line's ``--mem`` says it.",
                ExitCode::NotIdle,
                &[],
            )?,
            timeout: class(
                py,
                "Timeout",
                &[busy.bind(py).clone().into_any()],
                "The wait ran out of time (``timeout=``, the command line's ``-w``); the block \
                 left the line.",
                ExitCode::Busy,
                &[],
            )?,
            busy,
            error,
        })
    })
}

/// Who holds a lock, as ``devlock -n`` names them; None where nobody can tell.
#[pyclass(module = "devlock", name = "Holder", frozen, eq, hash)]
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
struct Holder {
    #[pyo3(get)]
    step: Option<String>,
    #[pyo3(get)]
    pid: Option<u32>,
    #[pyo3(get)]
    user: Option<String>,
}

#[pymethods]
impl Holder {
    #[new]
    #[pyo3(signature = (step=None, pid=None, user=None))]
    fn new(step: Option<String>, pid: Option<u32>, user: Option<String>) -> Holder {
        Holder { step, pid, user }
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let text = |v: &Option<String>| -> PyResult<String> {
            Ok(v.into_pyobject(py)?.repr()?.to_string())
        };
        let pid = self.pid.map_or("None".to_owned(), |p| p.to_string());
        Ok(format!(
            "Holder(step={}, pid={pid}, user={})",
            text(&self.step)?,
            text(&self.user)?
        ))
    }
}

/// Raises the library's error as the package's exception of its kind, with
/// the command line's line and exit code (and for a busy lock, who holds it).
pub(crate) fn to_py(py: Python<'_>, err: devlock::Error) -> PyErr {
    {
        let raised = || -> PyResult<PyErr> {
            let c = CLASSES
                .get(py)
                .expect("the classes are made as the module is imported");
            let (cls, busy) = match &err {
                devlock::Error::Busy(busy) => (&c.busy, Some(busy)),
                devlock::Error::Timeout(busy) => (&c.timeout, Some(busy)),
                devlock::Error::Usage(_) => (&c.usage, None),
                devlock::Error::NotSupported(_) => (&c.not_supported, None),
                devlock::Error::Unsafe(_) => (&c.unsafe_file, None),
                devlock::Error::DeviceUnknown(_) => (&c.device_unknown, None),
                _ => (&c.error, None),
            };
            let cls = cls.bind(py);
            let exc = cls.call1((err.message(),))?;
            let code = ExitCode::from(&err).code();
            if cls.getattr("exit_code")?.extract::<i32>()? != code {
                exc.setattr("exit_code", code)?;
            }
            if let Some(busy) = busy {
                exc.setattr("resource", &busy.resource)?;
                let holder = busy
                    .holder
                    .clone()
                    .map_or_else(Holder::default, |h| Holder {
                        step: h.step,
                        pid: h.pid,
                        user: h.user,
                    });
                exc.setattr("holder", Bound::new(py, holder)?)?;
            }
            Ok(PyErr::from_value(exc))
        };
        raised().unwrap_or_else(|e| e)
    }
}

/// Adds the exception classes and `Holder` to the native module.
pub(crate) fn add_to(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let c = classes(m)?;
    let py = m.py();
    for (name, cls) in [
        ("Error", &c.error),
        ("UsageError", &c.usage),
        ("NotSupported", &c.not_supported),
        ("UnsafeFile", &c.unsafe_file),
        ("DeviceUnknown", &c.device_unknown),
        ("Busy", &c.busy),
        ("Timeout", &c.timeout),
    ] {
        m.add(name, cls.bind(py))?;
    }
    m.add_class::<Holder>()?;
    Ok(())
}
