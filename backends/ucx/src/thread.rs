//! The optional progress thread. It progresses the workers while there is work, may keep
//! polling for a while after the last progress (`progress_thread_spin_us`, see
//! [`Spin`]: a request that follows within that window finds the thread awake and pays
//! no wake-up), and otherwise **sleeps in `poll` on the workers' event fds** (armed with
//! `ucp_worker_arm`) plus an eventfd used to stop it, so an idle backend costs
//! essentially no CPU (the reference system's progress thread spins a whole core).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
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

/// When the progress thread polls on after progress instead of sleeping.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spin {
    /// Poll on for this long after every progress (zero: sleep at once).
    Fixed(Duration),
    /// Poll on for up to this long after progress, but only while work keeps coming
    /// back within it: after three wake-ups in a row that each found progress
    /// within the window of the previous one (so polling would have caught them). A
    /// window that passes without progress turns polling off until such a streak is
    /// seen again. Isolated requests, or a trickle sparser than the window, never make
    /// the thread spin; a steady exchange (request, answer, next request) does, and each
    /// of its requests then finds the thread awake. What polling can waste is bounded
    /// by one window per streak.
    Auto(Duration),
}

/// The window of `progress_thread_spin_us=auto`.
pub const AUTO_WINDOW: Duration = Duration::from_micros(100);
/// How long `auto` polls on after progress that was UCX's own work (no callback of
/// ours ran: an endpoint's wireup, a connection accepted or closed). UCX 1.13's tcp
/// transport does not wake a sleeping worker for every step of a wireup (measured on
/// loopback with Debian's 1.13.1: steps of a new peer's wireup waited 3–20 ms for the
/// sleeping thread, the load's 5 ms wait ran out in 19–34 of 41 loads, and the first
/// request waited out the rest); polled through, a wireup takes ~0.5 ms. Each such progress renews the window.
pub const SETTLE_WINDOW: Duration = Duration::from_millis(1);
/// Short wake-ups in a row before `auto` polls on.
pub const AUTO_STREAK: u32 = 3;

/// The thread's state for [`Spin`]: when it last made progress, and (auto) how many
/// wake-ups in a row came soon after the progress before.
#[derive(Debug)]
struct SpinGate {
    spin: Spin,
    last_progress: Option<Instant>,
    streak: u32,
    /// `auto`: poll on until then, after UCX's own progress ([`SETTLE_WINDOW`]).
    settle_until: Option<Instant>,
}

impl SpinGate {
    fn new(spin: Spin) -> SpinGate {
        SpinGate {
            spin,
            last_progress: None,
            streak: 0,
            settle_until: None,
        }
    }

    /// Progress was made at `now`; `woke` says whether the thread had slept in `poll`
    /// since the pass before (rather than polling on).
    fn progressed(&mut self, now: Instant, woke: bool) {
        if let (Spin::Auto(window), true) = (self.spin, woke) {
            let soon = self
                .last_progress
                .is_some_and(|at| now.saturating_duration_since(at) < window);
            self.streak = if soon {
                self.streak.saturating_add(1)
            } else {
                0
            };
        }
        self.last_progress = Some(now);
    }

    /// A peer just loaded us (it pinged): its first request is likely to follow within
    /// the window, so `auto` polls on from `now` as after a streak. What it can waste
    /// is one window per load.
    fn expect_requests(&mut self, now: Instant) {
        if let Spin::Auto(_) = self.spin {
            self.streak = self.streak.max(AUTO_STREAK);
            self.last_progress = Some(now);
        }
    }

    /// UCX progressed at `now` without calling any callback of ours: its own work (a
    /// wireup, a connection), whose next step may not wake a sleeping thread; `auto`
    /// polls on for [`SETTLE_WINDOW`] from `now`.
    /// Returns whether this opened a window (rather than renewing one, or none under
    /// a fixed spin).
    fn settling(&mut self, now: Instant) -> bool {
        let Spin::Auto(_) = self.spin else {
            return false;
        };
        let opened = self.settle_until.is_none_or(|until| now >= until);
        self.settle_until = Some(now + SETTLE_WINDOW);
        opened
    }

