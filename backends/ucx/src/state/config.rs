//! UCX configuration Ferry applies on top of UCX's environment.

/// `ZCOPY_THRESH` Ferry sets on UCX >= 1.14 unless `UCX_ZCOPY_THRESH` is set.
///
/// With UCX's `auto`, the protocol selection of 1.23 (observed with the NIXL wheel's
/// build, `UCX_PROTO_INFO=y`) picks CMA zero-copy (`process_vm_writev`, one system call
/// that pins the target's pages) for puts and gets of every size between processes on
/// one host, ~1.7 µs per 64 B descriptor. With any explicit threshold it picks the
/// shared-memory software emulation below ~1.6 KiB and CMA above, which moves 64 B × 1024
/// shuffled ~9× faster and leaves 1 MiB ranges on CMA (see the README).
pub(crate) const ZCOPY_THRESH_NEW_UCX: &str = "16k";

/// `RNDV_THRESH` Ferry sets unless `UCX_RNDV_THRESH` is set.
///
/// Ferry chooses eager or rendezvous per message with a send flag (rendezvous only for
/// `am_tcp_rndv` WRITE pieces), so the threshold does not decide for its own messages.
/// What the setting changes is the protocol selection of
/// RMA on UCX >= 1.14 over TCP: with UCX's `auto`, `UCX_PROTO_INFO=y` (UCX 1.23, NIXL
/// wheel, `UCX_TLS=tcp`) shows `ucp_put*` and `ucp_get*` as "software emulation" (puts
/// carried by active messages, which for large sizes use rendezvous) over the whole
/// range; with `inf` it shows "zero-copy tcp/lo", the protocol NIXL gets (NIXL sets
/// `RNDV_THRESH=inf` itself). See the README for what it measured.
pub(crate) const RNDV_THRESH: &str = "inf";

/// Largest `am_tcp` WRITE piece sent by rendezvous with `am_tcp_rndv_piece_bytes=auto`:
/// 1 MiB from UCX 1.16 (its protocols v2 by default), 768 KiB before. Measured on
/// loopback tcp, 1 MiB × 1 WRITE, interleaved runs (README): on UCX 1.13.1 768 KiB and
/// 512 KiB pieces reached 6.7–7.0 GB/s and whole 1 MiB pieces 4.0–4.1 (eager pieces:
/// 4.2); on UCX 1.23.0 1 MiB pieces 5.4–7.1, 768 KiB 5.1–6.1 (eager: 3.4–4.1).
pub(super) fn rndv_piece_bytes_auto(version: ferry_ucx_sys::UcxVersion) -> u64 {
    let protocols_v2 = version
        >= (ferry_ucx_sys::UcxVersion {
            major: 1,
            minor: 16,
            release: 0,
        });
    if protocols_v2 {
        1 << 20
    } else {
        768 << 10
    }
}

/// The `RNDV_THRESH` override, if any (none when the user chose one).
pub(super) fn rndv_thresh_override() -> Option<String> {
    std::env::var_os("UCX_RNDV_THRESH")
        .is_none()
        .then(|| RNDV_THRESH.to_string())
}

/// Whether a `UCX_TLS` value may select a shared-memory (mm) transport: an exclusion
/// list (`^…`) may, an inclusion list must name one.
pub(super) fn may_use_shared_memory(tls: &str) -> bool {
    let tls = tls.trim();
    tls.starts_with('^')
        || tls.split(',').any(|t| {
            matches!(
                t.trim(),
                "all" | "sm" | "shm" | "mm" | "posix" | "sysv" | "xpmem"
            )
        })
}

/// The `ZCOPY_THRESH` override for this UCX version, if any.
pub(super) fn zcopy_thresh_override(version: ferry_ucx_sys::UcxVersion) -> Option<String> {
    let new_protocols = version
        >= (ferry_ucx_sys::UcxVersion {
            major: 1,
            minor: 14,
            release: 0,
        });
    (new_protocols && std::env::var_os("UCX_ZCOPY_THRESH").is_none())
        .then(|| ZCOPY_THRESH_NEW_UCX.to_string())
}

/// Whether a `UCX_TLS` value may select the tcp transport.
pub(super) fn may_use_tcp(tls: &str) -> bool {
    let tls = tls.trim();
    tls.starts_with('^') || tls.split(',').any(|t| matches!(t.trim(), "all" | "tcp"))
}

#[cfg(test)]
mod shm_tests {
    use super::{may_use_shared_memory, may_use_tcp};

    #[test]
    fn tcp_settings_follow_the_transport_list() {
        assert!(may_use_tcp("tcp"));
        assert!(may_use_tcp("sm,tcp,self"));
        assert!(may_use_tcp("^cma"));
        assert!(!may_use_tcp("sm,self"));
        assert!(!may_use_tcp("rc,ud"));
    }

    #[test]
    fn shared_memory_settings_follow_the_transport_list() {
        assert!(may_use_shared_memory("sm,self"));
        assert!(may_use_shared_memory("posix,tcp"));
        assert!(may_use_shared_memory("^cma"));
        assert!(may_use_shared_memory("all"));
        assert!(!may_use_shared_memory("tcp"));
        assert!(!may_use_shared_memory("tcp,self"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_ucx_sys::UcxVersion;

    fn version(major: u32, minor: u32) -> UcxVersion {
        UcxVersion {
            major,
            minor,
            release: 0,
        }
    }

    #[test]
    fn rendezvous_pieces_are_a_mebibyte_from_1_16() {
        assert_eq!(rndv_piece_bytes_auto(version(1, 13)), 768 << 10);
        assert_eq!(rndv_piece_bytes_auto(version(1, 15)), 768 << 10);
        assert_eq!(rndv_piece_bytes_auto(version(1, 16)), 1 << 20);
        assert_eq!(rndv_piece_bytes_auto(version(1, 23)), 1 << 20);
    }

    #[test]
    fn zcopy_thresh_is_left_alone_before_1_14() {
        assert_eq!(zcopy_thresh_override(version(1, 13)), None);
    }

    #[test]
    fn rndv_thresh_is_set_unless_the_user_chose_one() {
        let expected = std::env::var_os("UCX_RNDV_THRESH")
            .is_none()
            .then(|| RNDV_THRESH.to_string());
        assert_eq!(rndv_thresh_override(), expected);
    }

    #[test]
    fn zcopy_thresh_is_set_from_1_14_unless_the_user_chose_one() {
        let expected = std::env::var_os("UCX_ZCOPY_THRESH")
            .is_none()
            .then(|| ZCOPY_THRESH_NEW_UCX.to_string());
        assert_eq!(zcopy_thresh_override(version(1, 14)), expected);
        assert_eq!(zcopy_thresh_override(version(1, 23)), expected);
    }
}
