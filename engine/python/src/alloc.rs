//! `Agent.alloc_memory` / `Agent.free_memory`: memory a backend allocates in the form it
//! moves best (UCX: a shared-memory segment that same-host peers reach with one copy,
//! the way `ucx_perftest` allocates), registered with every backend, and handed to
//! Python as an `Allocation` that exports its bytes through the buffer protocol
//! (`memoryview(a)`, `numpy.frombuffer(a, dtype=...)`).
//!
//! Lifetime: an `Allocation` holds its agent, and every buffer export holds the
//! `Allocation`, so neither the memory nor the agent that owns it can go while Python
//! can still reach the bytes. `free_memory` refuses (NotAllowedError) while an export
//! is alive or a request uses the region; after it, exporting again is refused. An
//! `Allocation` dropped without `free_memory` frees its region then, when no request
//! uses it (else the agent frees it when it goes).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ferry::{Error, RegionId, Subject};
use pyo3::ffi;
use pyo3::prelude::*;

use crate::agent::Agent;

/// Memory allocated by a backend through `Agent.alloc_memory`.
#[pyclass(module = "ferry", name = "Allocation", frozen)]
pub(crate) struct Allocation {
    agent: Py<Agent>,
    addr: u64,
    len: u64,
    /// The registered region; `None` once freed.
    region: Mutex<Option<RegionId>>,
    /// Live buffer-protocol exports.
    exports: AtomicUsize,
}

fn freed() -> Error {
    Error::not_found(Subject::Named("allocation (freed by free_memory)".into()))
}

impl Allocation {
    pub(crate) fn new(agent: Py<Agent>, region: RegionId, addr: u64, len: u64) -> Allocation {
        Allocation {
            agent,
            addr,
            len,
            region: Mutex::new(Some(region)),
            exports: AtomicUsize::new(0),
        }
    }

    /// Free the allocation through `agent` (which must be its own).
    pub(crate) fn free(&self, py: Python<'_>, agent: &Agent) -> PyResult<()> {
        if !std::ptr::eq(self.agent.get(), agent) {
            return Err(crate::errors::to_py(&Error::Mismatch {
                subject: Subject::Named("allocation".into()),
                reason: "allocated by another agent".into(),
            }));
        }
        let mut region = self.region.lock().unwrap_or_else(|e| e.into_inner());
        let Some(id) = *region else {
            return Err(crate::errors::to_py(&freed()));
        };
        let exports = self.exports.load(Ordering::Acquire);
        if exports > 0 {
            return Err(crate::errors::to_py(&Error::NotAllowed {
                subject: Subject::Named("allocation".into()),
                reason: format!(
                    "{exports} buffer export(s) (memoryview, numpy array …) still reach its \
                     bytes; release them first"
                )
                .into(),
            }));
        }
        // Deregistering an allocated region frees it (refused while a request uses it).
        py.detach(|| agent.inner.deregister(id))
            .map_err(|e| crate::errors::to_py(&e))?;
        *region = None;
        Ok(())
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        let region = self
            .region
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(id) = region {
            // No export is alive (each holds this object). A request still using the
            // region makes this refuse; the agent then frees it when it goes.
            let _ = self.agent.get().inner.deregister(id);
        }
    }
}

#[pymethods]
impl Allocation {
    /// Address of the first byte.
    #[getter]
    fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    #[getter]
    fn size(&self) -> u64 {
        self.len
    }

    /// Whether `free_memory` freed it.
    #[getter]
    fn freed(&self) -> bool {
        self.region
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    fn __len__(&self) -> usize {
        self.len as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "ferry.Allocation(addr={:#x}, size={}{})",
            self.addr,
            self.len,
            if self.freed() { ", freed" } else { "" }
        )
    }

    /// `(addr, len, dev)` of `size` bytes at `offset` (default: all of it), for
    /// `get_xfer_descs` / `get_reg_descs` lists. Refused outside the allocation.
    #[pyo3(signature = (offset=0, size=None))]
    fn desc(&self, offset: u64, size: Option<u64>) -> PyResult<(u64, u64, u32)> {
        let size = size.unwrap_or(self.len.saturating_sub(offset));
        if offset.checked_add(size).is_none_or(|end| end > self.len) {
            return Err(crate::errors::to_py(&Error::invalid(
                Subject::Named("allocation part".into()),
                format!(
                    "{size} bytes at offset {offset} lie outside the allocation of {} bytes",
                    self.len
                ),
            )));
        }
        Ok((self.addr + offset, size, 0))
    }

    /// The buffer protocol: the bytes, writable, one dimension of unsigned bytes.
    ///
    /// # Safety
    ///
    /// Called by Python with a `Py_buffer` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let this = slf.get();
        // Held while the view is filled, so a concurrent free_memory sees the export.
        let region = this.region.lock().unwrap_or_else(|e| e.into_inner());
        if region.is_none() {
            return Err(crate::errors::to_py(&freed()));
        }
        this.exports.fetch_add(1, Ordering::AcqRel);
        // SAFETY: `view` is the caller's to fill; the bytes are `len` bytes of a live
        // allocation that stays mapped while this export holds `slf` (FillInfo takes a
        // reference to it) and `free_memory` refuses while `exports` counts it.
        let status = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                this.addr as *mut c_void,
                this.len as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if status != 0 {
            this.exports.fetch_sub(1, Ordering::AcqRel);
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    ///
    /// Called by Python once per successful `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }
}
