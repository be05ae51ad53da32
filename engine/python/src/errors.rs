//! Ferry's errors as Python exceptions: one class per status name, all under
//! `ferry.FerryError`, each carrying `status` (the NIXL-style status name, as a class
//! attribute) and `kind` (the Rust variant, on the instance).

use ferry::Error;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

pyo3::create_exception!(
    ferry,
    FerryError,
    PyException,
    "Base of every Ferry error; `status` is the status name (e.g. \"NOT_FOUND\")."
);
pyo3::create_exception!(
    ferry,
    InvalidParamError,
    FerryError,
    "INVALID_PARAM: malformed input."
);
pyo3::create_exception!(
    ferry,
    NotFoundError,
    FerryError,
    "NOT_FOUND: no such object (or stale handle)."
);
pyo3::create_exception!(
    ferry,
    MismatchError,
    FerryError,
    "MISMATCH: two things that must agree do not."
);
pyo3::create_exception!(
    ferry,
    NotAllowedError,
    FerryError,
    "NOT_ALLOWED: valid, but not in this state."
);
pyo3::create_exception!(
    ferry,
    RepostActiveError,
    FerryError,
    "REPOST_ACTIVE: the request is still in progress."
);
pyo3::create_exception!(
    ferry,
    NotSupportedError,
    FerryError,
    "NOT_SUPPORTED: the backend or agent cannot do this."
);
pyo3::create_exception!(
    ferry,
    BackendError,
    FerryError,
    "BACKEND: a backend failed."
);
pyo3::create_exception!(
    ferry,
    RemoteDisconnectError,
    FerryError,
    "REMOTE_DISCONNECT: the peer went away."
);
pyo3::create_exception!(
    ferry,
    CanceledError,
    FerryError,
    "CANCELED: the transfer was canceled."
);
pyo3::create_exception!(
    ferry,
    NoTelemetryError,
    FerryError,
    "NO_TELEM: the request has no telemetry."
);

pyo3::create_exception!(
    ferry,
    PoisonedError,
    FerryError,
    "POISONED: a panic inside an earlier flush stopped this agent; it refuses all work (make a new one)."
);

/// The exception classes with their status names, for registration in the module.
pub(crate) fn classes(
    py: Python<'_>,
) -> [(&'static str, &'static str, Bound<'_, pyo3::types::PyType>); 12] {
    [
        ("FerryError", "", py.get_type::<FerryError>()),
        (
            "InvalidParamError",
            "INVALID_PARAM",
            py.get_type::<InvalidParamError>(),
        ),
        ("NotFoundError", "NOT_FOUND", py.get_type::<NotFoundError>()),
        ("MismatchError", "MISMATCH", py.get_type::<MismatchError>()),
        (
            "NotAllowedError",
            "NOT_ALLOWED",
            py.get_type::<NotAllowedError>(),
        ),
        (
            "RepostActiveError",
            "REPOST_ACTIVE",
            py.get_type::<RepostActiveError>(),
        ),
        (
            "NotSupportedError",
            "NOT_SUPPORTED",
            py.get_type::<NotSupportedError>(),
        ),
        ("BackendError", "BACKEND", py.get_type::<BackendError>()),
        (
            "RemoteDisconnectError",
            "REMOTE_DISCONNECT",
            py.get_type::<RemoteDisconnectError>(),
        ),
        ("CanceledError", "CANCELED", py.get_type::<CanceledError>()),
        (
            "NoTelemetryError",
            "NO_TELEM",
            py.get_type::<NoTelemetryError>(),
        ),
        ("PoisonedError", "POISONED", py.get_type::<PoisonedError>()),
    ]
}

/// The Rust variant's name, for `exc.kind` (finer than the status name: `StaleRegion`,
/// `Capacity`, `InvalidMetadata` …).
fn kind(error: &Error) -> &'static str {
    match error {
        Error::InvalidParam { .. } => "InvalidParam",
        Error::NotFound { .. } => "NotFound",
        Error::Mismatch { .. } => "Mismatch",
        Error::NotAllowed { .. } => "NotAllowed",
        Error::RepostActive { .. } => "RepostActive",
        Error::NotSupported { .. } => "NotSupported",
        Error::Backend { .. } => "Backend",
        Error::RemoteDisconnect { .. } => "RemoteDisconnect",
        Error::Canceled { .. } => "Canceled",
        Error::NoTelemetry { .. } => "NoTelemetry",
        Error::InvalidMetadata { .. } => "InvalidMetadata",
        Error::Capacity { .. } => "Capacity",
        Error::StaleRegion { .. } => "StaleRegion",
        Error::Poisoned { .. } => "Poisoned",
        Error::DependencyFailed { .. } => "DependencyFailed",
    }
}

/// The Python exception for a Ferry error.
pub(crate) fn to_py(error: &Error) -> PyErr {
    let message = error.to_string();
    let err = match error.status_name() {
        "INVALID_PARAM" => InvalidParamError::new_err(message),
        "NOT_FOUND" => NotFoundError::new_err(message),
        "MISMATCH" => MismatchError::new_err(message),
        "NOT_ALLOWED" => NotAllowedError::new_err(message),
        "REPOST_ACTIVE" => RepostActiveError::new_err(message),
        "NOT_SUPPORTED" => NotSupportedError::new_err(message),
        "BACKEND" => BackendError::new_err(message),
        "REMOTE_DISCONNECT" => RemoteDisconnectError::new_err(message),
        "CANCELED" => CanceledError::new_err(message),
        "NO_TELEM" => NoTelemetryError::new_err(message),
        "POISONED" => PoisonedError::new_err(message),
        _ => FerryError::new_err(message),
    };
    let kind = kind(error);
    Python::attach(|py| {
        let _ = err.value(py).setattr("kind", kind);
    });
    err
}

/// `Result<T, ferry::Error>` → `PyResult<T>`.
pub(crate) trait IntoPy<T> {
    /// Convert the error side.
    fn py(self) -> PyResult<T>;
}

impl<T> IntoPy<T> for ferry::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(|e| to_py(&e))
    }
}

/// An `InvalidParamError` naming what was wrong with a Python argument.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    let err = InvalidParamError::new_err(message.into());
    Python::attach(|py| {
        let _ = err.value(py).setattr("kind", "InvalidParam");
    });
    err
}
