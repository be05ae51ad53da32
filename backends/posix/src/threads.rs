//! The portable engine: a fixed pool of worker threads doing `pread`/`pwrite` from a
//! bounded job queue. Workers sleep on a condition variable while idle; completions come
//! back through a bounded lock-free queue that `progress` drains.

use std::collections::VecDeque;
use std::io;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use crate::backend::IoCmd;

struct Jobs {
    queue: VecDeque<IoCmd>,
    shutdown: bool,
}

struct Shared {
    jobs: Mutex<Jobs>,
    work: Condvar,
    /// `(user_data, result)`: bytes moved or `-errno`, like a CQE.
    done: ArrayQueue<(u64, i32)>,
    /// Paired with `done_signal` for [`ThreadEngine::wait`].
    done_lock: Mutex<()>,
    done_signal: Condvar,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A worker never panics while holding the lock (it only moves plain data), but do
    // not propagate poison either way: the queue stays consistent.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The worker pool and its in-flight accounting.
pub(crate) struct ThreadEngine {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    depth: u32,
    in_flight: u32,
    /// Jobs pushed since the last submit (handed over under one lock).
    staged: Vec<IoCmd>,
}

impl ThreadEngine {
    /// `workers` threads, at most `depth` operations in flight.
    pub fn new(workers: u32, depth: u32) -> io::Result<ThreadEngine> {
        let shared = Arc::new(Shared {
            jobs: Mutex::new(Jobs {
                queue: VecDeque::with_capacity(depth as usize),
                shutdown: false,
            }),
            work: Condvar::new(),
            done: ArrayQueue::new(depth as usize),
            done_lock: Mutex::new(()),
            done_signal: Condvar::new(),
        });
        let mut engine = ThreadEngine {
            shared,
            workers: Vec::with_capacity(workers as usize),
            depth,
            in_flight: 0,
            staged: Vec::with_capacity(depth as usize),
        };
        for i in 0..workers {
            let shared = Arc::clone(&engine.shared);
            let handle = std::thread::Builder::new()
                .name(format!("ferry-posix-{i}"))
                .spawn(move || worker(&shared))?;
            engine.workers.push(handle);
        }
        Ok(engine)
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

    /// Stage one operation. Callers check [`Self::has_room`].
    pub fn push(&mut self, cmd: &IoCmd) {
        debug_assert!(self.has_room());
        // Within capacity: staged + queued ≤ in_flight ≤ depth.
        self.staged.push(*cmd);
        self.in_flight += 1;
    }

    /// Hand the staged operations to the workers under one lock.
    pub fn submit(&mut self) {
        if self.staged.is_empty() {
            return;
        }
        let n = self.staged.len();
        {
            let mut jobs = lock(&self.shared.jobs);
            jobs.queue.extend(self.staged.drain(..));
        }
        if n == 1 {
            self.shared.work.notify_one();
        } else {
            self.shared.work.notify_all();
        }
    }

    /// Call `each(user_data, result)` for every finished operation.
    pub fn reap(&mut self, mut each: impl FnMut(u64, i32)) -> usize {
        let mut n = 0;
        while let Some((user_data, result)) = self.shared.done.pop() {
            n += 1;
            each(user_data, result);
        }
        self.in_flight -= n as u32;
        n
    }

    /// Sleep until at least one operation has finished or `timeout` passes.
    pub fn wait(&mut self, timeout: Duration) {
        self.submit();
        if self.in_flight == 0 {
            return;
        }
        let guard = lock(&self.shared.done_lock);
        if self.shared.done.is_empty() {
            let _unused = self
                .shared
                .done_signal
                .wait_timeout_while(guard, timeout, |()| self.shared.done.is_empty());
        }
    }

    /// Let the workers finish the operation each is running, drop queued ones (they
    /// touched no memory), and join them.
    pub fn shutdown(&mut self) {
        {
            let mut jobs = lock(&self.shared.jobs);
            jobs.shutdown = true;
            jobs.queue.clear();
        }
        self.shared.work.notify_all();
        for handle in self.workers.drain(..) {
            // A worker that panicked has nothing left to finish.
            let _unused = handle.join();
        }
    }
}

impl Drop for ThreadEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker(shared: &Shared) {
    loop {
        let cmd = {
            let mut jobs = lock(&shared.jobs);
            loop {
                if jobs.shutdown {
                    return;
                }
                if let Some(cmd) = jobs.queue.pop_front() {
                    break cmd;
                }
                jobs = shared.work.wait(jobs).unwrap_or_else(|p| p.into_inner());
            }
        };
        let result = run(&cmd);
        // Cannot be full: an operation counts as in flight from `push` until `reap` has
        // popped its result, `push` admits at most `depth` in flight, and the queue holds
        // `depth`; so every result waiting here belongs to a distinct in-flight
        // operation. Should that ever not hold, the worker waits for room (back-pressure)
        // instead of dropping a completion.
        let mut entry = (cmd.user_data, result);
        while let Err(back) = shared.done.push(entry) {
            debug_assert!(false, "completion queue full: more than `depth` in flight");
            entry = back;
            std::thread::yield_now();
        }
        let _guard = lock(&shared.done_lock);
        shared.done_signal.notify_one();
    }
}

/// Move as much of the operation as the file allows; bytes moved, or `-errno` when
/// nothing moved.
fn run(cmd: &IoCmd) -> i32 {
    let mut done: usize = 0;
    let len = cmd.len as usize;
    while done < len {
        let addr = cmd.buf as usize + done;
        let offset = (cmd.offset + done as u64) as libc::off_t;
        let r = if cmd.write {
            // SAFETY: the range [buf, buf+len) is registered host memory the caller keeps
            // valid until this operation's completion is reaped (backend contract).
            unsafe { libc::pwrite(cmd.fd, addr as *const libc::c_void, len - done, offset) }
        } else {
            // SAFETY: as above; the range is writable memory reserved for this read.
            unsafe { libc::pread(cmd.fd, addr as *mut libc::c_void, len - done, offset) }
        };
        if r < 0 {
            let errno = io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if errno == libc::EINTR {
                continue;
            }
            return if done > 0 { done as i32 } else { -errno };
        }
        if r == 0 {
            break;
        }
        done += r as usize;
    }
    done as i32
}
