//! The io_uring engine: SQEs pushed per operation, one `io_uring_enter` per flush,
//! completions read from the shared CQ ring without a syscall.

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

use io_uring::{opcode, types, IoUring};

use crate::backend::IoCmd;
use crate::pool::NO_FIXED_BUF;

/// One io_uring plus its in-flight accounting.
pub(crate) struct UringEngine {
    ring: IoUring,
    /// Most operations in flight (≤ SQ entries ≤ CQ entries, so the CQ cannot overflow).
    depth: u32,
    /// Operations pushed and not yet reaped.
    in_flight: u32,
    /// SQEs pushed since the last successful submit.
    unsubmitted: u32,
    /// Whether the sparse fixed-buffer table was set up.
    pub fixed_buffers: bool,
    /// Whether the sparse fixed-file table was set up.
    pub fixed_files: bool,
}

impl UringEngine {
    /// A ring of `depth` entries with sparse tables of `max_buffers` fixed buffers and
    /// `max_files` fixed files (each only if asked for and the kernel agrees).
    pub fn new(
        depth: u32,
        max_buffers: Option<u32>,
        max_files: Option<u32>,
    ) -> io::Result<UringEngine> {
        let ring = IoUring::builder().build(depth)?;
        let depth = depth.min(ring.params().sq_entries());
        let fixed_buffers =
            max_buffers.is_some_and(|n| ring.submitter().register_buffers_sparse(n).is_ok());
        let fixed_files =
            max_files.is_some_and(|n| ring.submitter().register_files_sparse(n).is_ok());
        Ok(UringEngine {
            ring,
            depth,
            in_flight: 0,
            unsubmitted: 0,
            fixed_buffers,
            fixed_files,
        })
    }

    pub fn depth(&self) -> u32 {
        self.depth
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight
    }

    pub fn has_room(&self) -> bool {
        self.in_flight < self.depth
    }

    /// Queue one operation in the SQ (no syscall). Callers check [`Self::has_room`].
    pub fn push(&mut self, cmd: &IoCmd) {
        debug_assert!(self.has_room());
        let buf = cmd.buf as *mut u8;
        let (off, len, b) = (cmd.offset, cmd.len, cmd.fixed_buf);
        let entry = match (cmd.write, cmd.fixed_file, b == NO_FIXED_BUF) {
            (false, Some(f), true) => opcode::Read::new(types::Fixed(f), buf, len)
                .offset(off)
                .build(),
            (false, None, true) => opcode::Read::new(types::Fd(cmd.fd), buf, len)
                .offset(off)
                .build(),
            (true, Some(f), true) => opcode::Write::new(types::Fixed(f), buf, len)
                .offset(off)
                .build(),
            (true, None, true) => opcode::Write::new(types::Fd(cmd.fd), buf, len)
                .offset(off)
                .build(),
            (false, Some(f), false) => opcode::ReadFixed::new(types::Fixed(f), buf, len, b)
                .offset(off)
                .build(),
            (false, None, false) => opcode::ReadFixed::new(types::Fd(cmd.fd), buf, len, b)
                .offset(off)
                .build(),
            (true, Some(f), false) => opcode::WriteFixed::new(types::Fixed(f), buf, len, b)
                .offset(off)
                .build(),
            (true, None, false) => opcode::WriteFixed::new(types::Fd(cmd.fd), buf, len, b)
                .offset(off)
                .build(),
        };
        self.push_entry(entry.user_data(cmd.user_data));
    }

    fn push_entry(&mut self, entry: io_uring::squeue::Entry) {
        // SAFETY: the SQE names memory and a file that the backend contract keeps valid
        // and registered until this operation's completion is reaped (the executor does
        // not deregister regions in use; dropping the backend waits for in-flight
        // operations). There is room: in_flight < depth ≤ SQ entries, and SQEs pushed
        // but not submitted count as in flight.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        debug_assert!(pushed.is_ok(), "SQ full despite in-flight bound");
        if pushed.is_ok() {
            self.in_flight += 1;
            self.unsubmitted += 1;
        }
    }

