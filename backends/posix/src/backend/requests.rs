//! Posting requests, feeding the engine, completions and cancel.

use super::*;

impl PosixBackend {
    /// Start a batch (the body of `Backend::post`).
    ///
    /// # Safety
    ///
    /// As `Backend::post`: every range lies in registered memory and a registered file
    /// region that stay valid until the request's completion.
    pub(super) unsafe fn post_batch(
        &mut self,
        endpoint: Endpoint,
        batch: &[Post<'_>],
        done: &mut Completions,
    ) -> Result<()> {
        // Validate everything and check capacity before starting anything.
        let mut ops_needed: usize = 0;
        for post in batch {
            self.check_post(endpoint, post)?;
            ops_needed += post.ranges.iter().filter(|r| r.len > 0).count();
        }
        if batch.len() > self.requests.available() {
            return Err(Error::Capacity {
                what: "POSIX requests outstanding (parameter max_requests)",
                limit: self.requests.capacity(),
            });
        }
        if ops_needed > self.ops.slab.available() {
            return Err(Error::Capacity {
                what: "POSIX ranges outstanding (parameter max_ops)",
                limit: self.ops.slab.capacity(),
            });
        }

        for post in batch {
            let ops_left = post.ranges.iter().filter(|r| r.len > 0).count() as u32;
            if ops_left == 0 {
                done.success(post.tag);
                continue;
            }
            let Some(request) = self.requests.take() else {
                unreachable!("request capacity checked above");
            };
            *self.requests.get_mut(request) = Some(Request {
                tag: post.tag,
                ops_left,
                ops_in_flight: 0,
                failure: None,
            });
            for (i, range) in post.ranges.iter().enumerate() {
                if range.len == 0 {
                    continue;
                }
                let Some(slot) = self.ops.slab.take() else {
                    unreachable!("operation capacity checked above");
                };
                let file = self.files.slot(range.remote_token).unwrap_or(0);
                let (fixed_buf, plain) = if range.local_token & PLAIN_DRAM != 0 {
                    let plain = self.plain.slot(range.local_token & !PLAIN_DRAM);
                    (NO_FIXED_BUF, plain.unwrap_or(NO_PLAIN))
                } else {
                    let fixed = self.buffers.slot(range.local_token);
                    (fixed.map_or(NO_FIXED_BUF, |b| b as u16), NO_PLAIN)
                };
                // Per-region use counts (released with the operation) let deregistration
                // refuse a region in use without scanning the operation slab.
                self.files.acquire(file);
                if fixed_buf != NO_FIXED_BUF {
                    self.buffers.acquire(u32::from(fixed_buf));
                }
                if plain != NO_PLAIN {
                    self.plain.acquire(plain);
                }
                let generation = self.ops.slab.get(slot).generation;
                *self.ops.slab.get_mut(slot) = IoOp {
                    generation,
                    state: OpState::Pending,
                    request,
                    range_index: i as u32,
                    op: post.op,
                    file,
                    mem_addr: range.local_addr,
                    file_offset: range.remote_addr,
                    len_bytes: range.len,
                    done_bytes: 0,
                    fixed_buf,
                    plain,
                };
                self.pending.push_back(slot);
            }
        }
        // Submission failures past this point are reported per request by progress
        // (the operations stay queued), since requests are already accepted.
        if let Err(e) = self.feed(done) {
            self.fail_queued(errno_of(&e), done);
        }
        Ok(())
    }

    /// Cancel a request that has no operation in flight (the body of `Backend::cancel`).
    pub(super) fn cancel_request(&mut self, tag: u64) -> Result<bool> {
        let found = self
            .requests
            .iter()
            .find_map(|(slot, r)| r.filter(|r| r.tag == tag).map(|r| (slot, r)));
        let Some((request, req)) = found else {
            return Err(Error::not_found(Subject::Named(
                format!("POSIX request with tag {tag:#x}").into(),
            )));
        };
        if req.ops_in_flight > 0 {
            return Ok(false);
        }
        let mut kept = 0;
        for i in 0..self.pending.len() {
            let slot = self.pending[i];
            if self.ops.slab.get(slot).request == request {
                self.release_op(slot);
            } else {
                self.pending[kept] = slot;
                kept += 1;
            }
        }
        self.pending.truncate(kept);
        *self.requests.get_mut(request) = None;
        self.requests.give_back(request);
        Ok(true)
    }

    /// Progress, and if nothing completed, sleep until something does or `timeout`
    /// passes (instead of spinning). Returns how many completions were pushed.
    pub fn wait(&mut self, done: &mut Completions, timeout: Duration) -> Result<usize> {
        let before = done.len();
        self.drain_engine(done);
        self.fill(done);
        if done.len() > before || self.engine.in_flight() == 0 {
            if let Err(e) = self.engine.submit() {
                self.fail_queued(errno_of(&e), done);
            }
            return Ok(done.len() - before);
        }
        // Submit what `fill` queued and sleep for a completion in one syscall.
        match &mut self.engine {
            Engine::Uring(e) => e
                .wait(timeout)
                .map_err(|e| os_error(errno_of(&e), format!("io_uring wait failed: {e}")))?,
            Engine::Threads(e) => e.wait(timeout),
        }
        self.progress(done);
        Ok(done.len() - before)
    }

    pub(super) fn fail(&mut self, request: u32, failure: Failure) {
        if let Some(req) = self.requests.get_mut(request) {
            let keep = match (req.failure, failure.range) {
                (None, _) => false,
                (Some(old), Some(new)) => old.range.is_some_and(|o| o <= new),
                (Some(_), None) => true,
            };
            if !keep {
                req.failure = Some(failure);
            }
        }
    }

    /// Free op `slot` and its uses of a file and a fixed buffer.
    pub(super) fn release_op(&mut self, slot: u32) {
        let op = self.ops.slab.get(slot);
        let (file, fixed_buf, plain) = (op.file, op.fixed_buf, op.plain);
        self.files.release(file);
        if fixed_buf != NO_FIXED_BUF {
            self.buffers.release(u32::from(fixed_buf));
        }
        if plain != NO_PLAIN {
            self.plain.release(plain);
        }
        self.ops.release(slot);
    }

    /// Free op `slot`; complete its request if it was the last.
    pub(super) fn finish_op(&mut self, slot: u32, done: &mut Completions) {
        let request = self.ops.slab.get(slot).request;
        self.release_op(slot);
        let last = match self.requests.get_mut(request) {
            Some(req) => {
                req.ops_left -= 1;
                req.ops_left == 0
            }
            None => false,
        };
        if last {
            self.complete_request(request, done);
        }
    }

    pub(super) fn complete_request(&mut self, request: u32, done: &mut Completions) {
        if let Some(req) = self.requests.get_mut(request).take() {
            match req.failure {
                None => done.success(req.tag),
                Some(f) => done.failure(req.tag, f),
            }
            self.requests.give_back(request);
        }
    }

    /// Account one engine result for the op `user_data` names.
    pub(super) fn on_result(&mut self, user_data: u64, result: i32, done: &mut Completions) {
        let Some(slot) = self.ops.resolve(user_data) else {
            // Not ours or stale: nothing to free. Cannot happen while the bookkeeping
            // holds; never dereference it.
            debug_assert!(false, "unknown io user_data {user_data:#x}");
            return;
        };
        let op = *self.ops.slab.get(slot);
        if let Some(req) = self.requests.get_mut(op.request) {
            req.ops_in_flight -= 1;
        }
        let failure = |kind, errno| Failure {
            kind,
            errno,
            range: Some(op.range_index),
        };
        if result < 0 {
            self.fail(op.request, failure(FailureKind::Backend, -result));
            self.finish_op(slot, done);
            return;
        }
        if result == 0 && op.done_bytes < op.len_bytes {
            let f = match op.op {
                Op::Read => failure(FailureKind::ShortRead, 0),
                // A write that moves nothing and reports no error: call it an I/O error.
                Op::Write => failure(FailureKind::Backend, libc::EIO),
            };
            self.fail(op.request, f);
            self.finish_op(slot, done);
            return;
        }
        let moved = op.done_bytes + result as u64;
        if moved >= op.len_bytes {
            self.finish_op(slot, done);
            return;
        }
        // Short transfer or next chunk: queue the rest.
        let entry = self.ops.slab.get_mut(slot);
        entry.done_bytes = moved;
        entry.state = OpState::Pending;
        self.pending.push_back(slot);
    }

    /// Hand queued operations to the engine while it has room, then submit them all in
    /// one go (also retrying SQEs a transient refusal left queued).
    pub(super) fn feed(&mut self, done: &mut Completions) -> io::Result<()> {
        self.fill(done);
        self.engine.submit()
    }

    /// Hand queued operations to the engine while it has room, without submitting.
    pub(super) fn fill(&mut self, done: &mut Completions) {
        while self.engine.has_room() {
            let Some(slot) = self.pending.pop_front() else {
                break;
            };
            let op = *self.ops.slab.get(slot);
            let request_failed =
                !matches!(self.requests.get(op.request), Some(r) if r.failure.is_none());
            if request_failed {
                // Do not start more work for a request that already failed.
                self.finish_op(slot, done);
                continue;
            }
            let Some(file) = self.files.get(op.file) else {
                // The region vanished under a queued op (the executor should prevent
                // this); fail the range rather than touch a stale descriptor.
                self.fail(
                    op.request,
                    Failure {
                        kind: FailureKind::Backend,
                        errno: libc::EBADF,
                        range: Some(op.range_index),
                    },
                );
                self.finish_op(slot, done);
                continue;
            };
            let remaining = op.len_bytes - op.done_bytes;
            let cmd = IoCmd {
                write: op.op == Op::Write,
                fd: file.fd,
                fixed_file: file.fixed.then_some(op.file),
                buf: op.mem_addr + op.done_bytes,
                len: remaining.min(CHUNK_BYTES_MAX) as u32,
                offset: op.file_offset + op.done_bytes,
                fixed_buf: op.fixed_buf,
                user_data: self.ops.user_data(slot),
            };
            self.ops.slab.get_mut(slot).state = OpState::InFlight;
            if let Some(req) = self.requests.get_mut(op.request) {
                req.ops_in_flight += 1;
            }
            self.engine.push(&cmd);
        }
    }

    pub(super) fn drain_engine(&mut self, done: &mut Completions) {
        let mut reaped = std::mem::take(&mut self.reaped);
        loop {
            reaped.clear();
            let cap = reaped.capacity();
            let n = self.engine.reap(|ud, res| {
                if reaped.len() < cap {
                    reaped.push((ud, res));
                }
            });
            debug_assert_eq!(n, reaped.len(), "more completions than queue depth");
            for &(ud, res) in &reaped {
                self.on_result(ud, res, done);
            }
            if n < cap || n == 0 {
                break;
            }
        }
        self.reaped = reaped;
    }

    /// The engine refused a submission outright (not a transient refusal): fail every
    /// operation it holds queued so each request still completes exactly once.
    pub(super) fn fail_queued(&mut self, errno: i32, done: &mut Completions) {
        while let Some(slot) = self.pending.pop_front() {
            let op = *self.ops.slab.get(slot);
            self.fail(
                op.request,
                Failure {
                    kind: FailureKind::Backend,
                    errno,
                    range: Some(op.range_index),
                },
            );
            self.finish_op(slot, done);
        }
    }
}
