//! Small helpers shared by the backends: error mapping and socket set-up.

use std::fmt::Display;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use ferry_storage::Error;

/// Lock `m`, ignoring poisoning. Every lock of this crate guards data kept consistent
/// at each step (queues, maps, counters), so a panic on another thread while holding it
/// leaves nothing half-done that the next user could trip on. The crate's one helper of
/// this kind (with [`read`], [`write`] and [`wait_timeout`]).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// [`lock`] for the read side of an `RwLock`.
pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|e| e.into_inner())
}

/// [`lock`] for the write side of an `RwLock`.
pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|e| e.into_inner())
}

/// `Condvar::wait_timeout`, ignoring poisoning as [`lock`] does.
pub(crate) fn wait_timeout<'a, T>(
    cv: &Condvar,
    guard: MutexGuard<'a, T>,
    timeout: Duration,
) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, timeout)
        .map(|(g, _)| g)
        .unwrap_or_else(|e| e.into_inner().0)
}

/// `Condvar::wait`, ignoring poisoning as [`lock`] does.
pub(crate) fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
    cv.wait(guard).unwrap_or_else(|e| e.into_inner())
}

/// Turn an I/O error of `backend` into Ferry's error, naming what was being done.
/// Timeouts (which Linux reports as `EAGAIN` on a socket read) get `ETIMEDOUT`.
pub(crate) fn io_error(backend: &'static str, what: impl Display, e: &io::Error) -> Error {
    let (errno, detail) = match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            (libc::ETIMEDOUT, format!("{what}: timed out"))
        }
        io::ErrorKind::UnexpectedEof => (
            libc::ECONNRESET,
            format!("{what}: the other side closed the connection"),
        ),
        _ => (e.raw_os_error().unwrap_or(0), format!("{what}: {e}")),
    };
    Error::Backend {
        backend: backend.into(),
        errno,
        desc: None,
        detail: detail.into(),
    }
}

/// A timeout error of `backend` with `detail`.
pub(crate) fn timeout_error(backend: &'static str, detail: String) -> Error {
    Error::Backend {
        backend: backend.into(),
        errno: libc::ETIMEDOUT,
        desc: None,
        detail: detail.into(),
    }
}

/// True for the errors a socket read with a timeout gives when the time is up.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Connect to `endpoint` (`HOST:PORT`) within `timeout` per resolved address, with
/// `TCP_NODELAY` and read/write timeouts of `timeout`.
pub(crate) fn connect(
    backend: &'static str,
    endpoint: &str,
    timeout: Duration,
) -> Result<TcpStream, Error> {
    let addrs: Vec<SocketAddr> = endpoint
        .to_socket_addrs()
        .map_err(|e| io_error(backend, format_args!("resolving '{endpoint}'"), &e))?
        .collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(stream) => {
                configure(&stream, timeout)
                    .map_err(|e| io_error(backend, format_args!("configuring {addr}"), &e))?;
                return Ok(stream);
            }
            Err(e) => last = e,
        }
    }
    Err(io_error(
        backend,
        format_args!("connecting to {endpoint}"),
        &last,
    ))
}

/// Set `TCP_NODELAY` and read/write timeouts on a socket.
pub(crate) fn configure(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(nonzero(timeout)))?;
    stream.set_write_timeout(Some(nonzero(timeout)))
}

/// `d`, or one millisecond if it is zero (a zero socket timeout is refused by std).
pub(crate) fn nonzero(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

/// `start + after`, saturating: a configured duration too large to add (years) gives
/// the latest instant that can be represented near it instead of a panic.
pub(crate) fn deadline_after(start: Instant, after: Duration) -> Instant {
    if let Some(t) = start.checked_add(after) {
        return t;
    }
    // Halve until it fits: still centuries away for any overflowing input.
    let mut step = after;
    let mut t = start;
    while !step.is_zero() {
        step /= 2;
        if let Some(next) = t.checked_add(step) {
            t = next;
        }
    }
    t
}

/// 16 random bytes from the operating system.
pub(crate) fn nonce() -> Result<[u8; 16], Error> {
    let mut n = [0u8; 16];
    getrandom::fill(&mut n).map_err(|e| {
        Error::backend("exchange", format!("reading random bytes for a nonce: {e}"))
    })?;
    Ok(n)
}

/// Where to connect to reach a listener bound to `addr` (unspecified → loopback).
pub(crate) fn wake_addr(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
        }
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_saturate_instead_of_overflowing() {
        let now = Instant::now();
        assert_eq!(
            deadline_after(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        let far = deadline_after(now, Duration::MAX);
        assert!(far > now + Duration::from_secs(1 << 30));
        let far = deadline_after(now, Duration::from_millis(u64::MAX));
        assert!(far > now + Duration::from_secs(1 << 30));
    }
}
