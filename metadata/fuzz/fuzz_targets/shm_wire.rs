//! Feed arbitrary bytes to the SHM backend's wire parsers (`ferry_shm::wire`): the
//! connection info and the public region metadata. Any panic is a bug; so is an
//! accepted input that does not re-encode to the same bytes.
#![no_main]

use ferry_shm::wire::{ConnInfo, RegionMd, CONN_MAGIC, VERSION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = ConnInfo::parse(data) {
        assert_eq!(c.encode(), data, "connection info round trip");
    }
    if let Ok(r) = RegionMd::parse(data) {
        assert_eq!(r.encode(), data, "region metadata round trip");
    }
    // Behind a valid header too, so the fuzzer need not find it.
    let mut framed = Vec::with_capacity(5 + data.len());
    framed.extend_from_slice(CONN_MAGIC);
    framed.push(VERSION);
    framed.extend_from_slice(data);
    if let Ok(c) = ConnInfo::parse(&framed) {
        assert_eq!(c.encode(), framed, "connection info round trip");
    }
});
