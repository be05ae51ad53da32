//! CPU time of this process's threads, read from `/proc/self/task/*/stat` (Linux).

/// The clock-tick rate `/proc` reports `utime`/`stime` in (`sysconf(_SC_CLK_TCK)`,
/// USER_HZ; 100 on mainstream kernels, but read rather than assumed).
pub fn clock_ticks_per_second() -> u64 {
    // SAFETY: `sysconf` reads a configuration value; it has no preconditions and
    // touches no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 {
        hz as u64
    } else {
        100
    }
}

/// `utime + stime`, in clock ticks, of this process's threads whose name starts with
/// `name` (thread names are cut to 15 bytes by the kernel); 0 when `/proc` is absent.
pub fn thread_cpu_ticks(name: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    let mut total = 0;
    for entry in dir.flatten() {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if !comm.trim_end().starts_with(name) {
            continue;
        }
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        total += stat_cpu_ticks(&stat);
    }
    total
}

/// The same as [`thread_cpu_ticks`], in seconds.
pub fn thread_cpu_seconds(name: &str) -> f64 {
    thread_cpu_ticks(name) as f64 / clock_ticks_per_second() as f64
}

/// `utime + stime` of this process's thread `tid` (a Linux thread id), in seconds; 0
/// when `/proc` is absent or the thread is gone.
pub fn task_cpu_seconds(tid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap_or_default();
    stat_cpu_ticks(&stat) as f64 / clock_ticks_per_second() as f64
}

/// `utime + stime` from one `stat` line. The command name (field 2) is in parentheses
/// and may hold spaces, so fields are counted after its closing `)`: there `state` is
/// the first field and `utime`/`stime` (fields 14 and 15 of the line) the 12th and 13th.
fn stat_cpu_ticks(stat: &str) -> u64 {
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    let field = |i: usize| {
        rest.split_whitespace()
            .nth(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(11) + field(12)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_utime_and_stime_after_a_name_with_spaces() {
        let line = "4242 (a b) c) S 1 2 3 4 5 6 7 8 9 10 170 30 0 0 20 0 1 0";
        assert_eq!(stat_cpu_ticks(line), 200);
        assert_eq!(stat_cpu_ticks("garbage"), 0);
    }

    #[test]
    fn a_busy_thread_accumulates_ticks() {
        assert!(clock_ticks_per_second() >= 1);
        if !std::path::Path::new("/proc/self/task").exists() {
            return crate::ci::skip("/proc", "no /proc/self/task on this system");
        }
        let name = "testkit-busy";
        let worker = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // Spin until this thread's own counter moves: no wall-clock bound.
                let mut x = 1u64;
                while thread_cpu_ticks(name) == 0 {
                    for _ in 0..100_000 {
                        x = std::hint::black_box(x.wrapping_mul(3).wrapping_add(1));
                    }
                }
                x
            })
            .unwrap();
        worker.join().unwrap();
        assert_eq!(thread_cpu_ticks("no-such-thread"), 0);
    }
}
