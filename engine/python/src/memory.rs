//! Turning Python objects into descriptors, and keeping their memory alive.
//!
//! Accepted (in this order): a Ferry descriptor list; a 2-D integer NumPy array of
//! shape `(N, 3)` (rows of `addr, len, dev`); one `(addr, len, dev)` tuple (or
//! `(addr, len, dev, path)` for FILE); a torch tensor; an object with
//! `__cuda_array_interface__` (VRAM); an object with `__array_interface__` (NumPy
//! arrays: DRAM); an object with the buffer protocol (DRAM); a list or tuple of any of
//! these. Objects that own memory are kept alive (and, for the buffer protocol,
//! exported, so a `bytearray` cannot be resized) for as long as a descriptor list or a
//! registration holds them.

use std::sync::Arc;

use crate::buffer::{self, PyBuffer};
use ferry::{Desc, MemKind};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::errors::invalid;

/// What a descriptor is for: registration needs writable memory (peers may write it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// `register_memory` / `get_reg_descs`.
    Register,
    /// `get_xfer_descs` / `prep_xfer_dlist` / `initialize_xfer`.
    Xfer,
}

/// A buffer-protocol export held until dropped (the exporter cannot resize or free the
/// memory while it is held).
pub(crate) struct Exported(Box<PyBuffer>);

// SAFETY: the Py_buffer is only created and released with the GIL held (`Drop`
// attaches); in between it is plain data that no one reads through.
unsafe impl Send for Exported {}
// SAFETY: as above; shared references never touch the buffer.
unsafe impl Sync for Exported {}

impl Drop for Exported {
    fn drop(&mut self) {
        Python::attach(|_| {
            // SAFETY: the buffer was filled by a successful PyObject_GetBuffer and is
            // released exactly once, here, with the GIL held.
            unsafe { buffer::PyBuffer_Release(&mut *self.0) }
        });
    }
}

/// What keeps one descriptor's memory alive: the Python object (and its export).
pub(crate) struct Keep {
    /// The object owning the memory.
    _object: Py<PyAny>,
    /// The buffer-protocol export, if the memory came through it.
    _export: Option<Exported>,
}

/// Descriptors of one memory kind, with what keeps each one's memory alive.
#[derive(Default, Clone)]
pub(crate) struct Described {
    /// The kind, once known.
    pub(crate) kind: Option<MemKind>,
    /// One per descriptor.
    pub(crate) descs: Vec<Desc>,
    /// One per descriptor; `None` for raw addresses (the caller keeps those alive).
    pub(crate) keeps: Vec<Option<Arc<Keep>>>,
    /// One per descriptor: the path of a FILE given as `(offset, len, id, path)`.
    pub(crate) paths: Vec<Option<String>>,
}

impl Described {
    fn push(
        &mut self,
        kind: MemKind,
        desc: Desc,
        keep: Option<Arc<Keep>>,
        path: Option<String>,
    ) -> PyResult<()> {
        match self.kind {
            Some(k) if k != kind => {
                return Err(crate::errors::to_py(&ferry::Error::Mismatch {
                    subject: ferry::Subject::Named("descriptor list".into()),
                    reason: format!("mixes memory kinds {} and {}", k.name(), kind.name()).into(),
                }))
            }
            _ => self.kind = Some(kind),
        }
        self.descs.push(desc);
        self.keeps.push(keep);
        self.paths.push(path);
        Ok(())
    }
}

/// Parse a memory-kind name: NIXL's (`DRAM`, `VRAM`, `FILE`, `BLOCK`, `OBJECT`) or
/// torch's device types (`cpu`, `cuda`).
pub(crate) fn parse_kind(name: &str) -> PyResult<MemKind> {
    match name.to_ascii_uppercase().as_str() {
        "DRAM" | "CPU" | "DRAM_SEG" => Ok(MemKind::Dram),
        "VRAM" | "CUDA" | "GPU" | "VRAM_SEG" => Ok(MemKind::Vram),
        "FILE" | "FILE_SEG" => Ok(MemKind::File),
        "BLOCK" | "BLK" | "BLK_SEG" => Ok(MemKind::Block),
        "OBJECT" | "OBJ" | "OBJ_SEG" => Ok(MemKind::Object),
        _ => Err(invalid(format!(
            "unknown memory type {name:?} (DRAM, VRAM, FILE, BLOCK, OBJECT, cpu or cuda)"
        ))),
    }
}

