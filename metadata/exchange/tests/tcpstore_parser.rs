//! The TCPStore server's request parser on a seed corpus (a valid request of every
//! opcode) plus thousands of mutated inputs: it never panics, never reserves more
//! than twice the bytes it was given, asks for more bytes only within the request
//! limit, and never asks a valid request's prefix for more than the request's length.

use ferry_exchange::tcpstore::proto::{
    self, op, parse_request, ParseError, Parsed, Request, RequestLimits,
};
use proptest::prelude::*;

const LIMITS: RequestLimits = RequestLimits {
    max_key_bytes: 64,
    max_value_bytes: 512,
    max_keys_per_request: 32,
    max_request_bytes: 4096,
};

fn keys(op: u8, keys: &[&[u8]]) -> Vec<u8> {
    let mut r = vec![op];
    proto::put_u64(&mut r, keys.len() as u64);
    for k in keys {
        proto::put_bytes(&mut r, k);
    }
    r
}

fn kv(op: u8, parts: &[&[u8]]) -> Vec<u8> {
    let mut r = vec![op];
    for p in parts {
        proto::put_bytes(&mut r, p);
    }
    r
}

/// A valid request of every opcode.
fn seeds() -> Vec<Vec<u8>> {
    let mut v = vec![
        {
            let mut r = vec![op::VALIDATE];
            r.extend_from_slice(&proto::VALIDATE_MAGIC.to_le_bytes());
            r
        },
        kv(op::SET, &[b"/k", b"value"]),
        kv(op::COMPARE_SET, &[b"/k", b"", b"desired"]),
        kv(op::GET, &[b"/k"]),
        {
            let mut r = kv(op::ADD, &[b"/n"]);
            proto::put_i64(&mut r, -3);
            r
        },
        keys(op::CHECK, &[b"/a", b"/b"]),
        keys(op::WAIT, &[b"/a", b"/b", b"/c"]),
        vec![op::GETNUMKEYS],
        kv(op::DELETE_KEY, &[b"/k"]),
        kv(op::APPEND, &[b"/k", b"more"]),
        keys(op::MULTI_GET, &[b"/a", b"/a"]),
        {
            let mut r = vec![op::MULTI_SET];
            proto::put_u64(&mut r, 2);
            for p in [&b"/a"[..], b"1", b"/b", b"2"] {
                proto::put_bytes(&mut r, p);
            }
            r
        },
        vec![op::CANCEL_WAIT],
        {
            let mut r = vec![op::PING];
            r.extend_from_slice(&42u32.to_le_bytes());
            r
        },
        kv(op::QUEUE_PUSH, &[b"/q", b"item"]),
        kv(op::QUEUE_POP, &[b"/q"]),
        kv(op::QUEUE_LEN, &[b"/q"]),
        vec![op::LIST_KEYS],
        {
            let mut r = kv(op::BARRIER, &[b"/b"]);
            proto::put_i64(&mut r, 4);
            r
        },
    ];
    // Two requests back to back.
    let two = [v[1].clone(), v[6].clone()].concat();
    v.push(two);
    v
}

fn reserved_bytes(r: &Request<'_>) -> usize {
    match r {
        Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
            keys.capacity() * std::mem::size_of::<&[u8]>()
        }
        Request::MultiSet { pairs } => pairs.capacity() * std::mem::size_of::<(&[u8], &[u8])>(),
        _ => 0,
    }
}

/// Parse `buf` as a stream of requests, checking every answer.
fn check_stream(buf: &[u8]) {
    let mut rest = buf;
    while !rest.is_empty() {
        match parse_request(rest, &LIMITS) {
            Ok(Parsed::Complete { request, len }) => {
                assert!(len > 0 && len <= rest.len() && len <= LIMITS.max_request_bytes);
                assert!(reserved_bytes(&request) <= 2 * len, "{request:?}");
                // Every prefix is incomplete, and asks for no more than the request.
                for cut in [0, 1, len / 2, len - 1] {
                    if cut < len && cut > 0 {
                        match parse_request(&rest[..cut], &LIMITS) {
                            Ok(Parsed::Incomplete { need }) => assert!(need > cut && need <= len),
                            other => panic!("prefix of {cut}/{len} bytes: {other:?}"),
                        }
                    }
                }
                rest = &rest[len..];
            }
            Ok(Parsed::Incomplete { need }) => {
                assert!(need > rest.len() && need <= LIMITS.max_request_bytes);
                return;
            }
            Err(ParseError::UnknownOpcode(op)) => {
                assert_eq!(op, rest[0]);
                return;
            }
            Err(ParseError::OverLimit { len, max, .. }) => {
                assert!(len > max as u64);
                return;
            }
        }
    }
}

