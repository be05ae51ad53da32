//! The two ways operations reach cuFile: a bounded pool of worker threads calling
//! `cuFileRead` / `cuFileWrite`, and cuFile's batch API polled without blocking.

use std::collections::VecDeque;
use std::ffi::c_void;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use crate::cufile::{
    self, Api, BatchApi, CUfileBatchHandle, CUfileError, CUfileIOEvents, CUfileIOParams,
};
use crate::DeviceCtx;

/// One operation: a piece of a range, as cuFile takes it.
#[derive(Clone, Debug)]
pub(crate) struct IoJob {
    /// `CUfileHandle_t` as an integer (so the job is `Send`).
    pub handle: usize,
    /// Buffer base as registered (or the address itself when not registered).
    pub buf_base: u64,
    /// Offset from `buf_base`.
    pub buf_offset: i64,
    /// File offset.
    pub file_offset: i64,
    /// Bytes.
    pub len: u64,
    /// Memory → file.
    pub write: bool,
    /// The device to make current for VRAM.
    pub ctx: Option<DeviceCtx>,
}

/// How an operation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum IoOutcome {
    /// Bytes moved (fewer than asked: the rest is queued again).
    Done(u64),
    /// The file ended before the range did.
    Short,
    /// An OS error.
    Errno(i32),
    /// A cuFile error code.
    CuFile(u32),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Workers hold the lock only to move plain data; a poisoned queue is still sound.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct Jobs {
    queue: VecDeque<(u64, IoJob)>,
    shutdown: bool,
}

struct Shared {
    api: Api,
    jobs: Mutex<Jobs>,
    work: Condvar,
    done: ArrayQueue<(u64, IoOutcome)>,
}

/// Worker threads calling `cuFileRead` / `cuFileWrite`.
pub(crate) struct ThreadEngine {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Jobs pushed since the last wake (handed over under one lock).
    staged: Vec<(u64, IoJob)>,
}

impl ThreadEngine {
    /// `threads` workers; at most `depth` operations (the operation slab's size) exist,
    /// so neither queue can fill.
    pub(crate) fn new(api: Api, threads: usize, depth: usize) -> io::Result<ThreadEngine> {
        let shared = Arc::new(Shared {
            api,
            jobs: Mutex::new(Jobs {
                queue: VecDeque::with_capacity(depth),
                shutdown: false,
            }),
            work: Condvar::new(),
            done: ArrayQueue::new(depth.max(1)),
        });
        let mut engine = ThreadEngine {
            shared,
            workers: Vec::with_capacity(threads),
            staged: Vec::with_capacity(depth),
        };
        for i in 0..threads {
            let shared = Arc::clone(&engine.shared);
            let handle = std::thread::Builder::new()
                .name(format!("ferry-gds-{i}"))
                .spawn(move || worker(&shared));
            match handle {
                Ok(h) => engine.workers.push(h),
                Err(e) => {
                    engine.shutdown();
                    return Err(e);
                }
            }
        }
        Ok(engine)
    }

    pub(crate) fn push(&mut self, token: u64, job: IoJob) {
        self.staged.push((token, job));
    }

    /// Hand the staged jobs to the workers.
    pub(crate) fn wake(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let n = self.staged.len();
        lock(&self.shared.jobs).queue.extend(self.staged.drain(..));
        if n == 1 {
            self.shared.work.notify_one();
        } else {
            self.shared.work.notify_all();
        }
    }

    pub(crate) fn reap(&mut self, out: &mut Vec<(u64, IoOutcome)>) {
        while let Some(done) = self.shared.done.pop() {
            out.push(done);
        }
    }

