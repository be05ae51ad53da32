//! `ferry.Batch`: the command buffer, from Python. Record many makes, posts, checks
//! and releases, flush once with `Agent.flush` (without the GIL), read every command's
//! result as NumPy arrays.

use ferry::{CommandBuffer, Created, Outcome, XferStatus};
use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use slotmap::{Key, KeyData};

use crate::dlist::{indices, prep_id, xfer_id};
use crate::errors::invalid;

/// Status code of a command that completed, made something, or reported `DONE`.
pub(crate) const OK: i8 = 0;
/// Status code: the request is in progress.
pub(crate) const IN_PROGRESS: i8 = 1;
/// Status code: the request was made but never posted.
pub(crate) const NOT_POSTED: i8 = 2;
/// Status code: the command has not been flushed.
pub(crate) const PENDING: i8 = 3;
/// Status code: the command failed (see `Batch.errors()`).
pub(crate) const FAILED: i8 = -1;

/// A command buffer. Recording does no I/O; `Agent.flush(batch)` runs it. Command
/// results are read by command index, which every recording method returns.
#[pyclass(module = "ferry", name = "Batch")]
pub(crate) struct Batch {
    pub(crate) cmds: CommandBuffer,
    local: Vec<u32>,
    remote: Vec<u32>,
}

impl Batch {
    pub(crate) fn with_capacity(capacity: usize) -> Batch {
        Batch {
            cmds: CommandBuffer::with_capacity(capacity),
            local: Vec::new(),
            remote: Vec::new(),
        }
    }

    fn handles_from(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        if let Ok(a) = obj.cast::<PyArray1<u64>>() {
            let ro = a.readonly();
            return ro
                .as_slice()
                .map(|s| s.to_vec())
                .map_err(|_| invalid("handle array is not contiguous"));
        }
        let mut out = Vec::new();
        for item in obj.try_iter()? {
            out.push(xfer_id(&item?)?.data().as_ffi());
        }
        Ok(out)
    }

    fn xfer_at(ffi: u64) -> ferry::XferId {
        ferry::XferId::from(KeyData::from_ffi(ffi))
    }
}

#[pymethods]
impl Batch {
    #[new]
    #[pyo3(signature = (capacity=4096))]
    fn new(capacity: usize) -> Batch {
        Batch::with_capacity(capacity)
    }

    /// Forget every command and result (keeps the allocations).
    fn clear(&mut self) {
        self.cmds.clear();
    }

    /// Number of recorded commands.
    fn __len__(&self) -> usize {
        self.cmds.len()
    }

    /// Record a request built from two prepared lists (as `make_prepped_xfer`); with
    /// `post=True` also record its post. Returns the make's command index (its handle
    /// is `handles()[index]` after the flush).
    #[pyo3(signature = (operation, local, local_indices, remote, remote_indices, notif_msg=None, post=false))]
    #[allow(clippy::too_many_arguments)]
    fn make(
        &mut self,
        operation: &str,
        local: &Bound<'_, PyAny>,
        local_indices: &Bound<'_, PyAny>,
        remote: &Bound<'_, PyAny>,
        remote_indices: &Bound<'_, PyAny>,
        notif_msg: Option<&[u8]>,
        post: bool,
    ) -> PyResult<u32> {
        let op = op(operation)?;
        let (l, r) = (prep_id(local)?, prep_id(remote)?);
        indices(local_indices, &mut self.local)?;
        indices(remote_indices, &mut self.remote)?;
        let b = self.cmds.make(op, l, &self.local, r, &self.remote);
        let b = match notif_msg {
            Some(n) if !n.is_empty() => b.notify(n),
            _ => b,
        };
        let t = b.ticket();
        if post {
            self.cmds.post(t);
        }
        Ok(t.index())
    }

