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
//! - Cost: two scans of `/proc/self/fd` per endpoint creation, one parse of
//!   `/proc/self/net/tcp{,6}` when a socket appeared; the same once per aborted peer.
//!   Nothing on the transfer path.

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

/// One row of `/proc/self/net/tcp{,6}`: remote address and inode.
struct TcpRow {
    remote: SocketAddr,
    inode: u64,
}

/// The TCP sockets of this network namespace that have a remote address.
fn tcp_rows() -> Vec<TcpRow> {
    let mut rows = Vec::new();
    for (path, v6) in [("/proc/self/net/tcp", false), ("/proc/self/net/tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(path) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local rem st queues timer retrnsmt uid timeout inode …
            if fields.len() < 10 {
                continue;
            }
            let (Some(remote), Ok(inode)) = (parse_addr(fields[2], v6), fields[9].parse()) else {
                continue;
            };
            if remote.port() != 0 {
                rows.push(TcpRow { remote, inode });
            }
        }
    }
    rows
}

/// `/proc/net/tcp`'s `HEXADDR:HEXPORT`: the address is the kernel's 32-bit words
/// printed in host order, the port in host order.
fn parse_addr(field: &str, v6: bool) -> Option<SocketAddr> {
    let (addr, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    if !v6 {
        let word = u32::from_str_radix(addr, 16).ok()?;
        let ip = Ipv4Addr::from(word.to_ne_bytes());
        return Some(SocketAddr::new(ip.into(), port));
    }
    if addr.len() != 32 {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (i, chunk) in bytes.chunks_mut(4).enumerate() {
        let word = u32::from_str_radix(&addr[i * 8..i * 8 + 8], 16).ok()?;
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    Some(SocketAddr::new(Ipv6Addr::from(bytes).into(), port))
}

/// Remote addresses of the TCP connections that appeared since `before` (the peer's
/// listening sockets, when the bracket spans `ucp_ep_create`).
pub(super) fn new_remotes(before: &HashSet<u64>) -> Vec<SocketAddr> {
    let new: HashSet<u64> = socket_fds()
        .into_iter()
        .map(|(_, inode)| inode)
        .filter(|inode| !before.contains(inode))
        .collect();
    if new.is_empty() {
        return Vec::new();
    }
    let mut remotes: Vec<SocketAddr> = tcp_rows()
        .into_iter()
        .filter(|row| new.contains(&row.inode))
        .map(|row| row.remote)
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
    let doomed: HashSet<u64> = tcp_rows()
        .into_iter()
        .filter(|row| remotes.contains(&row.remote))
        .map(|row| row.inode)
        .collect();
    if doomed.is_empty() {
        return 0;
    }
    let mut reset = 0;
    for (fd, inode) in socket_fds() {
        if !doomed.contains(&inode) {
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
    fn addresses_parse_as_the_kernel_prints_them() {
        assert_eq!(
            parse_addr("0100E70A:CE67", false),
            Some("10.231.0.1:52839".parse().unwrap())
        );
        assert_eq!(
            parse_addr("00000000000000000000000001000000:1F90", true),
            Some("[::1]:8080".parse().unwrap())
        );
        assert_eq!(parse_addr("zz:1", false), None);
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
