//! What the executor logs, through the `log` facade (the library installs no logger):
//!
//! - `debug`: one line per control-plane event — a region registered or deregistered
//!   (one line per command, not per descriptor), a peer invalidated, a connection made,
//!   a bound hit (`LimitLog`: the 1st, 2nd, 4th, 8th … hit of each bound, so a full
//!   queue cannot flood the log);
//! - `trace`: one summary line per flush (`FlushTrace`, target `ferry::flush`:
//!   commands by kind, posts, checks, completions, bytes posted, the executor's
//!   duration).
//!
//! Nothing is logged on the per-descriptor path. With a level off, a log statement is
//! one relaxed atomic load (`log`'s max level) and its arguments are not evaluated; the
//! flush summary is counted only when `log_enabled!(Trace)` said yes at the flush's
//! start, so a flush with tracing off does no extra work and allocates nothing.

use std::fmt;
use std::time::{Duration, Instant};

use ferry_storage::BackendMask;

use crate::command::Command;
use crate::world::World;

/// The type names of the backend slots in a mask, for a log line: `LOOPBACK, POSIX`
/// (or `none`). Formats lazily: nothing is built unless the line is written.
pub struct BackendNames<'a> {
    world: &'a World,
    mask: BackendMask,
}

impl<'a> BackendNames<'a> {
    /// The names of `mask`'s slots in `world`.
    pub fn new(world: &'a World, mask: BackendMask) -> BackendNames<'a> {
        BackendNames { world, mask }
    }
}

impl fmt::Display for BackendNames<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for slot in self.mask.iter() {
            let name = self.world.slot_name(slot).unwrap_or("?");
            if !first {
                f.write_str(", ")?;
            }
            f.write_str(name)?;
            first = false;
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

/// A region's range for a log line: `4096 bytes at 0x7f.. (device 0)`; FILE: offset
/// and descriptor.
pub(crate) struct DescText(
    pub(crate) ferry_storage::MemKind,
    pub(crate) ferry_storage::Desc,
);

impl std::fmt::Display for DescText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let DescText(kind, d) = *self;
        match kind {
            ferry_storage::MemKind::File if d.len == 0 => {
                write!(f, "from offset {} to the end (fd {})", d.addr, d.dev)
            }
            ferry_storage::MemKind::File => {
                write!(f, "{} bytes at offset {} (fd {})", d.len, d.addr, d.dev)
            }
            _ => write!(f, "{} bytes at {:#x} (device {})", d.len, d.addr, d.dev),
        }
    }
}

/// ` (path /x/y)` for a FILE region registered by path.
pub(crate) struct PathText<'a>(pub(crate) Option<&'a std::path::Path>);

impl std::fmt::Display for PathText<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(p) => write!(f, " (path {})", p.display()),
            None => Ok(()),
        }
    }
}

/// Distinct bounds whose hits are counted apart; further ones share the last entry.
const LIMITS_TRACKED: usize = 16;