    /// Record `n` requests at once: row `i` of the `(n, k)` index arrays names the
    /// descriptors of request `i`; with `post=True` (default) each is posted in the
    /// same flush. Returns the make commands' indices as a NumPy array.
    #[pyo3(signature = (operation, local, local_indices, remote, remote_indices, post=true))]
    #[allow(clippy::too_many_arguments)]
    fn make_many<'py>(
        &mut self,
        py: Python<'py>,
        operation: &str,
        local: &Bound<'py, PyAny>,
        local_indices: &Bound<'py, PyAny>,
        remote: &Bound<'py, PyAny>,
        remote_indices: &Bound<'py, PyAny>,
        post: bool,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let op = op(operation)?;
        let (l, r) = (prep_id(local)?, prep_id(remote)?);
        let (lrows, lk) = rows(local_indices)?;
        let (rrows, rk) = rows(remote_indices)?;
        if lrows.len() / lk.max(1) != rrows.len() / rk.max(1) {
            return Err(invalid(
                "local_indices and remote_indices must have the same number of rows",
            ));
        }
        let n = lrows.len() / lk.max(1);
        let mut made = Vec::with_capacity(n);
        for i in 0..n {
            let t = self
                .cmds
                .make(
                    op,
                    l,
                    &lrows[i * lk..(i + 1) * lk],
                    r,
                    &rrows[i * rk..(i + 1) * rk],
                )
                .ticket();
            if post {
                self.cmds.post(t);
            }
            made.push(t.index());
        }
        Ok(PyArray1::from_vec(py, made))
    }

    /// Record a post of a request handle, or of the request made by command `index`
    /// of this batch (`post(index=i)`). Returns the command index.
    #[pyo3(signature = (handle=None, *, index=None))]
    fn post(&mut self, handle: Option<&Bound<'_, PyAny>>, index: Option<u32>) -> PyResult<u32> {
        match (handle, index) {
            (Some(h), None) => Ok(self.cmds.post(xfer_id(h)?).index()),
            (None, Some(i)) => {
                if i as usize >= self.cmds.len() {
                    return Err(invalid(format!(
                        "command index {i} is past the batch's {} commands",
                        self.cmds.len()
                    )));
                }
                Ok(self
                    .cmds
                    .post(ferry::Ticket::<ferry::XferId>::at(i))
                    .index())
            }
            _ => Err(invalid("post takes a handle or index=")),
        }
    }

    /// Record a post of every handle in a `uint64` NumPy array (or a sequence of
    /// handles). Returns the first command index; they are consecutive.
    fn post_many(&mut self, handles: &Bound<'_, PyAny>) -> PyResult<u32> {
        let first = self.cmds.len() as u32;
        for h in Self::handles_from(handles)? {
            self.cmds.post(Self::xfer_at(h));
        }
        Ok(first)
    }

    /// Record a check of a request (drives the backends in the flush).
    fn check(&mut self, handle: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.cmds.check(xfer_id(handle)?).index())
    }

    /// Record a check of every handle; returns the first command index.
    fn check_many(&mut self, handles: &Bound<'_, PyAny>) -> PyResult<u32> {
        let first = self.cmds.len() as u32;
        for h in Self::handles_from(handles)? {
            self.cmds.check(Self::xfer_at(h));
        }
        Ok(first)
    }

    /// Record a release of a request.
    fn release(&mut self, handle: &Bound<'_, PyAny>) -> PyResult<u32> {
        Ok(self.cmds.release(xfer_id(handle)?).index())
    }

    /// Record a release of every handle; returns the first command index.
    fn release_many(&mut self, handles: &Bound<'_, PyAny>) -> PyResult<u32> {
        let first = self.cmds.len() as u32;
        for h in Self::handles_from(handles)? {
            self.cmds.release(Self::xfer_at(h));
        }
        Ok(first)
    }

    /// Record a drain of inbound notifications (read them with `notifications()`).
    fn drain_notifications(&mut self) -> u32 {
        self.cmds.drain_notifications().index()
    }

    /// One status code per command (`int8`): `ferry.OK` (0), `ferry.IN_PROGRESS` (1),
    /// `ferry.NOT_POSTED` (2), `ferry.PENDING` (3, not flushed), `ferry.FAILED` (-1).
    fn statuses<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i8>> {
        let out = PyArray1::<i8>::zeros(py, self.cmds.len(), false);
        {
            let mut rw = out.readwrite();
            let s = rw.as_slice_mut().expect("a fresh array is contiguous");
            for (slot, o) in s.iter_mut().zip(self.cmds.outcomes()) {
                *slot = match o {
                    Outcome::Pending => PENDING,
                    Outcome::Failed(_) => FAILED,
                    Outcome::Status(XferStatus::InProgress) => IN_PROGRESS,
                    Outcome::Status(XferStatus::NotPosted) => NOT_POSTED,
                    _ => OK,
                };
            }
        }
        out
    }

    /// One `uint64` per command: the handle a make created (0 for other commands and
    /// failures). Pass them (or slices) to `post_many`, `check_many`, `release_many`.
    fn handles<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u64>> {
        let out = PyArray1::<u64>::zeros(py, self.cmds.len(), false);
        {
            let mut rw = out.readwrite();
            let s = rw.as_slice_mut().expect("a fresh array is contiguous");
            for (slot, o) in s.iter_mut().zip(self.cmds.outcomes()) {
                *slot = match o {
                    Outcome::Created(Created::Xfer(x)) => x.data().as_ffi(),
                    Outcome::Created(Created::Prep(p)) => p.data().as_ffi(),
                    _ => 0,
                };
            }
        }
        out
    }

    /// The failed commands: `[(index, exception), …]`.
    fn errors<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (i, e) in self.cmds.errors() {
            list.append((i, crate::errors::to_py(e).into_value(py)))?;
        }
        Ok(list)
    }

    /// Raise the first failed command's error, if any.
    fn raise_first(&self) -> PyResult<()> {
        match self.cmds.errors().next() {
            Some((_, e)) => Err(crate::errors::to_py(e)),
            None => Ok(()),
        }
    }

    /// Notifications drained by the last flush: `[(agent_name, payload), …]`.
    fn notifications<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for (from, payload) in self.cmds.notifications() {
            list.append((from, PyBytes::new(py, payload)))?;
        }
        Ok(list)
    }

    fn __repr__(&self) -> String {
        format!(
            "ferry.Batch({} commands{})",
            self.cmds.len(),
            if self.cmds.is_flushed() {
                ", flushed"
            } else {
                ""
            }
        )
    }
}