/// Describe `obj` (see the module docs). `kind` is the caller's `mem_type`, if given:
/// raw descriptors take it (DRAM otherwise); objects whose kind is known must agree.
pub(crate) fn describe(
    obj: &Bound<'_, PyAny>,
    kind: Option<MemKind>,
    purpose: Purpose,
) -> PyResult<Described> {
    let mut out = Described {
        kind,
        ..Described::default()
    };
    describe_into(obj, kind, purpose, &mut out, 0)?;
    if out.descs.is_empty() {
        return Err(invalid("empty descriptor list"));
    }
    Ok(out)
}

/// Nesting depth of lists accepted (a list of arrays is depth 1).
const DEPTH_MAX: u32 = 2;

fn describe_into(
    obj: &Bound<'_, PyAny>,
    kind: Option<MemKind>,
    purpose: Purpose,
    out: &mut Described,
    depth: u32,
) -> PyResult<()> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<crate::dlist::DList>() {
        let list = list.borrow();
        let d = &list.described;
        for i in 0..d.descs.len() {
            let k = d.kind.unwrap_or(MemKind::Dram);
            out.push(k, d.descs[i], d.keeps[i].clone(), d.paths[i].clone())?;
        }
        return Ok(());
    }
    if let Some(rows) = raw_rows(obj)? {
        let k = kind.unwrap_or(MemKind::Dram);
        for row in rows.chunks_exact(3) {
            out.push(k, Desc::new(row[0], row[1], row[2]), None, None)?;
        }
        return Ok(());
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        if t.len() >= 3 && t.get_item(0)?.is_instance_of::<pyo3::types::PyInt>() {
            return push_tuple(t, kind, out);
        }
    }
    if let Some((k, desc)) = torch_tensor(obj)? {
        check_kind(kind, k)?;
        let keep = Keep {
            _object: obj.clone().unbind(),
            _export: None,
        };
        return out.push(k, desc, Some(Arc::new(keep)), None);
    }
    if let Ok(cai) = obj.getattr(pyo3::intern!(py, "__cuda_array_interface__")) {
        let (addr, len, readonly) = array_interface(&cai)?;
        check_writable(readonly, purpose)?;
        check_kind(kind, MemKind::Vram)?;
        let dev = obj
            .getattr("device")
            .and_then(|d| d.getattr("id"))
            .and_then(|id| id.extract::<u64>())
            .unwrap_or(0);
        let keep = Keep {
            _object: obj.clone().unbind(),
            _export: None,
        };
        return out.push(
            MemKind::Vram,
            Desc::new(addr, len, dev),
            Some(Arc::new(keep)),
            None,
        );
    }
    if let Ok(ai) = obj.getattr(pyo3::intern!(py, "__array_interface__")) {
        let (addr, mut len, readonly) = array_interface(&ai)?;
        // NumPy's own size where it exists: a typestr's number is not always the item
        // size (`<U3` is 3 characters of 4 bytes).
        if let Some(n) = obj
            .getattr(pyo3::intern!(py, "nbytes"))
            .ok()
            .and_then(|n| n.extract::<u64>().ok())
        {
            len = n;
        }
        check_writable(readonly, purpose)?;
        check_kind(kind, MemKind::Dram)?;
        let keep = Keep {
            _object: obj.clone().unbind(),
            _export: None,
        };
        return out.push(
            MemKind::Dram,
            Desc::new(addr, len, 0),
            Some(Arc::new(keep)),
            None,
        );
    }
    if !obj.is_instance_of::<PyString>()
        && (obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>())
    {
        if depth >= DEPTH_MAX {
            return Err(invalid("descriptor lists nest at most two levels deep"));
        }
        for item in obj.try_iter()? {
            describe_into(&item?, kind, purpose, out, depth + 1)?;
        }
        return Ok(());
    }
    if let Some(export) = export(obj, purpose)? {
        check_kind(kind, MemKind::Dram)?;
        let desc = Desc::new(export.0.buf as u64, export.0.len as u64, 0);
        let keep = Keep {
            _object: obj.clone().unbind(),
            _export: Some(export),
        };
        return out.push(MemKind::Dram, desc, Some(Arc::new(keep)), None);
    }
    Err(invalid(format!(
        "cannot describe memory of a {}: pass a NumPy array, a torch tensor, an object with \
         the buffer protocol or __array_interface__/__cuda_array_interface__, an \
         (addr, len, dev) tuple, an (N, 3) integer array, or a list of these",
        obj.get_type().name()?
    )))
}

