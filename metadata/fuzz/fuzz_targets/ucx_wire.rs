//! Feed arbitrary bytes to the UCX backend's wire parsers (`ferry_ucx::wire`): the
//! connection info (worker addresses), the framed rkey of public region metadata, and
//! the batched-WRITE messages and acks peers send each other.
//! No libucp is loaded. Any panic is a bug; so is an accepted input that does not
//! re-encode to the same bytes, or a parser that accepts what it should refuse.
#![no_main]

use ferry_ucx::wire::{self, ADDRESS_LEN_MAX, FORMAT, FORMAT_V1, MAGIC, RKEY_MAGIC};
use libfuzzer_sys::fuzz_target;

fn check_conn_info(bytes: &[u8]) {
    if let Ok(info) = wire::decode(bytes) {
        let addresses = &info.addresses;
        assert!(!addresses.is_empty() && addresses.len() <= 255);
        assert!(addresses
            .iter()
            .all(|a| !a.is_empty() && a.len() <= ADDRESS_LEN_MAX));
        let mut again = wire::encode(addresses, info.features);
        if info.format == FORMAT_V1 {
            assert_eq!(info.features, 0, "format 1 has no features");
            again.remove(5);
            again[4] = FORMAT_V1;
        }
        assert_eq!(again, bytes, "decode/encode round trip");
    }
}

fn check_rkey(bytes: &[u8]) {
    if let Ok(rkey) = wire::unframe_rkey(bytes) {
        assert!(!rkey.is_empty());
        assert_eq!(wire::frame_rkey(rkey), bytes, "unframe/frame round trip");
    }
}

fn check_batch(bytes: &[u8]) {
    if let Ok(batch) = wire::parse_batch_write(bytes) {
        let ranges: Vec<(u64, &[u8])> = batch.ranges().collect();
        assert_eq!(ranges.len(), batch.count as usize);
        assert!(ranges.iter().all(|(_, d)| !d.is_empty()));
        assert_eq!(wire::encode_batch_write(batch.cookie, &ranges), bytes);
    }
    if let Ok(read) = wire::parse_batch_read(bytes) {
        let ranges: Vec<(u64, u32)> = read.ranges().collect();
        assert!(ranges.iter().all(|&(_, len)| len > 0));
        assert!(read.data_bytes <= wire::BATCH_READ_DATA_MAX);
        assert_eq!(wire::encode_batch_read(read.cookie, &ranges), bytes);
    }
    if let Ok((_, _, data)) = wire::parse_read_reply(bytes) {
        assert_eq!(data.len() + wire::BATCH_ACK_LEN_BYTES, bytes.len());
    }
    if let Ok((cookie, status)) = wire::parse_ack(bytes) {
        if let Some(status) = wire::BatchStatus::from_wire(status) {
            assert_eq!(wire::encode_ack(cookie, status), bytes);
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check_conn_info(data);
    check_rkey(data);
    check_batch(data);
    // Also try the bytes behind valid headers, so the fuzzer need not find them: the
    // bytes after a format byte of either format (format 2: features, then the worker
    // count; format 1: the count), and an rkey frame whose length field is right (the
    // checksum is what must refuse it, unless the fuzzer forged it).
    for format in [FORMAT_V1, FORMAT] {
        let mut framed = Vec::with_capacity(5 + data.len());
        framed.extend_from_slice(MAGIC);
        framed.push(format);
        framed.extend_from_slice(data);
        check_conn_info(&framed);
    }
    if data.len() >= 8 {
        let (hash, rkey) = data.split_at(8);
        let mut framed = Vec::with_capacity(16 + rkey.len());
        framed.extend_from_slice(RKEY_MAGIC);
        framed.extend_from_slice(&(rkey.len() as u32).to_le_bytes());
        framed.extend_from_slice(hash);
        framed.extend_from_slice(rkey);
        check_rkey(&framed);
        // A correct frame of the same bytes is always accepted.
        if !rkey.is_empty() {
            assert_eq!(wire::unframe_rkey(&wire::frame_rkey(rkey)), Ok(rkey));
        }
    }
});