fn op(name: &str) -> PyResult<ferry::Op> {
    match name.to_ascii_uppercase().as_str() {
        "READ" => Ok(ferry::Op::Read),
        "WRITE" => Ok(ferry::Op::Write),
        _ => Err(invalid(format!(
            "operation must be \"READ\" or \"WRITE\", not {name:?}"
        ))),
    }
}

/// A 2-D index array (or list of equal-length lists) flattened, with its row length.
fn rows(obj: &Bound<'_, PyAny>) -> PyResult<(Vec<u32>, usize)> {
    if let Ok(a) = obj.cast::<numpy::PyUntypedArray>() {
        if a.ndim() != 2 {
            return Err(invalid(
                "make_many index arrays must be 2-D (one row per request)",
            ));
        }
        let k = a.shape()[1];
        let np = obj.py().import("numpy")?;
        let c = np.call_method1("ascontiguousarray", (obj, np.getattr("uint32")?))?;
        let c = c
            .cast::<numpy::PyArray2<u32>>()
            .map_err(|_| invalid("index array must be integers"))?;
        let ro = c.readonly();
        let flat = ro
            .as_slice()
            .map_err(|_| invalid("index array is not contiguous"))?
            .to_vec();
        return Ok((flat, k));
    }
    let mut flat = Vec::new();
    let mut k = None;
    let mut row = Vec::new();
    for item in obj.try_iter()? {
        indices(&item?, &mut row)?;
        match k {
            None => k = Some(row.len()),
            Some(k) if k != row.len() => {
                return Err(invalid("every index row must have the same length"))
            }
            _ => {}
        }
        flat.extend_from_slice(&row);
    }
    Ok((flat, k.unwrap_or(0)))
}