    /// Stop the workers once their current operation returned; queued ones are dropped.
    pub(crate) fn shutdown(&mut self) {
        {
            let mut jobs = lock(&self.shared.jobs);
            jobs.shutdown = true;
            jobs.queue.clear();
        }
        self.shared.work.notify_all();
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn worker(shared: &Shared) {
    loop {
        let (token, job) = {
            let mut jobs = lock(&shared.jobs);
            loop {
                if jobs.shutdown {
                    return;
                }
                if let Some(job) = jobs.queue.pop_front() {
                    break job;
                }
                jobs = shared.work.wait(jobs).unwrap_or_else(|p| p.into_inner());
            }
        };
        let outcome = run(&shared.api, &job);
        // Cannot be full: at most `depth` operations exist.
        let _ = shared.done.push((token, outcome));
    }
}

/// Do one job to its end: short transfers continue where they stopped.
fn run(api: &Api, job: &IoJob) -> IoOutcome {
    if let Some(ctx) = &job.ctx {
        if let Err(e) = ctx.bind() {
            log::warn!("GDS: cannot make the device current: {e}");
            return IoOutcome::CuFile(cufile::CU_FILE_CUDA_DRIVER_ERROR);
        }
    }
    let mut moved = 0u64;
    while moved < job.len {
        let len = (job.len - moved) as usize;
        let file_offset = job.file_offset + moved as i64;
        let buf_offset = job.buf_offset + moved as i64;
        let handle = job.handle as *mut c_void;
        let base = job.buf_base as *mut c_void;
        // SAFETY: the handle is registered and the buffer range lies in a registered
        // region that stays registered until this operation is reported (the backend
        // counts it in use; Backend::post's contract keeps the memory valid).
        let ret = unsafe {
            if job.write {
                (api.write)(handle, base, len, file_offset, buf_offset)
            } else {
                (api.read)(handle, base, len, file_offset, buf_offset)
            }
        };
        match ret {
            n if n > 0 => moved += n as u64,
            0 if job.write => return IoOutcome::Errno(libc::EIO),
            0 => return IoOutcome::Short,
            -1 => {
                let errno = io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO);
                if errno == libc::EINTR {
                    continue;
                }
                return IoOutcome::Errno(errno);
            }
            n => return IoOutcome::CuFile(n.unsigned_abs() as u32),
        }
    }
    IoOutcome::Done(moved)
}

struct BatchSlot {
    handle: CUfileBatchHandle,
    params: Vec<CUfileIOParams>,
    /// The operation token of each entry of `params`.
    tokens: Vec<u64>,
    /// Whether each entry has been reported.
    reported: Vec<bool>,
    events: Vec<CUfileIOEvents>,
    outstanding: usize,
    in_flight: bool,
}

/// cuFile's batch API: a fixed set of batch handles, polled with a zero timeout.
pub(crate) struct BatchEngine {
    api: BatchApi,
    entries: usize,
    slots: Vec<BatchSlot>,
    /// A status poll that failed because cuFile cannot run batches here (its entries
    /// failed; the backend moves later operations with threads).
    unsupported: Option<CUfileError>,
}

// SAFETY: the batch handles are used only through `&mut self`; cuFile allows batch
// calls from any thread.
unsafe impl Send for BatchEngine {}

fn cookie(slot: usize, position: usize) -> *mut c_void {
    (((slot as u64) << 32 | position as u64) + 1) as *mut c_void
}

fn uncookie(cookie: *mut c_void) -> Option<(usize, usize)> {
    let raw = (cookie as u64).checked_sub(1)?;
    Some(((raw >> 32) as usize, (raw & u64::from(u32::MAX)) as usize))
}

impl BatchEngine {
    /// Set up `batches` handles of `entries` each.
    pub(crate) fn new(
        api: BatchApi,
        batches: usize,
        entries: usize,
    ) -> Result<BatchEngine, CUfileError> {
        let mut engine = BatchEngine {
            api,
            entries,
            slots: Vec::with_capacity(batches),
            unsupported: None,
        };
        for _ in 0..batches {
            let mut handle: CUfileBatchHandle = std::ptr::null_mut();
            // SAFETY: the out-pointer is valid; `entries` is within the driver's limit
            // (checked by the backend against max_batch_io_size).
            let status = unsafe { (api.set_up)(&mut handle, entries as u32) };
            if status.err != cufile::CU_FILE_SUCCESS {
                engine.shutdown();
                return Err(status);
            }
            engine.slots.push(BatchSlot {
                handle,
                params: Vec::with_capacity(entries),
                tokens: Vec::with_capacity(entries),
                reported: Vec::with_capacity(entries),
                // SAFETY: plain C data; all-zero is a valid (empty) event.
                events: vec![unsafe { std::mem::zeroed() }; entries],
                outstanding: 0,
                in_flight: false,
            });
        }
        Ok(engine)
    }