    /// Whether the thread polls on at `now` instead of arming and sleeping.
    #[cfg(test)]
    fn awake(&mut self, now: Instant) -> bool {
        self.spinning(now) || self.settling_at(now)
    }

    /// Whether a settle window ([`SETTLE_WINDOW`]) is open at `now`.
    fn settling_at(&mut self, now: Instant) -> bool {
        let open = self.settle_until.is_some_and(|until| now < until);
        if !open {
            self.settle_until = None;
        }
        open
    }

    /// Whether a spin window (fixed, or `auto` after a streak or a ping) is open at
    /// `now`.
    fn spinning(&mut self, now: Instant) -> bool {
        let (window, on) = match self.spin {
            Spin::Fixed(window) => (window, true),
            Spin::Auto(window) => (window, self.streak >= AUTO_STREAK),
        };
        let within = self
            .last_progress
            .is_some_and(|at| now.saturating_duration_since(at) < window);
        if on && !within {
            // The window passed with nothing: the exchange has stopped.
            self.streak = 0;
        }
        on && within
    }
}

#[derive(Default)]
struct ThreadStats {
    /// Spin windows opened (the thread polled on after progress instead of sleeping).
    spins: AtomicU64,
    /// Passes of the loop.
    passes: AtomicU64,
    /// Settle windows opened: progress that was UCX's own work ([`SETTLE_WINDOW`]).
    settles: AtomicU64,
}

pub(crate) struct ProgressThread {
    /// The thread's Linux thread id (0 until it has started).
    tid: Arc<AtomicI32>,
    /// What the thread has done, for tests and diagnostics.
    stats: Arc<ThreadStats>,
    stop: Arc<AtomicBool>,
    wake_fd: i32,
    handle: Option<JoinHandle<()>>,
}

