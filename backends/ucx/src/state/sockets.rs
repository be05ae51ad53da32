//! Aborting a failed peer's TCP connections, so no byte of a request reported failed
//! reaches the peer later (issue 21).
//!
//! # Why
//!
//! UCX's force close cancels what UCX still holds, then closes the socket. A plain
//! `close` leaves what the kernel already took (up to the socket's send buffer, ~4 MiB)
//! queued: the kernel keeps retransmitting it, and when a link that went down comes
//! back, those bytes of WRITEs that Ferry reported failed land in the target's memory —
//! seconds later, when the caller may have reused the blocks (measured: 3.4–3.7 MB
//! landed per round before this module).
//!
//! # How
//!
//! - When an endpoint is made, the TCP sockets that appeared during `ucp_ep_create` are
//!   the endpoint's connections (UCX's tcp transport connects there). Their remote
//!   addresses (the peer's UCX listening sockets) are kept with the peer — only those
//!   whose port and IPv4 address both appear in the peer's worker address (UCX packs
//!   them there), and the bracket is held against the other UCX backends of this
//!   process ([`BRACKET`]), so a socket another thread opened meanwhile is not taken
//!   for the peer's.
//! - Before a failed peer's endpoint is closed (deadline passed, UCX reported it, or it is
//!   unloaded with requests in flight), every TCP socket of this process connected to one
//!   of those addresses is dissolved with `connect(AF_UNSPEC)`: Linux's `tcp_disconnect`
//!   sends a reset and purges the send queue at once. The fd stays UCX's; it closes it
//!   with the endpoint.
//!
//! # Limits
//!
//! - Only connections this process opened to the peer are aborted. Data the peer sends
//!   to us on connections it opened (READ replies) is not cut off here; UCX drops
//!   replies whose requests the close canceled.
//! - Linux only (`/proc`); elsewhere nothing is found and the close is UCX's alone.
//! - Cost: two scans of `/proc/self/fd` per endpoint creation and a `getpeername` per
//!   socket that appeared; one scan and a `getpeername` per socket once per aborted
//!   peer. Nothing on the transfer path.

use std::collections::HashSet;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

/// Inodes of the sockets this process holds, by fd.
fn socket_fds() -> Vec<(i32, u64)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in dir.flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let inode = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse().ok());
        if let Some(inode) = inode {
            out.push((fd, inode));
        }
    }
    out
}

/// Held across a bracket (socket scan, `ucp_ep_create`, socket scan) by every UCX
/// backend of the process.
pub(super) static BRACKET: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Whether `remote` can be one of the peer's UCX listening sockets: its port (network
/// order) and, for IPv4, its address bytes appear in the peer's worker address.
pub(super) fn in_worker_address(remote: &SocketAddr, address: &[u8]) -> bool {
    let contains = |needle: &[u8]| address.windows(needle.len()).any(|w| w == needle);
    let port_ok = contains(&remote.port().to_be_bytes());
    match remote {
        SocketAddr::V4(v4) => port_ok && contains(&v4.ip().octets()),
        SocketAddr::V6(v6) => port_ok && contains(&v6.ip().octets()),
    }
}

/// Socket inodes of this process (the "before" of a bracket).
pub(super) fn socket_inodes() -> HashSet<u64> {
    socket_fds().into_iter().map(|(_, inode)| inode).collect()
}