    pub(crate) fn entries(&self) -> usize {
        self.entries
    }

    pub(crate) fn idle_slot(&self) -> Option<usize> {
        self.slots.iter().position(|s| !s.in_flight)
    }

    /// Add one operation to the batch being built in `slot`.
    pub(crate) fn add(&mut self, slot: usize, token: u64, job: &IoJob) {
        if let Some(ctx) = &job.ctx {
            // The submitting thread needs the device current; a failure shows in the
            // submit's status.
            let _ = ctx.bind();
        }
        let s = &mut self.slots[slot];
        let position = s.params.len();
        s.params.push(CUfileIOParams {
            mode: cufile::CUFILE_BATCH,
            batch: cufile::CUfileBatchIo {
                dev_ptr_base: job.buf_base as *mut c_void,
                file_offset: job.file_offset,
                dev_ptr_offset: job.buf_offset,
                size: job.len as usize,
            },
            fh: job.handle as *mut c_void,
            opcode: if job.write {
                cufile::CUFILE_WRITE
            } else {
                cufile::CUFILE_READ
            },
            cookie: cookie(slot, position),
        });
        s.tokens.push(token);
        s.reported.push(false);
    }

    /// Submit what `slot` holds. On refusal every entry goes to `refused`, except
    /// where cuFile says it cannot run batches here ([`cufile::batch_unsupported`]):
    /// then nothing moved, the entries go back to the front of `requeue` in order and
    /// the refusal is returned.
    pub(crate) fn launch(
        &mut self,
        slot: usize,
        refused: &mut Vec<(u64, IoOutcome)>,
        requeue: &mut VecDeque<u64>,
    ) -> Option<CUfileError> {
        let s = &mut self.slots[slot];
        let n = s.params.len();
        if n == 0 {
            return None;
        }
        // SAFETY: `params` holds `n` initialized entries naming registered handles and
        // buffers that stay registered until each entry is reported; the array itself
        // is left untouched until the whole batch has been reported.
        let status = unsafe { (self.api.submit)(s.handle, n as u32, s.params.as_mut_ptr(), 0) };
        if status.err != cufile::CU_FILE_SUCCESS {
            let unsupported = cufile::batch_unsupported(status.err);
            log::warn!(
                "GDS: cuFileBatchIOSubmit refused {n} operation(s): {}{}",
                cufile::describe(status),
                if unsupported {
                    "; they go to the thread engine"
                } else {
                    ""
                }
            );
            if unsupported {
                for &token in s.tokens.iter().rev() {
                    requeue.push_front(token);
                }
            } else {
                for &token in &s.tokens {
                    refused.push((token, IoOutcome::CuFile(status.err)));
                }
            }
            s.params.clear();
            s.tokens.clear();
            s.reported.clear();
            return unsupported.then_some(status);
        }
        s.outstanding = n;
        s.in_flight = true;
        None
    }

    /// A status failure that said cuFile cannot run batches here, once.
    pub(crate) fn take_unsupported(&mut self) -> Option<CUfileError> {
        self.unsupported.take()
    }

    /// Whether any batch is in flight.
    pub(crate) fn busy(&self) -> bool {
        self.slots.iter().any(|s| s.in_flight)
    }

    /// Collect finished entries without waiting.
    pub(crate) fn poll(&mut self, out: &mut Vec<(u64, IoOutcome)>) {
        for index in 0..self.slots.len() {
            if self.slots[index].in_flight {
                self.poll_slot(index, Duration::ZERO, out);
            }
        }
    }