fn check_kind(asked: Option<MemKind>, actual: MemKind) -> PyResult<()> {
    match asked {
        Some(k) if k != actual => Err(crate::errors::to_py(&ferry::Error::Mismatch {
            subject: ferry::Subject::Named("mem_type".into()),
            reason: format!(
                "{} was asked for, but the object is {} memory",
                k.name(),
                actual.name()
            )
            .into(),
        })),
        _ => Ok(()),
    }
}

fn check_writable(readonly: bool, purpose: Purpose) -> PyResult<()> {
    if readonly && purpose == Purpose::Register {
        return Err(invalid(
            "read-only memory cannot be registered (peers and backends may write it): pass a writable array",
        ));
    }
    Ok(())
}

fn push_tuple(t: &Bound<'_, PyTuple>, kind: Option<MemKind>, out: &mut Described) -> PyResult<()> {
    if t.len() > 4 {
        return Err(invalid(format!(
            "a descriptor tuple is (addr, len, dev) or (addr, len, dev, path), not {} items",
            t.len()
        )));
    }
    let num = |i: usize, what: &str| -> PyResult<u64> {
        t.get_item(i)?
            .extract::<u64>()
            .map_err(|_| invalid(format!("descriptor {what} must be an integer in 0..2**64")))
    };
    let desc = Desc::new(num(0, "addr")?, num(1, "len")?, num(2, "dev")?);
    let path = if t.len() == 4 {
        let p = t.get_item(3)?;
        if p.is_none() {
            None
        } else {
            let s = p
                .extract::<String>()
                .map_err(|_| invalid("the fourth item of a descriptor tuple is a path (str)"))?;
            (!s.is_empty()).then_some(s)
        }
    } else {
        None
    };
    let k = kind.unwrap_or(if path.is_some() {
        MemKind::File
    } else {
        MemKind::Dram
    });
    if path.is_some() && k != MemKind::File {
        return Err(invalid("a path names a file: use mem_type=\"FILE\""));
    }
    out.push(k, desc, None, path)
}

/// `(addr, len, readonly)` from an `__array_interface__` / `__cuda_array_interface__`
/// dict; refuses non-contiguous layouts.
fn array_interface(dict: &Bound<'_, PyAny>) -> PyResult<(u64, u64, bool)> {
    let dict = dict
        .cast::<PyDict>()
        .map_err(|_| invalid("__array_interface__ is not a dict"))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        dict.get_item(k)?
            .ok_or_else(|| invalid(format!("__array_interface__ has no {k:?}")))
    };
    let data = get("data")?;
    let (addr, readonly): (u64, bool) = data
        .extract()
        .map_err(|_| invalid("__array_interface__['data'] must be (address, read_only)"))?;
    let shape: Vec<u64> = get("shape")?
        .extract()
        .map_err(|_| invalid("__array_interface__['shape'] must be a tuple of ints"))?;
    let typestr: String = get("typestr")?.extract()?;
    let itemsize: u64 = typestr
        .get(2..)
        .and_then(|s| s.parse().ok())
        .filter(|&n| n > 0)
        .ok_or_else(|| invalid(format!("unsupported array typestr {typestr:?}")))?;
    let mut elems: u64 = 1;
    for &n in &shape {
        elems = elems
            .checked_mul(n)
            .ok_or_else(|| invalid("array size overflows"))?;
    }
    let len = elems
        .checked_mul(itemsize)
        .ok_or_else(|| invalid("array size overflows"))?;
    if let Some(strides) = dict.get_item("strides")? {
        if !strides.is_none() {
            let strides: Vec<i64> = strides.extract()?;
            let mut expect = itemsize as i64;
            for (i, &n) in shape.iter().enumerate().rev() {
                if n > 1 && strides[i] != expect {
                    return Err(invalid(
                        "the array is not C-contiguous: pass numpy.ascontiguousarray(a) (or a contiguous tensor)",
                    ));
                }
                expect = expect.saturating_mul(n as i64);
            }
        }
    }
    Ok((addr, len, readonly))
}