/// The remote address of `fd` if it is a connected TCP socket (`getpeername`).
fn tcp_peer(fd: i32) -> Option<SocketAddr> {
    let mut kind: libc::c_int = 0;
    let mut kind_len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int-sized option buffer with its length; a stale or non-socket fd only
    // makes the call fail.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&mut kind as *mut libc::c_int).cast(),
            &mut kind_len,
        )
    };
    if rc != 0 || kind != libc::SOCK_STREAM {
        return None;
    }
    // SAFETY: sockaddr_storage is plain data; zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: the storage is large enough for any address, passed with its size.
    let rc = unsafe {
        libc::getpeername(
            fd,
            (&mut storage as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return None;
    }
    match libc::c_int::from(storage.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let sin: libc::sockaddr_in =
                unsafe { std::ptr::read((&storage as *const libc::sockaddr_storage).cast()) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::new(ip.into(), u16::from_be(sin.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let sin6: libc::sockaddr_in6 =
                unsafe { std::ptr::read((&storage as *const libc::sockaddr_storage).cast()) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::new(ip.into(), u16::from_be(sin6.sin6_port)))
        }
        _ => None,
    }
    .filter(|remote| remote.port() != 0)
}

/// Remote addresses of the TCP connections that appeared since `before` (the peer's
/// listening sockets, when the bracket spans `ucp_ep_create`).
///
/// Asked of each new socket with `getpeername`. (Parsing `/proc/self/net/tcp`, as this
/// did before, lists every socket of the network namespace: on a busy host that took
/// tens of milliseconds, paid by the first request to every peer.)
pub(super) fn new_remotes(before: &HashSet<u64>) -> Vec<SocketAddr> {
    let mut remotes: Vec<SocketAddr> = socket_fds()
        .into_iter()
        .filter(|(_, inode)| !before.contains(inode))
        .filter_map(|(fd, _)| tcp_peer(fd))
        .collect();
    remotes.sort();
    remotes.dedup();
    remotes
}

/// Reset every TCP connection of this process to one of `remotes`, discarding what its
/// send queue holds. Returns how many were reset.
pub(super) fn abort_connections_to(remotes: &[SocketAddr]) -> usize {
    if remotes.is_empty() {
        return 0;
    }
    let mut reset = 0;
    for (fd, _) in socket_fds() {
        if !tcp_peer(fd).is_some_and(|remote| remotes.contains(&remote)) {
            continue;
        }
        // SAFETY: a zeroed sockaddr with family AF_UNSPEC, passed with its own size. The
        // fd is one of UCX's sockets of this backend (its inode is one of the peer's
        // connections); UCX closes fds only from calls made under the backend's lock,
        // which the caller holds, so the fd cannot be closed and reused meanwhile.
        let rc = unsafe {
            let mut sa: libc::sockaddr = std::mem::zeroed();
            sa.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
            libc::connect(
                fd,
                &sa,
                std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
            )
        };
        if rc == 0 {
            reset += 1;
        } else {
            log::debug!(
                "UCX: resetting socket fd {fd}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    reset
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::time::Duration;

    #[test]
    fn a_remote_is_the_peers_only_if_its_address_bytes_are_in_the_worker_address() {
        let remote: SocketAddr = "10.231.0.2:50115".parse().unwrap();
        let mut blob = vec![0u8; 40];
        blob[7..11].copy_from_slice(&[10, 231, 0, 2]);
        blob[20..22].copy_from_slice(&50115u16.to_be_bytes());
        assert!(in_worker_address(&remote, &blob));
        assert!(!in_worker_address(
            &"10.231.0.2:50116".parse().unwrap(),
            &blob
        ));
        assert!(!in_worker_address(
            &"10.231.0.3:50115".parse().unwrap(),
            &blob
        ));
    }

    #[test]
    fn only_connected_tcp_sockets_have_a_peer() {
        use std::os::fd::AsRawFd;
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert_eq!(
            tcp_peer(client.as_raw_fd()),
            Some(listener.local_addr().unwrap())
        );
        assert_eq!(
            tcp_peer(server.as_raw_fd()),
            Some(client.local_addr().unwrap())
        );
        assert_eq!(tcp_peer(listener.as_raw_fd()), None);
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        udp.connect(listener.local_addr().unwrap()).unwrap();
        assert_eq!(tcp_peer(udp.as_raw_fd()), None);
        assert_eq!(tcp_peer(-1), None);
        // IPv6 where the host has it.
        if let Ok(listener6) = TcpListener::bind("[::1]:0") {
            let client6 = TcpStream::connect(listener6.local_addr().unwrap()).unwrap();
            assert_eq!(
                tcp_peer(client6.as_raw_fd()),
                Some(listener6.local_addr().unwrap())
            );
        }
    }

    #[test]
    fn a_new_connection_is_found_and_reset_with_its_queue_dropped() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let before = socket_inodes();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        // Other tests of this crate may open sockets meanwhile: ours is among the new.
        let ours = listener.local_addr().unwrap();
        assert!(new_remotes(&before).contains(&ours));
        let remotes = vec![ours];
        let (mut server, _) = listener.accept().unwrap();
        client.write_all(b"before").unwrap();
        let mut got = [0u8; 6];
        server.read_exact(&mut got).unwrap();
        assert_eq!(abort_connections_to(&remotes), 1);
        // The server sees a reset, not an orderly end, and nothing after it.
        server
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut rest = Vec::new();
        let e = server.read_to_end(&mut rest).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
        assert!(rest.is_empty());
        // Writing on the dissolved socket fails; the fd is still ours to close.
        assert!(client.write_all(b"after").is_err());
    }
}
