//! Who we are and who is alive: the host identity, peer liveness (pidfd), the kernel's
//! ptrace policy and cross-memory attach (`process_vm_readv`/`writev`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;

/// This host's identity: the kernel boot id, the host name, the pid namespace and the
/// network namespace. Two processes with the same identity share a kernel and a pid
/// namespace, so a pid and `/proc/<pid>/fd/<n>` name the same thing for both;
/// containers on one machine (same boot id, other pid namespace) differ. Processes in
/// different network namespaces are treated as different hosts too (SHM could reach
/// them, but a network namespace is how containers, and this project's tests and
/// benchmarks, stand for another machine: they get the network backend).
pub fn host_identity() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|e| format!("no-boot-id({e})"));
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .unwrap_or_default();
        let ns = |which: &str| {
            std::fs::read_link(format!("/proc/self/ns/{which}"))
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default()
        };
        format!("{boot}/{host}/{}/{}", ns("pid"), ns("net"))
    })
}

/// `/proc/sys/kernel/yama/ptrace_scope`, if the Yama LSM is there.
pub fn ptrace_scope() -> Option<u32> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Words for the ptrace policy, for error messages.
pub fn ptrace_policy() -> String {
    match ptrace_scope() {
        None => "no Yama LSM (classic ptrace rules: same uid or CAP_SYS_PTRACE)".into(),
        Some(0) => "yama ptrace_scope 0 (same uid)".into(),
        Some(1) => "yama ptrace_scope 1 (only descendants, or a process that allowed us \
                    with prctl(PR_SET_PTRACER))"
            .into(),
        Some(2) => "yama ptrace_scope 2 (CAP_SYS_PTRACE only)".into(),
        Some(n) => format!("yama ptrace_scope {n} (no attach at all)"),
    }
}

/// A peer process's liveness: a pidfd where the kernel has them (it becomes readable
/// when the process exits, and never names a reused pid), else `kill(pid, 0)`.
#[derive(Debug)]
pub struct Liveness {
    pid: i32,
    pidfd: Option<OwnedFd>,
}

impl Liveness {
    /// Watch process `pid`. Open it before checking anything else about the process, so
    /// that what those checks saw belongs to the process the pidfd names.
    pub fn open(pid: i32) -> Liveness {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        let pidfd = (fd >= 0).then(|| {
            // SAFETY: the syscall returned a fresh fd that nothing else owns.
            unsafe { OwnedFd::from_raw_fd(fd as i32) }
        });
        Liveness { pid, pidfd }
    }

    /// Whether the process still runs (one `poll` with a zero timeout, or one `kill`).
    pub fn alive(&self) -> bool {
        match &self.pidfd {
            Some(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout: never blocks.
                let n = unsafe { libc::poll(&mut p, 1, 0) };
                !(n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0)
            }
            None => {
                // SAFETY: signal 0 only checks that the process exists.
                let r = unsafe { libc::kill(self.pid, 0) };
                r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
            }
        }
    }
}

/// Whether process `pid` exists (for reclaiming lanes of senders that died).
pub fn pid_exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Read `buf.len()` bytes at `remote_addr` of process `pid` with one
/// `process_vm_readv`; the errno when the kernel refuses or the read is short.
pub fn cma_read(pid: i32, remote_addr: u64, buf: &mut [u8]) -> Result<(), i32> {
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: remote_addr as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: the local iovec is `buf`, which we own mutably; the remote side is the
    // other process's memory, checked by the kernel (EFAULT if unmapped).
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if n < 0 {
        Err(std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO))
    } else if n as usize != buf.len() {
        Err(libc::EFAULT)
    } else {
        Ok(())
    }
}

/// Fill `buf` with random bytes from the kernel.
pub fn random_bytes(buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: writes at most the remaining length into `buf`.
        let n =
            unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        filled += n as usize;
    }
    Ok(())
}

/// The last OS error's number.
pub fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}