#[test]
fn every_seed_parses_whole() {
    for seed in seeds() {
        let mut rest = &seed[..];
        while !rest.is_empty() {
            match parse_request(rest, &LIMITS) {
                Ok(Parsed::Complete { len, .. }) => rest = &rest[len..],
                other => panic!("seed {seed:?}: {other:?}"),
            }
        }
        check_stream(&seed);
    }
}

#[test]
fn huge_announced_sizes_reserve_nothing_and_are_refused() {
    for (op, what) in [
        (op::SET, "key"),
        (op::WAIT, "key count"),
        (op::MULTI_SET, "key count"),
    ] {
        let mut r = vec![op];
        proto::put_u64(&mut r, 1 << 60);
        match parse_request(&r, &LIMITS) {
            Err(ParseError::OverLimit { what: w, len, .. }) => {
                assert_eq!((w, len), (what, 1 << 60))
            }
            other => panic!("{other:?}"),
        }
    }
    // Under the count limit but far more than the bytes present: incomplete, and
    // nothing reserved for keys that did not arrive.
    let r = keys(op::WAIT, &[]);
    let mut r = r[..1].to_vec();
    proto::put_u64(&mut r, 32);
    assert_eq!(
        parse_request(&r, &LIMITS),
        Ok(Parsed::Incomplete { need: 9 + 32 * 8 })
    );
}

/// One mutation of a seed.
#[derive(Clone, Debug)]
enum Mutation {
    Flip {
        at: usize,
        bits: u8,
    },
    Set {
        at: usize,
        byte: u8,
    },
    Truncate {
        at: usize,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    /// Overwrite 8 bytes with a little-endian number (a length or count).
    Length {
        at: usize,
        value: u64,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(at, bits)| Mutation::Flip { at, bits }),
        (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..24)
        )
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        (
            any::<usize>(),
            prop_oneof![0u64..80, Just(u64::MAX), Just(1 << 60), 4000u64..5000]
        )
            .prop_map(|(at, value)| Mutation::Length { at, value }),
    ]
}

fn apply(mut buf: Vec<u8>, m: &Mutation) -> Vec<u8> {
    let n = buf.len().max(1);
    match m {
        Mutation::Flip { at, bits } => {
            if let Some(b) = buf.get_mut(at % n) {
                *b ^= bits;
            }
        }
        Mutation::Set { at, byte } => {
            if let Some(b) = buf.get_mut(at % n) {
                *b = *byte;
            }
        }
        Mutation::Truncate { at } => buf.truncate(at % n),
        Mutation::Insert { at, bytes } => {
            let at = at % (buf.len() + 1);
            buf.splice(at..at, bytes.iter().copied());
        }
        Mutation::Length { at, value } => {
            let at = at % n;
            let end = (at + 8).min(buf.len());
            let bytes = value.to_le_bytes();
            buf[at..end].copy_from_slice(&bytes[..end - at]);
        }
    }
    buf
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn mutated_requests_never_break_the_parser(
        seed in 0usize..20,
        mutations in proptest::collection::vec(mutation(), 1..6),
    ) {
        let seeds = seeds();
        let mut buf = seeds[seed % seeds.len()].clone();
        for m in &mutations {
            buf = apply(buf, m);
        }
        check_stream(&buf);
    }

    #[test]
    fn random_bytes_never_break_the_parser(buf in proptest::collection::vec(any::<u8>(), 0..256)) {
        check_stream(&buf);
    }
}
