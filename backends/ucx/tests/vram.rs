//! VRAM in the UCX backend. Without a GPU (and with a UCX built without CUDA, like
//! Debian's): registration is refused with the reason, the factory reports VRAM
//! unavailable and why, a VRAM request never reaches UCX. With `FERRY_TEST_GPU=1` (and
//! `FERRY_UCX_LIBRARY` naming a CUDA-capable libucp, e.g. the libucx-cu13 wheel's):
//! VRAM → VRAM and VRAM ↔ DRAM between two backends, verified byte for byte.

// Reason: the tests call the backend's unsafe methods (through `TestCalls`).
#![allow(unsafe_code)]

#[allow(unused_imports)] // Rng is used only by the GPU tests.
mod common;

use common::*;
use ferry_backend_api::{BackendFactory, Desc, Error, MemKind, RegionSpec};
use ferry_ucx::UcxFactory;

/// Another UCX build named by `FERRY_UCX_LIBRARY` (e.g. the libucx-cu13 wheel's).
/// Two UCX builds cannot live in one process (the second resolves its dependencies to
/// the first's libraries), so with it set the tests never touch the system UCX.
fn other_ucx() -> Option<String> {
    std::env::var("FERRY_UCX_LIBRARY").ok()
}

/// The test environment of `common::setup`, without loading the system UCX.
fn setup_env() {
    std::env::set_var("UCX_NET_DEVICES", "lo");
    std::env::set_var("UCX_WARN_UNUSED_ENV_VARS", "n");
}

#[test]
fn vram_is_refused_with_the_reason_when_it_cannot_work() {
    if ferry_cuda::gpu_tests_requested() {
        eprintln!("skipping: a GPU run (FERRY_TEST_GPU=1) has CUDA; see the gpu tests");
        return;
    }
    match other_ucx() {
        Some(library) => {
            setup_env();
            eprintln!("UCX from {library}");
        }
        None => {
            if !setup() {
                return;
            }
            let why = UcxFactory
                .kind_available(MemKind::Vram)
                .expect_err("no GPU here");
            assert!(why.contains("CUDA") || why.contains("cuda"), "{why}");
        }
    }
    let mut backend = backend("vram-a", "", &[]);
    // A device address that is not mapped here: refused before UCX sees it, typed.
    let err = backend
        .register_t(&RegionSpec {
            kind: MemKind::Vram,
            desc: Desc::new(0x7f00_0000_0000, 1 << 20, 0),
            path: None,
        })
        .unwrap_err();
    assert!(matches!(err, Error::NotSupported { .. }), "{err}");
    assert!(err.to_string().contains("VRAM"), "{err}");
    eprintln!("VRAM refused as expected: {err}");
    // DRAM still works on the same backend.
    let buf = Buffer::new(4096);
    let (token, md) = register(&mut backend, &buf);
    assert!(!md.is_empty());
    // SAFETY: nothing in flight.
    unsafe { ferry_backend_api::Backend::deregister(&mut backend, MemKind::Dram, token) }.unwrap();
}

