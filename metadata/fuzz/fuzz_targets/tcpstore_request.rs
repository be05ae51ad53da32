//! Feed arbitrary bytes to the TCPStore server's request parser, as a stream of
//! requests (the way a connection's buffer is parsed), under small and default-like
//! limits. Any panic is a bug; so is a complete request longer than its buffer or
//! over the request limit, an `Incomplete` that asks for no more bytes or for more
//! than the limit, a key list that reserved more than twice the bytes it came from,
//! or a request that parses differently once cut to its own length.
#![no_main]

use ferry_exchange::tcpstore::proto::{parse_request, Parsed, Request, RequestLimits};
use libfuzzer_sys::fuzz_target;

const LIMITS: [RequestLimits; 2] = [
    RequestLimits {
        max_key_bytes: 64,
        max_value_bytes: 256,
        max_keys_per_request: 16,
        max_request_bytes: 1024,
    },
    RequestLimits {
        max_key_bytes: 64 << 10,
        max_value_bytes: 64 << 20,
        max_keys_per_request: 131_072,
        max_request_bytes: 128 << 20,
    },
];

fn reserved_bytes(r: &Request<'_>) -> usize {
    match r {
        Request::Check { keys } | Request::Wait { keys } | Request::MultiGet { keys } => {
            keys.capacity() * std::mem::size_of::<&[u8]>()
        }
        Request::MultiSet { pairs } => pairs.capacity() * std::mem::size_of::<(&[u8], &[u8])>(),
        _ => 0,
    }
}

fuzz_target!(|data: &[u8]| {
    for limits in &LIMITS {
        let mut rest = data;
        while !rest.is_empty() {
            match parse_request(rest, limits) {
                Ok(Parsed::Complete { request, len }) => {
                    assert!(len > 0 && len <= rest.len() && len <= limits.max_request_bytes);
                    assert!(reserved_bytes(&request) <= 2 * len);
                    let again = parse_request(&rest[..len], limits);
                    assert_eq!(again, Ok(Parsed::Complete { request, len }));
                    rest = &rest[len..];
                }
                Ok(Parsed::Incomplete { need }) => {
                    assert!(need > rest.len() && need <= limits.max_request_bytes);
                    break;
                }
                Err(_) => break,
            }
        }
    }
});