/// Hits of capacity bounds (`Error::Capacity`), by the bound's name, logged at `debug`
/// on the 1st, 2nd, 4th, 8th … hit of each: a loop that keeps hitting a full queue
/// writes a line per doubling, not per command. Fixed size, no allocation.
#[derive(Debug)]
pub(crate) struct LimitLog {
    hits: [(&'static str, u64); LIMITS_TRACKED],
}

impl Default for LimitLog {
    fn default() -> Self {
        LimitLog {
            hits: [("", 0); LIMITS_TRACKED],
        }
    }
}

impl LimitLog {
    /// Count a hit of bound `what` (limit `limit`) on agent `agent`; log it when its
    /// count is a power of two.
    pub(crate) fn hit(&mut self, agent: &str, what: &'static str, limit: usize) {
        let at = self
            .hits
            .iter()
            .position(|&(w, n)| n == 0 || w == what)
            .unwrap_or(LIMITS_TRACKED - 1);
        let entry = &mut self.hits[at];
        if entry.1 == 0 {
            entry.0 = what;
        }
        entry.1 = entry.1.saturating_add(1);
        let count = entry.1;
        if count.is_power_of_two() {
            log::debug!(
                "agent '{agent}': limit hit: {what} (limit {limit}); {count} hit(s) so far \
                 (logged at the 1st, 2nd, 4th, 8th … hit)"
            );
        }
    }
}

/// Command kinds of the flush summary, in the order they are printed.
const KINDS: [&str; 13] = [
    "exchange",
    "load_md",
    "invalidate_md",
    "connect",
    "register",
    "deregister",
    "prep",
    "create",
    "make",
    "post",
    "check",
    "notify",
    "drain",
];

fn kind_index(command: &Command) -> usize {
    match command {
        Command::Exchange(_) => 0,
        Command::LoadMd { .. } => 1,
        Command::InvalidateMd { .. } => 2,
        Command::Connect { .. } => 3,
        Command::Register { .. } => 4,
        Command::Deregister { .. } => 5,
        Command::Prep { .. } => 6,
        Command::Create { .. } => 7,
        Command::Make { .. } => 8,
        Command::Post { .. } => 9,
        Command::Check { .. } => 10,
        Command::Notify { .. } => 11,
        Command::DrainNotifications => 12,
        Command::Release { .. } => 13,
    }
}

/// The `trace` summary of one flush. Made only when `log_enabled!(Trace)` at the
/// flush's start ([`FlushTrace::start`]); a flush without it counts nothing.
pub(crate) struct FlushTrace {
    started: Instant,
    /// Commands by kind (`KINDS`, then release).
    kinds: [u32; KINDS.len() + 1],
    /// Bytes of the requests handed to backends.
    pub(crate) bytes: u64,
}

impl FlushTrace {
    /// A summary to fill in, if `trace` is enabled for this crate.
    #[inline]
    pub(crate) fn start() -> Option<FlushTrace> {
        if !log::log_enabled!(target: "ferry::flush", log::Level::Trace) {
            return None;
        }
        Some(FlushTrace {
            started: Instant::now(),
            kinds: [0; KINDS.len() + 1],
            bytes: 0,
        })
    }

    /// Count the buffer's commands by kind.
    pub(crate) fn count(&mut self, commands: &[Command]) {
        for c in commands {
            self.kinds[kind_index(c)] += 1;
        }
    }

    /// Write the line.
    pub(crate) fn finish(self, agent: &str, summary: &crate::FlushSummary) {
        let elapsed: Duration = self.started.elapsed();
        log::trace!(
            target: "ferry::flush",
            "agent '{agent}': flush: {} command(s) [{}]; {} posted ({} bytes), {} completion(s), \
             {} notification(s) drained, {} failed; {:.1} us",
            self.kinds.iter().sum::<u32>(),
            Kinds(&self.kinds),
            summary.posted,
            self.bytes,
            summary.completed,
            summary.notifications,
            summary.failed,
            elapsed.as_secs_f64() * 1e6,
        );
    }
}

/// `post 2, check 1, release 2` (kinds with a count only).
struct Kinds<'a>(&'a [u32; KINDS.len() + 1]);

impl fmt::Display for Kinds<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = KINDS.iter().copied().chain(std::iter::once("release"));
        let mut first = true;
        for (name, &n) in names.zip(self.0.iter()) {
            if n == 0 {
                continue;
            }
            if !first {
                f.write_str(", ")?;
            }
            write!(f, "{name} {n}")?;
            first = false;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::LimitLog;

    #[test]
    fn limit_log_counts_each_bound_apart_and_keeps_counting_past_its_table() {
        let mut log = LimitLog::default();
        for _ in 0..5 {
            log.hit("a", "queue", 4);
        }
        log.hit("a", "table", 8);
        assert_eq!(log.hits[0], ("queue", 5));
        assert_eq!(log.hits[1], ("table", 1));
        for i in 0..40 {
            // Distinct static names: more than the table holds.
            let what: &'static str = Box::leak(format!("bound {i}").into_boxed_str());
            log.hit("a", what, 1);
        }
        assert_eq!(log.hits[0], ("queue", 5));
        assert!(
            log.hits[super::LIMITS_TRACKED - 1].1 > 1,
            "overflow entry shared"
        );
    }
}
