//! The OBJ backend against a real S3-protocol server (moto in server mode, started on
//! 127.0.0.1 by each test and killed after), and against a fault-injecting proxy in
//! front of it. Needs `FERRY_TEST_MOTO_SERVER` (tools/test.sh sets it); under CI=true
//! a missing server fails the tests.

// The backend contract's register/post are `unsafe fn`s (raw DRAM addresses).
#![allow(unsafe_code)]

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{addr, backend, object, pattern, transfer, Fault, FaultProxy, Moto};
use ferry_backend_api::{Backend, Desc, FailureKind, MemKind, Op, RegionSpec};

const LIMIT: Duration = Duration::from_secs(120);

fn failure_kind(c: ferry_backend_api::Completion) -> Option<FailureKind> {
    c.result.err().map(|f| f.kind)
}

#[test]
fn round_trip_byte_for_byte_and_query() {
    let Some(moto) = Moto::start() else { return };
    moto.create_bucket("round-trip");
    let mut b = backend(&moto.endpoint(), "round-trip", &[]);
    let data: Vec<Vec<u8>> = (0..4)
        .map(|i| pattern((1 << 20) + i * 4097, i as u64))
        .collect();
    let tokens: Vec<u64> = (0..4)
        .map(|i| object(&mut b, &format!("kv/block-{i}"), 0, 0))
        .collect();
    // One request WRITEs four objects.
    let ranges: Vec<_> = data
        .iter()
        .zip(&tokens)
        .map(|(d, &t)| (addr(d), 0, d.len() as u64, t))
        .collect();
    let c = transfer(&mut b, Op::Write, &ranges, LIMIT);
    assert_eq!(c.result, Ok(()), "{c:?}");
    // query: each exists with its size; a missing one does not.
    let descs = vec![Desc::new(0, 0, 0); 5];
    let names: Vec<String> = (0..5).map(|i| format!("kv/block-{i}")).collect();
    let paths: Vec<Option<&Path>> = names.iter().map(|n| Some(Path::new(n.as_str()))).collect();
    let q = b.query(MemKind::Object, &descs, &paths).expect("query");
    for (i, d) in data.iter().enumerate() {
        assert!(q[i].exists, "object {i} exists");
        assert_eq!(q[i].size, d.len() as u64);
    }
    assert!(!q[4].exists, "kv/block-4 was never written");
    // READ them back into fresh buffers.
    let mut back: Vec<Vec<u8>> = data.iter().map(|d| vec![0u8; d.len()]).collect();
    let ranges: Vec<_> = back
        .iter_mut()
        .zip(&tokens)
        .map(|(d, &t)| (d.as_mut_ptr() as u64, 0, d.len() as u64, t))
        .collect();
    let c = transfer(&mut b, Op::Read, &ranges, LIMIT);
    assert_eq!(c.result, Ok(()), "{c:?}");
    assert_eq!(back, data, "byte for byte");
}