    fn poll_slot(&mut self, index: usize, wait: Duration, out: &mut Vec<(u64, IoOutcome)>) {
        let api = self.api;
        let s = &mut self.slots[index];
        let mut nr = s.outstanding as u32;
        let mut timeout = libc::timespec {
            tv_sec: wait.as_secs() as libc::time_t,
            tv_nsec: wait.subsec_nanos() as libc::c_long,
        };
        // SAFETY: `events` has room for `outstanding` ≥ nr entries; the handle is ours
        // and in flight; a zero timeout makes this a poll.
        let status =
            unsafe { (api.get_status)(s.handle, 0, &mut nr, s.events.as_mut_ptr(), &mut timeout) };
        if status.err != cufile::CU_FILE_SUCCESS {
            // The batch's state is unknown: cancel it, so cuFile lets go of its buffers,
            // and fail every entry not reported yet (each still gets its one outcome).
            log::warn!(
                "GDS: cuFileBatchIOGetStatus failed: {}; canceling the batch",
                cufile::describe(status)
            );
            // SAFETY: our handle, in flight.
            unsafe { (api.cancel)(s.handle) };
            for (position, reported) in s.reported.iter_mut().enumerate() {
                if !*reported {
                    *reported = true;
                    out.push((s.tokens[position], IoOutcome::CuFile(status.err)));
                }
            }
            s.outstanding = 0;
            s.in_flight = false;
            s.params.clear();
            s.tokens.clear();
            s.reported.clear();
            if cufile::batch_unsupported(status.err) {
                self.unsupported = Some(status);
            }
            return;
        }
        for event in &s.events[..(nr as usize).min(s.events.len())] {
            let Some((slot, position)) = uncookie(event.cookie) else {
                continue;
            };
            if slot != index || position >= s.tokens.len() || s.reported[position] {
                continue;
            }
            let outcome = match event.status {
                cufile::CUFILE_COMPLETE => IoOutcome::Done(event.ret as u64),
                cufile::CUFILE_WAITING | cufile::CUFILE_PENDING => continue,
                cufile::CUFILE_CANCELED => IoOutcome::Errno(libc::ECANCELED),
                cufile::CUFILE_TIMEOUT => IoOutcome::Errno(libc::ETIMEDOUT),
                _ => {
                    let ret = event.ret as isize;
                    if ret < 0 && ret > -4096 {
                        IoOutcome::Errno(-ret as i32)
                    } else {
                        IoOutcome::Errno(libc::EIO)
                    }
                }
            };
            s.reported[position] = true;
            s.outstanding -= 1;
            out.push((s.tokens[position], outcome));
        }
        if s.outstanding == 0 {
            s.in_flight = false;
            s.params.clear();
            s.tokens.clear();
            s.reported.clear();
        }
    }

    /// Wait (bounded) for every batch in flight, then destroy the handles.
    pub(crate) fn shutdown(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut sink = Vec::new();
        for index in 0..self.slots.len() {
            while self.slots[index].in_flight && Instant::now() < deadline {
                self.poll_slot(index, Duration::from_millis(10), &mut sink);
                sink.clear();
            }
            if self.slots[index].in_flight {
                log::error!("GDS: a batch did not finish within 30 s; canceling it");
                // SAFETY: our handle, in flight.
                unsafe { (self.api.cancel)(self.slots[index].handle) };
            }
        }
        for slot in self.slots.drain(..) {
            // SAFETY: our handle; nothing of it is in flight any more (or canceled).
            unsafe { (self.api.destroy)(slot.handle) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_round_trip_and_are_never_null() {
        for (slot, position) in [(0, 0), (3, 127), (63, 1023)] {
            let c = cookie(slot, position);
            assert!(!c.is_null());
            assert_eq!(uncookie(c), Some((slot, position)));
        }
        assert_eq!(uncookie(std::ptr::null_mut()), None);
    }
}