/// A torch tensor's `(kind, desc)`, if `obj` is one.
fn torch_tensor(obj: &Bound<'_, PyAny>) -> PyResult<Option<(MemKind, Desc)>> {
    let ty = obj.get_type();
    let module: String = match ty.getattr("__module__").and_then(|m| m.extract()) {
        Ok(m) => m,
        Err(_) => return Ok(None),
    };
    if !module.starts_with("torch") || !obj.hasattr("data_ptr")? {
        return Ok(None);
    }
    if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(invalid(
            "the tensor is not contiguous: pass tensor.contiguous()",
        ));
    }
    let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
    let numel: u64 = obj.call_method0("numel")?.extract()?;
    let size: u64 = obj.call_method0("element_size")?.extract()?;
    let device = obj.getattr("device")?;
    let dtype: String = device.getattr("type")?.extract()?;
    let (kind, dev) = match dtype.as_str() {
        "cpu" => (MemKind::Dram, 0),
        "cuda" => (
            MemKind::Vram,
            device
                .getattr("index")?
                .extract::<Option<u64>>()?
                .unwrap_or(0),
        ),
        other => {
            return Err(invalid(format!(
                "tensors on device type {other:?} are not supported (cpu or cuda)"
            )))
        }
    };
    Ok(Some((kind, Desc::new(addr, numel * size, dev))))
}

/// Rows of a 2-D integer NumPy array of shape `(N, 3)`, flattened, if `obj` is one.
fn raw_rows(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u64>>> {
    let Ok(array) = obj.cast::<numpy::PyUntypedArray>() else {
        return Ok(None);
    };
    use numpy::PyUntypedArrayMethods;
    let shape = array.shape();
    let integer = array.dtype().is_instance_of_int();
    if shape.len() != 2 || shape[1] != 3 || !integer {
        return Ok(None);
    }
    let np = obj.py().import("numpy")?;
    let flat = np.call_method1("ascontiguousarray", (obj, np.getattr("uint64")?))?;
    let flat = flat
        .cast::<numpy::PyArray2<u64>>()
        .map_err(|_| invalid("cannot read the (N, 3) descriptor array as uint64"))?;
    use numpy::PyArrayMethods;
    let ro = flat.readonly();
    Ok(Some(
        ro.as_slice()
            .map_err(|_| invalid("descriptor array is not contiguous"))?
            .to_vec(),
    ))
}

trait DtypeExt {
    fn is_instance_of_int(&self) -> bool;
}

impl DtypeExt for Bound<'_, numpy::PyArrayDescr> {
    fn is_instance_of_int(&self) -> bool {
        use numpy::PyArrayDescrMethods;
        matches!(self.kind(), b'i' | b'u')
    }
}

/// Export `obj` through the buffer protocol (contiguous; writable for registration).
fn export(obj: &Bound<'_, PyAny>, purpose: Purpose) -> PyResult<Option<Exported>> {
    // SAFETY: `PyObject_CheckBuffer` only reads the type slots of a live object (the
    // GIL is held: we have a `Bound`).
    if unsafe { buffer::PyObject_CheckBuffer(obj.as_ptr()) } == 0 {
        return Ok(None);
    }
    let mut flags = buffer::PYBUF_ANY_CONTIGUOUS;
    if purpose == Purpose::Register {
        flags |= buffer::PYBUF_WRITABLE;
    }
    let mut view: Box<PyBuffer> = Box::new(PyBuffer::empty());
    // SAFETY: `view` is a valid, writable Py_buffer; on success the exporter filled it
    // and `Exported` releases it exactly once.
    let rc = unsafe { buffer::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
    if rc != 0 {
        let cause = PyErr::fetch(obj.py());
        return Err(invalid(format!(
            "the object's buffer cannot be used{}: {cause}",
            if purpose == Purpose::Register {
                " (registration needs a writable, contiguous buffer)"
            } else {
                " (a contiguous buffer is needed)"
            }
        )));
    }
    Ok(Some(Exported(view)))
}