#[test]
fn factory_lists_vram_with_its_availability() {
    if other_ucx().is_some() {
        eprintln!("skipping: FERRY_UCX_LIBRARY is set, so the system UCX stays unloaded");
        return;
    }
    if !setup() {
        return;
    }
    assert!(UcxFactory.mem_kinds().contains(&MemKind::Vram));
    assert_eq!(UcxFactory.kind_available(MemKind::Dram), Ok(()));
    assert!(UcxFactory.kind_available(MemKind::File).is_err());
    // Asking twice gives the same answer (it is probed once).
    assert_eq!(
        UcxFactory.kind_available(MemKind::Vram),
        UcxFactory.kind_available(MemKind::Vram)
    );
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use ferry_backend_api::{Backend, Endpoint, Op, Post, Range};
    use ferry_cuda::{Device, DeviceBuffer};
    use std::time::Duration;

    fn requested() -> bool {
        if ferry_cuda::gpu_tests_requested() {
            return true;
        }
        eprintln!("skipping (VRAM over UCX): GPU tests run with FERRY_TEST_GPU=1");
        false
    }

    fn vram_region(buf: &DeviceBuffer) -> RegionSpec<'static> {
        RegionSpec {
            kind: MemKind::Vram,
            desc: Desc::new(buf.addr(), buf.len() as u64, buf.device().ordinal()),
            path: None,
        }
    }

    /// A → B in one process: VRAM→VRAM write, VRAM←VRAM read, DRAM→VRAM write,
    /// VRAM→DRAM read, 1 MiB × 8 ranges each, every byte checked.
    #[test]
    fn vram_moves_between_two_backends() {
        if !requested() {
            return;
        }
        assert!(
            other_ucx().is_some(),
            "FERRY_TEST_GPU=1: set FERRY_UCX_LIBRARY to a CUDA-capable libucp (libucx-cu13)"
        );
        setup_env();
        let dev = Device::open(0).expect("device 0");
        let len = 8usize << 20;
        let mut a = backend("vram-a", "", &[]);
        let mut b = backend("vram-b", "", &[]);
        let a_vram = DeviceBuffer::alloc(&dev, len).unwrap();
        let b_vram = DeviceBuffer::alloc(&dev, len).unwrap();
        let a_dram = Buffer::new(len);
        let a_v = a.register_t(&vram_region(&a_vram)).unwrap().token;
        let a_d = register(&mut a, &a_dram).0;
        let b_reg = b.register_t(&vram_region(&b_vram)).unwrap();
        let peer = peer_id(0);
        load(
            &mut a,
            peer,
            "vram-b",
            &b.conn_info().expect("conn info"),
            &[(b_reg.token, b_reg.public_md.clone())],
        );

        let ranges = |local_addr: u64, local_token: u64| -> Vec<Range> {
            (0..8u64)
                .map(|i| Range {
                    local_addr: local_addr + i * (1 << 20),
                    remote_addr: b_vram.addr() + (7 - i) * (1 << 20),
                    len: 1 << 20,
                    local_dev: 0,
                    remote_dev: 0,
                    local_token,
                    remote_token: b_reg.token,
                })
                .collect()
        };
        let mut go = |op, local_kind, r: &[Range], tag| {
            let post = Post {
                tag,
                op,
                local_kind,
                remote_kind: MemKind::Vram,
                ranges: r,
                notif: None,
            };
            let mut done = ferry_backend_api::Completions::with_capacity(4);
            a.post_t(Endpoint::Peer(peer), &[post], &mut done).unwrap();
            let got = wait_for(&mut [&mut a, &mut b], &[tag], Duration::from_secs(30));
            assert_eq!(got[0].result, Ok(()), "{op:?} {local_kind}");
        };
        let mut src = vec![0u8; len];
        Rng::new(11).fill(&mut src);
        a_vram.write(&src).unwrap();
        go(Op::Write, MemKind::Vram, &ranges(a_vram.addr(), a_v), 1);
        let mut back = vec![0u8; len];
        b_vram.read(&mut back).unwrap();
        for i in 0..8 {
            assert!(
                back[(7 - i) << 20..][..1 << 20] == src[i << 20..][..1 << 20],
                "VRAM→VRAM range {i}"
            );
        }
        a_vram.write(&vec![0u8; len]).unwrap();
        go(Op::Read, MemKind::Vram, &ranges(a_vram.addr(), a_v), 2);
        let mut again = vec![0u8; len];
        a_vram.read(&mut again).unwrap();
        assert!(again == src, "VRAM←VRAM read");
        go(Op::Read, MemKind::Dram, &ranges(a_dram.addr(), a_d), 3);
        assert!(a_dram.0 == src, "VRAM→DRAM read");
    }

    /// An initiator with host memory only (no VRAM of its own, so no device opened by a
    /// registration) writes to and reads from a peer's VRAM: a context must be current
    /// for UCX's CUDA transports all the same.
    #[test]
    fn a_host_only_initiator_moves_to_and_from_a_peers_vram() {
        if !requested() {
            return;
        }
        setup_env();
        let dev = Device::open(0).expect("device 0");
        let len = 4usize << 20;
        let mut a = backend("host-only-a", "", &[]);
        let mut b = backend("host-only-b", "", &[]);
        let b_vram = DeviceBuffer::alloc(&dev, len).unwrap();
        let mut a_dram = Buffer::new(len);
        let a_d = register(&mut a, &a_dram).0;
        let b_reg = b.register_t(&vram_region(&b_vram)).unwrap();
        let peer = peer_id(0);
        load(
            &mut a,
            peer,
            "host-only-b",
            &b.conn_info().expect("conn info"),
            &[(b_reg.token, b_reg.public_md.clone())],
        );
        let mut src = vec![0u8; len];
        Rng::new(21).fill(&mut src);
        a_dram.0.copy_from_slice(&src);
        for (tag, op) in [(1, Op::Write), (2, Op::Read)] {
            if op == Op::Read {
                a_dram.0.fill(0);
            }
            let range = [Range {
                local_addr: a_dram.addr(),
                remote_addr: b_vram.addr(),
                len: len as u64,
                local_dev: 0,
                remote_dev: 0,
                local_token: a_d,
                remote_token: b_reg.token,
            }];
            let post = Post {
                tag,
                op,
                local_kind: MemKind::Dram,
                remote_kind: MemKind::Vram,
                ranges: &range,
                notif: None,
            };
            let mut done = ferry_backend_api::Completions::with_capacity(4);
            a.post_t(Endpoint::Peer(peer), &[post], &mut done).unwrap();
            let got = wait_for(&mut [&mut a, &mut b], &[tag], Duration::from_secs(30));
            assert_eq!(got[0].result, Ok(()), "{op:?}");
        }
        let mut landed = vec![0u8; len];
        b_vram.read(&mut landed).unwrap();
        assert!(landed == src, "DRAM→VRAM write");
        assert!(a_dram.0 == src, "VRAM→DRAM read");
    }

    /// VMM memory (what PyTorch's expandable segments allocate): one physical
    /// allocation registers and moves; three mapped back to back are refused by
    /// default (UCX's cuda_ipc exports only the first) and, with vmm_spanning=allow,
    /// move between two backends of one process, every byte checked.
    #[test]
    fn vmm_memory_registers_and_moves() {
        if !requested() {
            return;
        }
        setup_env();
        let dev = Device::open(0).expect("device 0");
        let one = ferry_cuda::VmmBuffer::alloc(&dev, 4 << 20, 1).unwrap();
        let three = ferry_cuda::VmmBuffer::alloc(&dev, 2 << 20, 3).unwrap();
        let region = |addr: u64, len: usize| RegionSpec {
            kind: MemKind::Vram,
            desc: Desc::new(addr, len as u64, 0),
            path: None,
        };
        let mut strict = backend("vmm-strict", "", &[]);
        strict.register_t(&region(one.addr(), one.len())).unwrap();
        let refused = strict
            .register_t(&region(three.addr(), three.len()))
            .unwrap_err();
        assert!(refused.to_string().contains("VMM allocations"), "{refused}");
        let mut a = backend("vmm-a", "", &[("vmm_spanning", "allow")]);
        let mut b = backend("vmm-b", "", &[("vmm_spanning", "allow")]);
        let a_reg = a.register_t(&region(one.addr(), one.len())).unwrap().token;
        let b_reg = b.register_t(&region(three.addr(), three.len())).unwrap();
        let peer = peer_id(0);
        load(
            &mut a,
            peer,
            "vmm-b",
            &b.conn_info().expect("conn info"),
            &[(b_reg.token, b_reg.public_md.clone())],
        );
        let mut src = vec![0u8; one.len()];
        Rng::new(31).fill(&mut src);
        one.write(&src).unwrap();
        // 4 MiB from the middle of the first allocation into the third: crosses both
        // boundaries of the second.
        let at = three.addr() + (1 << 20);
        let range = [Range {
            local_addr: one.addr(),
            remote_addr: at,
            len: one.len() as u64,
            local_dev: 0,
            remote_dev: 0,
            local_token: a_reg,
            remote_token: b_reg.token,
        }];
        let post = Post {
            tag: 7,
            op: Op::Write,
            local_kind: MemKind::Vram,
            remote_kind: MemKind::Vram,
            ranges: &range,
            notif: None,
        };
        let mut done = ferry_backend_api::Completions::with_capacity(4);
        a.post_t(Endpoint::Peer(peer), &[post], &mut done).unwrap();
        let got = wait_for(&mut [&mut a, &mut b], &[7], Duration::from_secs(30));
        assert_eq!(got[0].result, Ok(()));
        let mut landed = vec![0u8; three.len()];
        three.read(&mut landed).unwrap();
        assert!(
            landed[1 << 20..][..one.len()] == src[..],
            "VMM write across allocations"
        );
    }
}

#[cfg(not(feature = "cuda"))]
#[test]
fn gpu_tests_need_the_cuda_feature() {
    assert!(
        !std::env::var("FERRY_TEST_GPU").is_ok_and(|v| v == "1"),
        "FERRY_TEST_GPU=1 but ferry-ucx was built without the `cuda` feature"
    );
    eprintln!("skipping (VRAM over UCX): built without the `cuda` feature");
}