impl ProgressThread {
    pub(crate) fn start(core: Arc<Mutex<Core>>, spin: Spin) -> Result<ProgressThread> {
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
        let stats = Arc::new(ThreadStats::default());
        let thread_stats = stats.clone();
        let handle = std::thread::Builder::new()
            .name("ferry-ucx-progress".into())
            .spawn(move || {
                // SAFETY: gettid has no preconditions.
                thread_tid.store(unsafe { libc::gettid() }, Ordering::Release);
                run(core, efds, wake_fd, thread_stop, spin, &thread_stats)
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
            stats,
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

    /// Spin windows opened so far, passes of its loop (each one progress of the
    /// workers; a sleeping thread makes one per wake-up), and settle windows opened
    /// (counted apart: the spin windows are the streaks', the pings' and a fixed
    /// spin's only).
    pub(crate) fn stats(&self) -> (u64, u64, u64) {
        (
            self.stats.spins.load(Ordering::Relaxed),
            self.stats.passes.load(Ordering::Relaxed),
            self.stats.settles.load(Ordering::Relaxed),
        )
    }
}

fn run(
    core: Arc<Mutex<Core>>,
    efds: Vec<i32>,
    wake_fd: i32,
    stop: Arc<AtomicBool>,
    spin: Spin,
    stats: &ThreadStats,
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
    let mut gate = SpinGate::new(spin);
    // Whether the thread slept in poll since its last pass.
    let mut woke = false;
    let mut was_spinning = false;
    let mut pings = 0u64;
    while !stop.load(Ordering::Acquire) {
        let (awake, armed) = {
            let mut core = core.lock().unwrap_or_else(|e| e.into_inner());
            core.vram_bind();
            let progressed = core.pump();
            stats.passes.fetch_add(1, Ordering::Relaxed);
            let now = Instant::now();
            if progressed {
                gate.progressed(now, woke);
                let answered = core.pings_answered();
                if answered != pings {
                    pings = answered;
                    gate.expect_requests(now);
                }
                if core.ucx_own_work() && gate.settling(now) {
                    stats.settles.fetch_add(1, Ordering::Relaxed);
                }
            }
            woke = false;
            let spinning = gate.spinning(now);
            let awake = spinning || gate.settling_at(now);
            if spinning && !was_spinning {
                stats.spins.fetch_add(1, Ordering::Relaxed);
            }
            was_spinning = spinning;
            (awake, !awake && core.arm())
        };
        if awake {
            // Let a caller waiting for the core take it between two polls.
            std::thread::yield_now();
            continue;
        }
        if !armed {
            // Events arrived between the last progress and arming: progress again.
            continue;
        }
        woke = true;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn fixed_polls_for_its_window_after_every_progress() {
        let t0 = Instant::now();
        let mut g = SpinGate::new(Spin::Fixed(us(200)));
        assert!(!g.awake(t0), "no progress yet");
        g.progressed(t0, true);
        assert!(g.awake(t0 + us(199)));
        assert!(!g.awake(t0 + us(200)));
        let mut zero = SpinGate::new(Spin::Fixed(Duration::ZERO));
        zero.progressed(t0, true);
        assert!(!zero.awake(t0), "0 sleeps at once");
    }

    #[test]
    fn auto_polls_only_after_a_streak_of_short_wakeups_and_stops_when_it_ends() {
        let t0 = Instant::now();
        let w = AUTO_WINDOW.as_micros() as u64;
        let mut g = SpinGate::new(Spin::Auto(AUTO_WINDOW));
        // An isolated request, and a trickle sparser than the window: never awake.
        g.progressed(t0, true);
        assert!(!g.awake(t0));
        let mut t = t0;
        for _ in 0..10 {
            t += us(w + 1);
            g.progressed(t, true);
            assert!(
                !g.awake(t),
                "a trickle sparser than the window made it spin"
            );
        }
        // Progress found without sleeping in between (one request's several events)
        // does not count towards the streak.
        for _ in 0..10 {
            t += us(1);
            g.progressed(t, false);
            assert!(!g.awake(t));
        }
        // A steady exchange: wake-ups each within the window of the one before.
        for i in 1..=AUTO_STREAK {
            t += us(w / 4);
            g.progressed(t, true);
            assert_eq!(g.awake(t), i >= AUTO_STREAK, "after {i} short wake-ups");
        }
        // Progress caught while polling keeps it polling.
        t += us(w / 2);
        assert!(g.awake(t));
        g.progressed(t, false);
        assert!(g.awake(t + us(w - 1)));
        // The window passes without progress: it sleeps, and the next request after
        // a short sleep does not turn polling back on alone.
        t += us(w);
        assert!(!g.awake(t));
        t += us(w / 4);
        g.progressed(t, true);
        assert!(!g.awake(t), "one short wake-up after the exchange stopped");
    }

    #[test]
    fn a_ping_opens_one_window_under_auto_only() {
        let t0 = Instant::now();
        let w = AUTO_WINDOW.as_micros() as u64;
        let mut g = SpinGate::new(Spin::Auto(AUTO_WINDOW));
        g.progressed(t0, true);
        g.expect_requests(t0);
        assert!(g.awake(t0 + us(w - 1)), "a ping opens a window at once");
        assert!(!g.awake(t0 + us(w)), "and it closes like any other");
        let t1 = t0 + us(10 * w);
        g.progressed(t1, true);
        assert!(!g.awake(t1), "one window per ping, no streak left behind");
        let mut off = SpinGate::new(Spin::Fixed(Duration::ZERO));
        off.progressed(t0, true);
        off.expect_requests(t0);
        assert!(!off.awake(t0), "0 sleeps at once, pinged or not");
    }

    #[test]
    fn ucx_own_progress_opens_a_settle_window_under_auto_only_and_renews_it() {
        let t0 = Instant::now();
        let s = SETTLE_WINDOW.as_micros() as u64;
        let mut g = SpinGate::new(Spin::Auto(AUTO_WINDOW));
        g.progressed(t0, true);
        assert!(g.settling(t0), "the first opens a window");
        assert!(g.awake(t0 + us(s - 1)));
        let t1 = t0 + us(s / 2);
        g.progressed(t1, false);
        assert!(!g.settling(t1), "a second within the window renews it");
        assert!(g.awake(t1 + us(s - 1)), "renewed from the second");
        assert!(
            !g.awake(t1 + us(s)),
            "and it closes one window after the last"
        );
        assert!(!g.awake(t1 + us(s + 1)), "no streak is left behind");
        let mut off = SpinGate::new(Spin::Fixed(Duration::ZERO));
        off.progressed(t0, true);
        assert!(!off.settling(t0), "0 never polls on");
        assert!(!off.awake(t0));
    }
}