#[test]
fn ranged_reads_and_objects_named_by_id() {
    let Some(moto) = Moto::start() else { return };
    moto.create_bucket("ranged");
    // Small parts: a 300 KiB READ becomes five ranged GETs side by side.
    let mut b = backend(&moto.endpoint(), "ranged", &[("part_bytes", "65536")]);
    let data = pattern(1 << 20, 11);
    // NIXL's form: an OBJECT region without a name is the object whose key is its id.
    // SAFETY: an OBJECT region names no memory.
    let by_id = unsafe {
        b.register(&RegionSpec {
            kind: MemKind::Object,
            desc: Desc::new(0, 0, 42),
            path: None,
        })
    }
    .expect("register by id")
    .token;
    assert_eq!(
        b.describe_target(MemKind::Object, by_id).as_deref(),
        Some("object s3://ranged/42")
    );
    let c = transfer(
        &mut b,
        Op::Write,
        &[(addr(&data), 0, data.len() as u64, by_id)],
        LIMIT,
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    let q = b
        .query(MemKind::Object, &[Desc::new(0, 0, 42)], &[None])
        .expect("query by id");
    assert!(q[0].exists && q[0].size == data.len() as u64, "{q:?}");
    // Ranges at odd offsets, one request, one of them 300 KiB long.
    let spans = [
        (0u64, 1u64),
        (4095, 4097),
        (123_456, 300 * 1024),
        ((1 << 20) - 10, 10),
    ];
    let mut back: Vec<Vec<u8>> = spans.iter().map(|&(_, n)| vec![0u8; n as usize]).collect();
    let ranges: Vec<_> = back
        .iter_mut()
        .zip(spans)
        .map(|(d, (off, n))| (d.as_mut_ptr() as u64, off, n, by_id))
        .collect();
    let c = transfer(&mut b, Op::Read, &ranges, LIMIT);
    assert_eq!(c.result, Ok(()), "{c:?}");
    for (d, (off, n)) in back.iter().zip(spans) {
        assert_eq!(
            &d[..],
            &data[off as usize..(off + n) as usize],
            "range at {off}"
        );
    }
    // A region that starts inside the object: offsets are the object's.
    let inner = object(&mut b, "s3://ranged/42", 1000, 2000);
    let mut part = vec![0u8; 500];
    let c = transfer(
        &mut b,
        Op::Read,
        &[(part.as_mut_ptr() as u64, 1500, 500, inner)],
        LIMIT,
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    assert_eq!(&part[..], &data[1500..2000]);
    // Past the region: refused before anything starts.
    let post_ranges = [ferry_backend_api::Range {
        local_addr: part.as_mut_ptr() as u64,
        remote_addr: 2900,
        len: 500,
        remote_token: inner,
        ..Default::default()
    }];
    let post = ferry_backend_api::Post {
        tag: 1,
        op: Op::Read,
        local_kind: MemKind::Dram,
        remote_kind: MemKind::Object,
        ranges: &post_ranges,
        notif: None,
    };
    let e = b
        .validate(ferry_backend_api::Endpoint::Local, &post)
        .expect_err("outside the region");
    assert!(e.to_string().contains("outside region"), "{e}");
    // Reading past the object's end: a short read.
    let mut tail = vec![0u8; 100];
    let c = transfer(
        &mut b,
        Op::Read,
        &[(tail.as_mut_ptr() as u64, (1 << 20) - 50, 100, by_id)],
        LIMIT,
    );
    assert_eq!(failure_kind(c), Some(FailureKind::ShortRead), "{c:?}");
}

#[test]
fn multipart_upload_round_trip() {
    let Some(moto) = Moto::start() else { return };
    moto.create_bucket("mpu");
    let mut b = backend(
        &moto.endpoint(),
        "mpu",
        &[
            ("part_bytes", "5242880"),
            ("multipart_threshold_bytes", "5242880"),
        ],
    );
    // Three parts of 5 MiB and a short last one.
    let mut data = pattern(15 * (1 << 20) + 12_345, 5);
    let t = object(&mut b, "big/weights.bin", 0, 0);
    let c = transfer(
        &mut b,
        Op::Write,
        &[(addr(&data), 0, data.len() as u64, t)],
        LIMIT,
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    // The PUT bodies are views of `data`, not copies: once the completion is out the
    // buffer is the caller's again, and scribbling on it must not reach the object.
    let sent = data.clone();
    data.fill(0xAA);
    let data = sent;
    let q = b
        .query(
            MemKind::Object,
            &[Desc::new(0, 0, 0)],
            &[Some(Path::new("big/weights.bin"))],
        )
        .expect("query");
    assert_eq!(q[0].size, data.len() as u64);
    let mut back = vec![0u8; data.len()];
    let c = transfer(
        &mut b,
        Op::Read,
        &[(back.as_mut_ptr() as u64, 0, back.len() as u64, t)],
        LIMIT,
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    assert!(back == data, "multipart object differs");
}

#[test]
fn missing_bucket_and_key_are_not_found() {
    let Some(moto) = Moto::start() else { return };
    moto.create_bucket("here");
    let mut b = backend(&moto.endpoint(), "here", &[]);
    let mut buf = vec![0u8; 4096];
    let missing_key = object(&mut b, "no/such/key", 0, 0);
    let c = transfer(
        &mut b,
        Op::Read,
        &[(buf.as_mut_ptr() as u64, 0, 4096, missing_key)],
        LIMIT,
    );
    assert_eq!(failure_kind(c), Some(FailureKind::NotFound), "{c:?}");
    assert_eq!(c.result.unwrap_err().range, Some(0));
    let missing_bucket = object(&mut b, "s3://not-a-bucket/key", 0, 0);
    assert_eq!(
        b.describe_target(MemKind::Object, missing_bucket)
            .as_deref(),
        Some("object s3://not-a-bucket/key")
    );
    let c = transfer(
        &mut b,
        Op::Write,
        &[(addr(&buf), 0, 4096, missing_bucket)],
        LIMIT,
    );
    assert_eq!(failure_kind(c), Some(FailureKind::NotFound), "{c:?}");
    let c = transfer(
        &mut b,
        Op::Read,
        &[(buf.as_mut_ptr() as u64, 0, 4096, missing_bucket)],
        LIMIT,
    );
    assert_eq!(failure_kind(c), Some(FailureKind::NotFound), "{c:?}");
}

#[test]
fn throttling_is_retried_then_reported() {
    // Every request answered 503 SlowDown: retried, then Throttled.
    let proxy = FaultProxy::start(Fault::Always(503, "SlowDown"), None);
    let mut b = backend(&proxy.endpoint(), "any", &[("retries", "3")]);
    let t = object(&mut b, "k", 0, 0);
    let data = pattern(1000, 1);
    let c = transfer(&mut b, Op::Write, &[(addr(&data), 0, 1000, t)], LIMIT);
    assert_eq!(failure_kind(c), Some(FailureKind::Throttled), "{c:?}");
    let seen = proxy.requests.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(seen, 4, "one attempt and three retries");
    // 429 too.
    let proxy = FaultProxy::start(Fault::Always(429, "SlowDown"), None);
    let mut b = backend(&proxy.endpoint(), "any", &[("retries", "1")]);
    let t = object(&mut b, "k", 0, 0);
    let mut buf = vec![0u8; 1000];
    let c = transfer(
        &mut b,
        Op::Read,
        &[(buf.as_mut_ptr() as u64, 0, 1000, t)],
        LIMIT,
    );
    assert_eq!(failure_kind(c), Some(FailureKind::Throttled), "{c:?}");
}

#[test]
fn server_errors_are_retried() {
    let Some(moto) = Moto::start() else { return };
    moto.create_bucket("flaky");
    // Two 500s, then the real server: the retries carry the transfer through.
    let proxy = FaultProxy::start(Fault::First(2, 500, "InternalError"), Some(moto.port));
    let mut b = backend(&proxy.endpoint(), "flaky", &[("retries", "3")]);
    let t = object(&mut b, "k", 0, 0);
    let data = pattern(100_000, 3);
    let c = transfer(
        &mut b,
        Op::Write,
        &[(addr(&data), 0, data.len() as u64, t)],
        LIMIT,
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    let mut back = vec![0u8; data.len()];
    let c = transfer(
        &mut b,
        Op::Read,
        &[(back.as_mut_ptr() as u64, 0, back.len() as u64, t)],
        LIMIT,
    );
    assert_eq!(c.result, Ok(()), "{c:?}");
    assert!(back == data);
    // 500 for good: a backend error once the retries ran out.
    let proxy = FaultProxy::start(Fault::Always(500, "InternalError"), None);
    let mut b = backend(&proxy.endpoint(), "flaky", &[("retries", "2")]);
    let t = object(&mut b, "k", 0, 0);
    let c = transfer(&mut b, Op::Write, &[(addr(&data), 0, 1000, t)], LIMIT);
    assert_eq!(failure_kind(c), Some(FailureKind::Backend), "{c:?}");
    assert_eq!(proxy.requests.load(std::sync::atomic::Ordering::SeqCst), 3);
}

#[test]
fn access_denied_is_typed() {
    let proxy = FaultProxy::start(Fault::Always(403, "AccessDenied"), None);
    let mut b = backend(&proxy.endpoint(), "locked", &[]);
    let t = object(&mut b, "secret", 0, 0);
    let mut buf = vec![0u8; 64];
    let c = transfer(
        &mut b,
        Op::Read,
        &[(buf.as_mut_ptr() as u64, 0, 64, t)],
        LIMIT,
    );
    assert_eq!(failure_kind(c), Some(FailureKind::Denied), "{c:?}");
    // Not retried.
    assert_eq!(proxy.requests.load(std::sync::atomic::Ordering::SeqCst), 1);
    let e = b
        .query(
            MemKind::Object,
            &[Desc::new(0, 0, 0)],
            &[Some(Path::new("secret"))],
        )
        .expect_err("query denied");
    assert!(e.to_string().contains("access denied"), "{e}");
}

#[test]
fn server_dying_mid_transfer_fails_the_request() {
    let Some(mut moto) = Moto::start() else {
        return;
    };
    moto.create_bucket("dies");
    let data = pattern(4 << 20, 9);
    {
        let mut b = backend(&moto.endpoint(), "dies", &[]);
        let t = object(&mut b, "k", 0, 0);
        let c = transfer(
            &mut b,
            Op::Write,
            &[(addr(&data), 0, data.len() as u64, t)],
            LIMIT,
        );
        assert_eq!(c.result, Ok(()), "{c:?}");
    }
    // The reply body stops after 256 KiB and the connection drops (every time).
    let proxy = FaultProxy::start(Fault::CutAfter(256 << 10), Some(moto.port));
    let mut b = backend(&proxy.endpoint(), "dies", &[("retries", "1")]);
    let t = object(&mut b, "k", 0, 0);
    let mut back = vec![0u8; data.len()];
    let started = Instant::now();
    let c = transfer(
        &mut b,
        Op::Read,
        &[(back.as_mut_ptr() as u64, 0, back.len() as u64, t)],
        LIMIT,
    );
    assert!(
        c.result.is_err(),
        "a cut reply must fail the request: {c:?}"
    );
    eprintln!("cut mid-body: {c:?} after {:?}", started.elapsed());
    // The server process killed while a READ runs (or, if the READ won the race, just
    // before the next one): a typed error, well before the deadline.
    let mut b = backend(
        &moto.endpoint(),
        "dies",
        &[
            ("retries", "1"),
            ("part_bytes", "65536"),
            ("max_in_flight", "1"),
        ],
    );
    let t = object(&mut b, "k", 0, 0);
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        moto.kill();
        moto
    });
    let c = transfer(
        &mut b,
        Op::Read,
        &[(back.as_mut_ptr() as u64, 0, back.len() as u64, t)],
        LIMIT,
    );
    let _moto = killer.join().expect("killer");
    let c = if c.result.is_ok() {
        eprintln!("the READ finished before the kill; reading from the dead server");
        transfer(
            &mut b,
            Op::Read,
            &[(back.as_mut_ptr() as u64, 0, back.len() as u64, t)],
            LIMIT,
        )
    } else {
        c
    };
    assert_eq!(failure_kind(c), Some(FailureKind::Backend), "{c:?}");
    // The backend drops cleanly with nothing in flight.
    drop(b);
}
