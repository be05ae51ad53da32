//! The optional progress thread. It progresses the workers while there is work, keeps
//! polling for `progress_thread_spin_us` after the last progress (0 by default; a
//! request that follows within it finds the thread awake), and otherwise **sleeps in `poll` on the workers'
//! event fds** (armed with `ucp_worker_arm`) plus an eventfd used to stop it, so an
//! idle backend costs essentially no CPU (the reference system's progress thread spins
//! a whole core).

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferry_backend_api::{Error, Result};

use crate::state::Core;
use crate::BACKEND;

/// A safety net only: wake up at least this often even without events, in case some
/// transport completes an operation without signalling the worker's fd (the executor's
/// own progress calls cover that case too).
const IDLE_WAKEUP_MS: i32 = 1000;

pub(crate) struct ProgressThread {
    /// The thread's Linux thread id (0 until it has started).
    tid: Arc<AtomicI32>,
    stop: Arc<AtomicBool>,
    wake_fd: i32,
    handle: Option<JoinHandle<()>>,
}

impl ProgressThread {
    pub(crate) fn start(core: Arc<Mutex<Core>>, spin: Duration) -> Result<ProgressThread> {
        let efds = core.lock().unwrap_or_else(|e| e.into_inner()).event_fds();
        debug_assert!(efds.iter().all(|&fd| fd >= 0));
        // SAFETY: plain syscall creating a new fd we own.
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake_fd < 0 {
            return Err(Error::Backend {
                backend: BACKEND.into(),
                errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
                desc: None,
                detail: "eventfd for the progress thread".into(),
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let thread_stop = stop.clone();
        let tid = Arc::new(AtomicI32::new(0));
        let thread_tid = tid.clone();
        let handle = std::thread::Builder::new()
            .name("ferry-ucx-progress".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                thread_tid.store(unsafe { libc::gettid() }, Ordering::Release);
                run(core, efds, wake_fd, thread_stop, spin)
            })
            .map_err(|e| Error::Backend {
                backend: BACKEND.into(),
                errno: e.raw_os_error().unwrap_or(0),
                desc: None,
                detail: format!("spawning the progress thread: {e}").into(),
            });
        let handle = match handle {
            Ok(h) => h,
            Err(e) => {
                // SAFETY: closing the eventfd created above, used by nobody.
                unsafe { libc::close(wake_fd) };
                return Err(e);
            }
        };
        Ok(ProgressThread {
            tid,
            stop,
            wake_fd,
            handle: Some(handle),
        })
    }
}

impl ProgressThread {
    /// The thread's Linux thread id, once it has started.
    pub(crate) fn tid(&self) -> Option<i32> {
        Some(self.tid.load(Ordering::Acquire)).filter(|&t| t != 0)
    }
}

fn run(
    core: Arc<Mutex<Core>>,
    efds: Vec<i32>,
    wake_fd: i32,
    stop: Arc<AtomicBool>,
    spin: Duration,
) {
    let mut fds: Vec<libc::pollfd> = efds
        .iter()
        .chain(std::iter::once(&wake_fd))
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // When the last progress was made: until `spin` after it the thread polls on
    // instead of arming and sleeping.
    let mut last_progress: Option<Instant> = None;
    while !stop.load(Ordering::Acquire) {
        let armed = {
            let mut core = core.lock().unwrap_or_else(|e| e.into_inner());
            core.vram_bind();
            let now = core.pump().then(Instant::now);
            last_progress = now.or(last_progress);
            let awake = last_progress.is_some_and(|at| at.elapsed() < spin);
            !awake && core.arm()
        };
        if last_progress.is_some_and(|at| at.elapsed() < spin) {
            // Let a caller waiting for the core take it between two polls.
            std::thread::yield_now();
            continue;
        }
        if !armed {
            // Events arrived between the last progress and arming: progress again.
            continue;
        }
        for fd in &mut fds {
            fd.revents = 0;
        }
        // SAFETY: fds is a valid array of pollfd for the duration of the call.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, IDLE_WAKEUP_MS) };
        if fds.last().is_some_and(|fd| fd.revents != 0) {
            let mut counter = 0u64;
            // SAFETY: reading 8 bytes from our non-blocking eventfd into a u64.
            unsafe { libc::read(wake_fd, &mut counter as *mut u64 as *mut libc::c_void, 8) };
        }
    }
}

impl Drop for ProgressThread {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let one = 1u64;
        // SAFETY: writing 8 bytes to our eventfd wakes the thread's poll.
        unsafe { libc::write(self.wake_fd, &one as *const u64 as *const libc::c_void, 8) };
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
        // SAFETY: the thread has exited; nobody uses the fd any more.
        unsafe { libc::close(self.wake_fd) };
    }
}
