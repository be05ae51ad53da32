//! Python bindings of Ferry: the `ferry` module.
//!
//! `ferry.Agent` mirrors NIXL's `nixl_agent` method by method where the concept is the
//! same (register, describe, prepare, make, transfer, check, release, notifications,
//! metadata, backends), so NIXL code ports line by line; `ferry.Batch` exposes the
//! command buffer, so one Python call records many commands and one flush runs them.
//! Errors are exceptions under `ferry.FerryError`, one class per status name.
//!
//! Memory safety across the boundary: registered Python objects are kept alive (and
//! buffer-protocol exports held) until deregistered; memory a backend allocated
//! (`alloc_memory`) is freed only when no export of it is alive; the engine refuses to deregister
//! memory a request is using and refuses requests naming deregistered memory.
//! The GIL is released during every flush (every call that reaches the executor).

// Reason: PyO3 glue and the buffer protocol are FFI; each unsafe block says why it holds.
#![allow(unsafe_code)]

mod agent;
mod alloc;
mod batch;
mod buffer;
mod dlist;
mod errors;
mod memory;

use pyo3::prelude::*;

/// The native module, `ferry._ferry`; the `ferry` package (python/ferry) re-exports it
/// and adds `ferry.nixl`, the NIXL-compatible layer.
#[pymodule]
#[pyo3(name = "_ferry")]
fn ferry_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<agent::Agent>()?;
    m.add_class::<agent::AgentConfig>()?;
    m.add_class::<alloc::Allocation>()?;
    m.add_class::<batch::Batch>()?;
    m.add_class::<dlist::DList>()?;
    m.add_class::<dlist::XferHandle>()?;
    m.add_class::<dlist::PrepHandle>()?;
    m.add("DEFAULT_BACKENDS", ::ferry::DEFAULT_BACKENDS.to_vec())?;
    for (name, status, ty) in errors::classes(py) {
        ty.setattr("status", status)?;
        m.add(name, ty)?;
    }
    m.add("OK", batch::OK)?;
    m.add("IN_PROGRESS", batch::IN_PROGRESS)?;
    m.add("NOT_POSTED", batch::NOT_POSTED)?;
    m.add("PENDING", batch::PENDING)?;
    m.add("FAILED", batch::FAILED)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PROMETHEUS", cfg!(feature = "prometheus"))?;
    // VRAM through UCX and GDS: `__cuda_array_interface__` objects and CUDA tensors
    // register as VRAM where a CUDA driver, a device and a CUDA-capable UCX exist.
    m.add("CUDA", cfg!(feature = "cuda"))?;
    Ok(())
}
