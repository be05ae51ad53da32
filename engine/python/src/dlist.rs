//! Descriptor lists and typed handles as Python objects.

use ferry::{MemKind, PrepId, XferId};
use pyo3::prelude::*;
use pyo3::types::PyList;
use slotmap::{Key, KeyData};

use crate::memory::Described;

/// A descriptor list of one memory kind (NIXL's `nixlRegDList` / `nixlXferDList`).
/// Holds what keeps its memory alive; after `register_memory` it also names the
/// regions it registered.
#[pyclass(module = "ferry", name = "DescList", frozen)]
pub(crate) struct DList {
    pub(crate) described: Described,
    /// Registered regions (as `as_ffi` values), one per descriptor; empty unless this
    /// list came from `register_memory`. Cleared by `deregister_memory`.
    pub(crate) regions: std::sync::Mutex<Vec<u64>>,
}

impl DList {
    pub(crate) fn new(described: Described) -> DList {
        DList {
            described,
            regions: std::sync::Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn kind(&self) -> MemKind {
        self.described.kind.unwrap_or(MemKind::Dram)
    }
}

#[pymethods]
impl DList {
    /// Number of descriptors.
    fn __len__(&self) -> usize {
        self.described.descs.len()
    }

    /// The memory kind (`"DRAM"`, `"VRAM"`, `"FILE"` …).
    #[getter]
    fn mem_type(&self) -> &'static str {
        self.kind().name()
    }

    /// The descriptors as `(addr, len, dev)` tuples.
    fn descs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        PyList::new(
            py,
            self.described.descs.iter().map(|d| (d.addr, d.len, d.dev)),
        )
    }

    /// Whether the list names registered regions (it came from `register_memory` and
    /// was not deregistered).
    #[getter]
    fn is_registered(&self) -> bool {
        !self
            .regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    fn __repr__(&self) -> String {
        format!(
            "DescList({} × {}{})",
            self.described.descs.len(),
            self.kind().name(),
            if self.is_registered() {
                ", registered"
            } else {
                ""
            }
        )
    }
}

macro_rules! handle_class {
    ($name:ident, $py:literal, $id:ty, $doc:literal) => {
        #[doc = $doc]
        #[pyclass(module = "ferry", name = $py, frozen, eq, hash)]
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        pub(crate) struct $name(pub(crate) u64);

        impl $name {
            pub(crate) fn of(id: $id) -> Self {
                $name(id.data().as_ffi())
            }
            pub(crate) fn id(self) -> $id {
                <$id>::from(KeyData::from_ffi(self.0))
            }
        }

        #[pymethods]
        impl $name {
            /// The handle as an integer (what the batch API's arrays hold).
            fn __int__(&self) -> u64 {
                self.0
            }
            fn __index__(&self) -> u64 {
                self.0
            }
            fn __repr__(&self) -> String {
                format!(concat!($py, "({:#x})"), self.0)
            }
        }
    };
}

handle_class!(
    XferHandle,
    "XferHandle",
    XferId,
    "A transfer request (NIXL's `nixl_xfer_handle`)."
);
handle_class!(
    PrepHandle,
    "PreppedHandle",
    PrepId,
    "A prepared descriptor list (NIXL's `nixl_prepped_dlist_handle`)."
);

/// An xfer handle from a Python value: an `XferHandle` or its integer.
pub(crate) fn xfer_id(obj: &Bound<'_, PyAny>) -> PyResult<XferId> {
    if let Ok(h) = obj.cast::<XferHandle>() {
        return Ok(h.get().id());
    }
    if obj.cast::<PrepHandle>().is_ok() {
        return Err(crate::errors::invalid(
            "a prepared-list handle was given where a transfer handle is needed",
        ));
    }
    let v: u64 = obj
        .extract()
        .map_err(|_| crate::errors::invalid("a transfer handle (XferHandle or int) is needed"))?;
    Ok(XferHandle(v).id())
}

/// A prepared-list handle from a Python value: a `PreppedHandle` or its integer.
pub(crate) fn prep_id(obj: &Bound<'_, PyAny>) -> PyResult<PrepId> {
    if let Ok(h) = obj.cast::<PrepHandle>() {
        return Ok(h.get().id());
    }
    if obj.cast::<XferHandle>().is_ok() {
        return Err(crate::errors::invalid(
            "a transfer handle was given where a prepared-list handle is needed",
        ));
    }
    let v: u64 = obj.extract().map_err(|_| {
        crate::errors::invalid("a prepared-list handle (PreppedHandle or int) is needed")
    })?;
    Ok(PrepHandle(v).id())
}

/// Index lists: a 1-D NumPy integer array (any integer dtype; read in place for
/// `uint32`, `int32`, `int64`, `uint64`) or a sequence of ints, into `out`.
pub(crate) fn indices(obj: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> PyResult<()> {
    use numpy::{PyArrayMethods, PyUntypedArrayMethods};
    out.clear();
    if obj.is_none() {
        return Ok(());
    }
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        if a.ndim() != 1 {
            return Err(crate::errors::invalid("index arrays must be 1-D"));
        }
        macro_rules! read {
            ($($t:ty),*) => {$(
                if let Ok(a) = obj.cast::<numpy::PyArray1<$t>>() {
                    let ro = a.readonly();
                    if let Ok(s) = ro.as_slice() {
                        for &v in s {
                            out.push(index(v as i128)?);
                        }
                        return Ok(());
                    }
                }
            )*};
        }
        read!(u32, i32, i64, u64, u16, i16, u8, i8);
    }
    for item in obj.try_iter()? {
        let v: i64 = item?
            .extract()
            .map_err(|_| crate::errors::invalid("indices must be integers"))?;
        out.push(index(v as i128)?);
    }
    Ok(())
}

fn index(v: i128) -> PyResult<u32> {
    u32::try_from(v)
        .map_err(|_| crate::errors::invalid(format!("index {v} is out of range 0..2**32")))
}
