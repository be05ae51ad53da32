//! `Agent.alloc_memory` / `Agent.free_memory`: memory a backend allocates in the form it
//! moves best (UCX: a shared-memory segment that same-host peers reach with one copy,
//! the way `ucx_perftest` allocates), registered with every backend, and handed to
//! Python as an `Allocation` whose bytes `a.view()` gives as a writable memoryview
//! (`numpy.frombuffer(a.view(), dtype=...)`).
//!
//! Lifetime: an `Allocation` holds its agent, and every view holds the
//! `Allocation`, so neither the memory nor the agent that owns it can go while Python
//! can still reach the bytes. `free_memory` refuses (NotAllowedError) while an export
//! is alive or a request uses the region; after it, exporting again is refused. An
//! `Allocation` dropped without `free_memory` frees its region then, when no request
//! uses it (else the agent frees it when it goes).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ferry::{Error, RegionId, Subject};
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
                    "{exports} export(s) of view() (memoryview, numpy array …) still reach its \
                     bytes; release them first"
                )
                .into(),
            }));
        }
        // Deregistering an allocated region frees it (refused while a request uses it).
        py.detach(|| crate::agent::deregister_waiting(&agent.inner, id))
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
            let _ = crate::agent::deregister_waiting(&self.agent.get().inner, id);
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

    /// The bytes as a writable `memoryview` (one dimension of unsigned bytes), for
    /// `numpy.frombuffer(a.view(), dtype=...)` and the like.
    ///
    /// The view reaches the memory through a ctypes array that holds this
    /// `Allocation` and counts as an export until the last object built on it (the
    /// memoryview, NumPy arrays made from it) is gone: `free_memory` refuses until then.
    /// (A `__getbuffer__` slot would need the stable ABI of CPython 3.11; the wheel is
    /// built for 3.9's.)
    fn view<'py>(slf: Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let this = slf.get();
        // Held while the view is made, so a concurrent free_memory sees the export.
        let region = this.region.lock().unwrap_or_else(|e| e.into_inner());
        if region.is_none() {
            return Err(crate::errors::to_py(&freed()));
        }
        let ctypes = py.import("ctypes")?;
        let array_type = ctypes
            .getattr("c_ubyte")?
            .call_method1("__mul__", (this.len as usize,))?;
        let array = array_type.call_method1("from_address", (this.addr as usize,))?;
        array.setattr("allocation", &slf)?;
        this.exports.fetch_add(1, Ordering::AcqRel);
        let release = slf.getattr("_release_export")?;
        if let Err(e) = py
            .import("weakref")?
            .getattr("finalize")?
            .call1((&array, release))
        {
            this.exports.fetch_sub(1, Ordering::AcqRel);
            return Err(e);
        }
        drop(region);
        // ctypes says '<B'; a cast gives plain unsigned bytes ('B').
        py.import("builtins")?
            .getattr("memoryview")?
            .call1((array,))?
            .call_method1("cast", ("B",))
    }

    /// Called once per `view()` when the last object reaching its bytes is gone.
    fn _release_export(&self) {
        self.exports.fetch_sub(1, Ordering::AcqRel);
    }
}
