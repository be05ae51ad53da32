//! The OBJ backend on `store=memory` (object_store's in-process store): the contract's
//! checks and a round trip with no server at all.

// The backend contract's register/post are `unsafe fn`s (raw DRAM addresses).
#![allow(unsafe_code)]

mod common;

use std::path::Path;
use std::time::Duration;

use common::{addr, object, pattern, transfer};
use ferry_backend_api::{
    effective_params, Backend, Desc, Endpoint, Error, MemKind, Op, Params, Post, Range,
};
use ferry_obj::{ObjBackend, NAME, PARAMS};

fn post(ranges: &[Range], op: Op) -> Post<'_> {
    Post {
        tag: 1,
        op,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::Object,
        ranges,
        notif: None,
    }
}

fn memory_backend(extra: &[(&str, &str)]) -> ObjBackend {
    let mut given = Params::new();
    given.insert("store".into(), "memory".into());
    for (k, v) in extra {
        given.insert((*k).into(), (*v).into());
    }
    ObjBackend::new(effective_params(NAME, PARAMS, &given).unwrap()).expect("memory backend")
}

#[test]
fn round_trip_in_memory() {
    let mut b = memory_backend(&[
        ("part_bytes", "4096"),
        ("multipart_threshold_bytes", "8192"),
    ]);
    let small = pattern(1000, 1);
    let large = pattern(50_000, 2); // multipart: 13 parts of 4 KiB
    let (s, l) = (
        object(&mut b, "a", 0, 0),
        object(&mut b, "memory://other/b", 0, 0),
    );
    let c = transfer(
        &mut b,
        Op::Write,
        &[(addr(&small), 0, 1000, s), (addr(&large), 0, 50_000, l)],
        Duration::from_secs(30),
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    let mut back = vec![0u8; 50_000];
    let c = transfer(
        &mut b,
        Op::Read,
        &[(back.as_mut_ptr() as u64, 0, 50_000, l)],
        Duration::from_secs(30),
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    assert!(back == large);
    let q = b
        .query(
            MemKind::Object,
            &[Desc::new(0, 0, 0)],
            &[Some(Path::new("a"))],
        )
        .unwrap();
    assert!(q[0].exists && q[0].size == 1000);
}

#[test]
fn bad_requests_are_refused_with_typed_errors() {
    let mut b = memory_backend(&[]);
    let t = object(&mut b, "k", 0, 0);
    let buf = vec![0u8; 64];
    let at = |remote_addr, remote_token| Range {
        local_addr: addr(&buf),
        remote_addr,
        len: 64,
        remote_token,
        ..Range::default()
    };
    // A WRITE replaces the whole object: offset 0 only, once per request.
    let e = b
        .validate(Endpoint::Local, &post(&[at(8, t)], Op::Write))
        .unwrap_err();
    assert!(
        matches!(e, Error::InvalidParam { .. }) && e.to_string().contains("offset 0"),
        "{e}"
    );
    let e = b
        .validate(Endpoint::Local, &post(&[at(0, t), at(0, t)], Op::Write))
        .unwrap_err();
    assert!(e.to_string().contains("once"), "{e}");
    // Unknown and stale tokens.
    let e = b
        .validate(Endpoint::Local, &post(&[at(0, 0xdead)], Op::Read))
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    // SAFETY: nothing is in flight.
    unsafe { b.deregister(MemKind::Object, t) }.unwrap();
    let e = b
        .validate(Endpoint::Local, &post(&[at(0, t)], Op::Read))
        .unwrap_err();
    assert!(matches!(e, Error::NotFound { .. }), "{e}");
    // SAFETY: as above.
    assert!(unsafe { b.deregister(MemKind::Object, t) }.is_err());
    // Secrets are masked in the parameters it shows.
    let b = memory_backend(&[("secret_key", "hunter2")]);
    assert_eq!(b.params()["secret_key"], "***");
    // Bad parameters name themselves.
    let mut given = Params::new();
    given.insert("part_bytes".into(), "lots".into());
    given.insert("bucket".into(), "x".into());
    let e = ObjBackend::new(effective_params(NAME, PARAMS, &given).unwrap())
        .err()
        .expect("bad part_bytes");
    assert!(e.to_string().contains("part_bytes"), "{e}");
}