    /// Hand every queued SQE to the kernel in one syscall. Transient refusals (EINTR,
    /// EAGAIN, EBUSY) leave them queued for the next call.
    pub fn submit(&mut self) -> io::Result<()> {
        if self.unsubmitted == 0 {
            return Ok(());
        }
        match self.ring.submit() {
            Ok(n) => {
                self.unsubmitted = self.unsubmitted.saturating_sub(n as u32);
                Ok(())
            }
            Err(e) if is_transient(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Call `each(user_data, result)` for every completion ready now (no syscall).
    pub fn reap(&mut self, mut each: impl FnMut(u64, i32)) -> usize {
        let mut n = 0;
        for cqe in self.ring.completion() {
            n += 1;
            each(cqe.user_data(), cqe.result());
        }
        self.in_flight -= n as u32;
        n as usize
    }

    /// Submit what is queued and sleep until at least one completion is ready or
    /// `timeout` passes.
    pub fn wait(&mut self, timeout: Duration) -> io::Result<()> {
        if self.in_flight == 0 {
            return Ok(());
        }
        let ts = types::Timespec::from(timeout);
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(n) => {
                self.unsubmitted = self.unsubmitted.saturating_sub(n as u32);
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::ETIME) || is_transient(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Block until every in-flight operation has completed (used when dropping the
    /// backend, so the kernel touches no caller memory afterwards).
    pub fn drain_blocking(&mut self, mut each: impl FnMut(u64, i32)) {
        while self.in_flight > 0 {
            let r = self.ring.submit_and_wait(1);
            let reaped = self.reap(&mut each);
            if let Err(e) = r {
                if !is_transient(&e) && reaped == 0 {
                    // The ring is unusable; closing it makes the kernel cancel and
                    // wait for the rest.
                    return;
                }
            }
        }
    }

    /// Put `[addr, addr+len)` at fixed-buffer index `slot`.
    pub fn register_buffer(&self, slot: u32, addr: u64, len: u64) -> io::Result<()> {
        let iov = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: len as usize,
        };
        // SAFETY: the region stays valid until deregistration, which clears the slot
        // (the executor guarantees registered memory outlives its registration).
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(slot, &[iov], None)
        }
    }

    /// Clear fixed-buffer index `slot`.
    pub fn unregister_buffer(&self, slot: u32) -> io::Result<()> {
        let iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        // SAFETY: an empty iovec names no memory; it only empties the slot.
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(slot, &[iov], None)
        }
    }

    /// Put `fd` at fixed-file index `slot` (-1 clears it).
    pub fn register_file(&self, slot: u32, fd: RawFd) -> io::Result<()> {
        self.ring
            .submitter()
            .register_files_update(slot, &[fd])
            .map(drop)
    }
}

fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
    )
}

/// Set up a small ring and run one read through it, so a sandbox that allows
/// `io_uring_setup` but refuses the operations is caught too.
pub(crate) fn probe() -> Result<(), String> {
    let mut ring = IoUring::new(4).map_err(|e| format!("io_uring_setup failed: {e}"))?;
    let mut pipe = [0 as libc::c_int; 2];
    // SAFETY: `pipe` has room for the two descriptors pipe(2) writes.
    if unsafe { libc::pipe(pipe.as_mut_ptr()) } != 0 {
        return Err(format!("pipe failed: {}", io::Error::last_os_error()));
    }
    let byte = [0x5au8];
    // SAFETY: writes one byte from a live local to the pipe we just made.
    unsafe { libc::write(pipe[1], byte.as_ptr().cast(), 1) };
    let mut got = [0u8; 1];
    let entry = opcode::Read::new(types::Fd(pipe[0]), got.as_mut_ptr(), 1)
        .build()
        .user_data(7);
    // SAFETY: `got` outlives the operation: we wait for its completion below.
    let pushed = unsafe { ring.submission().push(&entry) };
    let result = pushed
        .map_err(|_| "submission queue full".to_string())
        .and_then(|()| {
            ring.submit_and_wait(1)
                .map_err(|e| format!("io_uring_enter failed: {e}"))
        })
        .and_then(|_| {
            let cqe = ring
                .completion()
                .next()
                .ok_or_else(|| "no completion".to_string())?;
            if cqe.user_data() == 7 && cqe.result() == 1 && got[0] == 0x5a {
                Ok(())
            } else {
                Err(format!("io_uring read returned {}", cqe.result()))
            }
        });
    // SAFETY: closing the two descriptors pipe(2) gave us, once.
    unsafe {
        libc::close(pipe[0]);
        libc::close(pipe[1]);
    }
    result
}
