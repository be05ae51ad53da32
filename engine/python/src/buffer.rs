//! The buffer protocol's import side (`PyObject_GetBuffer` / `PyBuffer_Release`),
//! declared here because the extension is built for the stable ABI of CPython 3.9
//! (`abi3-py39`), whose limited API gained these only in 3.11.
//!
//! The functions and the `Py_buffer` layout below have been part of CPython's C API,
//! unchanged, since 3.0 and are exported by every CPython 3.9–3.13 interpreter, so one
//! abi3 wheel finds them at run time on each of them (`tests/test_wheel.py` installs
//! the wheel into 3.9 and 3.13 and registers a `bytearray` there).

use std::ffi::{c_char, c_int, c_void};

use pyo3::ffi::{PyObject, Py_ssize_t};

/// CPython's `Py_buffer` (Include/pybuffer.h), field for field.
#[repr(C)]
pub(crate) struct PyBuffer {
    /// Start of the memory.
    pub(crate) buf: *mut c_void,
    obj: *mut PyObject,
    /// Length in bytes.
    pub(crate) len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

impl PyBuffer {
    /// An empty view, for `PyObject_GetBuffer` to fill.
    pub(crate) fn empty() -> PyBuffer {
        PyBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        }
    }
}

/// `PyBUF_WRITABLE`.
pub(crate) const PYBUF_WRITABLE: c_int = 0x0001;
/// `PyBUF_ANY_CONTIGUOUS` (`0x0080 | PyBUF_STRIDES`).
pub(crate) const PYBUF_ANY_CONTIGUOUS: c_int = 0x0080 | 0x0010 | 0x0008;

extern "C" {
    /// Whether `obj` supports the buffer protocol.
    pub(crate) fn PyObject_CheckBuffer(obj: *mut PyObject) -> c_int;
    /// Export `obj`'s buffer into `view`; 0 on success, -1 with an exception set.
    pub(crate) fn PyObject_GetBuffer(
        obj: *mut PyObject,
        view: *mut PyBuffer,
        flags: c_int,
    ) -> c_int;
    /// Release a view filled by a successful `PyObject_GetBuffer`.
    pub(crate) fn PyBuffer_Release(view: *mut PyBuffer);
}
