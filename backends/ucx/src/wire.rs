//! The connection info this backend publishes: the addresses of its UCP workers.
//!
//! Layout: `b"FUCX"`, a format byte (1), a worker count byte (1..=255), then per worker
//! a little-endian `u32` length and that many address bytes. Peer bytes are checked
//! here once; nothing later trusts them further than "an opaque UCP address".

use ferry_backend_api::{Error, Result};

const MAGIC: &[u8; 4] = b"FUCX";
const FORMAT: u8 = 1;
/// The largest worker address accepted from a peer (UCP addresses are a few hundred
/// bytes; this leaves room for many transports).
const ADDRESS_LEN_MAX: usize = 64 * 1024;

/// Encode worker addresses as connection info.
pub(crate) fn encode(addresses: &[Vec<u8>]) -> Vec<u8> {
    debug_assert!(!addresses.is_empty() && addresses.len() <= usize::from(u8::MAX));
    let mut out = Vec::with_capacity(6 + addresses.iter().map(|a| 4 + a.len()).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.push(FORMAT);
    out.push(addresses.len() as u8);
    for address in addresses {
        out.extend_from_slice(&(address.len() as u32).to_le_bytes());
        out.extend_from_slice(address);
    }
    out
}

/// Decode connection info into worker addresses, refusing anything malformed.
pub(crate) fn decode(bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let bad = |why: &str| Error::InvalidMetadata {
        reason: format!("UCX connection info: {why}").into(),
    };
    if bytes.len() < 6 || &bytes[..4] != MAGIC {
        return Err(bad("missing FUCX header"));
    }
    if bytes[4] != FORMAT {
        return Err(bad(&format!("unknown format {}", bytes[4])));
    }
    let count = usize::from(bytes[5]);
    if count == 0 {
        return Err(bad("no worker address"));
    }
    let mut rest = &bytes[6..];
    let mut addresses = Vec::with_capacity(count);
    for index in 0..count {
        if rest.len() < 4 {
            return Err(bad(&format!("worker address #{index} truncated")));
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        rest = &rest[4..];
        if len == 0 || len > ADDRESS_LEN_MAX || len > rest.len() {
            return Err(bad(&format!(
                "worker address #{index} has length {len} ({} bytes left)",
                rest.len()
            )));
        }
        addresses.push(rest[..len].to_vec());
        rest = &rest[len..];
    }
    if !rest.is_empty() {
        return Err(bad(&format!("{} trailing bytes", rest.len())));
    }
    Ok(addresses)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let addrs = vec![vec![1u8, 2, 3], vec![9u8; 300]];
        assert_eq!(decode(&encode(&addrs)).unwrap(), addrs);
    }

    #[test]
    fn refuses_malformed_bytes() {
        let good = encode(&[vec![7u8; 10]]);
        assert!(decode(&good[..good.len() - 1]).is_err());
        assert!(decode(b"XUCX\x01\x01").is_err());
        assert!(decode(b"FUCX\x02\x01").is_err());
        assert!(decode(b"FUCX\x01\x00").is_err());
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(decode(&trailing).is_err());
        let mut huge = b"FUCX\x01\x01".to_vec();
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&huge).is_err());
        // Every prefix of a valid blob is refused, never panics.
        for cut in 0..good.len() {
            assert!(decode(&good[..cut]).is_err());
        }
    }
}

const RKEY_MAGIC: &[u8; 4] = b"FRK1";

fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// Frame a packed rkey as public region metadata: `b"FRK1"`, `u32` length, `u64` FNV-1a
/// of the rkey, the rkey. UCX does not validate packed rkeys (garbage can crash it),
/// so corrupt or foreign bytes are refused here first. (A deliberately forged but
/// well-framed rkey is still trusted: peers are trusted not to be malicious.)
pub(crate) fn frame_rkey(rkey: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(16 + rkey.len());
    out.extend_from_slice(RKEY_MAGIC);
    out.extend_from_slice(&(rkey.len() as u32).to_le_bytes());
    out.extend_from_slice(&fnv1a64(rkey).to_le_bytes());
    out.extend_from_slice(rkey);
    out
}

/// The packed rkey inside public region metadata, or why the bytes are refused.
pub(crate) fn unframe_rkey(md: &[u8]) -> std::result::Result<&[u8], &'static str> {
    if md.len() < 16 || &md[..4] != RKEY_MAGIC {
        return Err("not a Ferry UCX rkey (missing FRK1 header)");
    }
    let len = u32::from_le_bytes([md[4], md[5], md[6], md[7]]) as usize;
    let rkey = &md[16..];
    if len == 0 || rkey.len() != len {
        return Err("rkey length does not match its header");
    }
    let hash = u64::from_le_bytes(md[8..16].try_into().expect("8 bytes"));
    if fnv1a64(rkey) != hash {
        return Err("rkey checksum mismatch");
    }
    Ok(rkey)
}

#[cfg(test)]
mod rkey_tests {
    use super::*;

    #[test]
    fn rkey_frame_round_trip_and_refusals() {
        let rkey = vec![3u8; 40];
        let md = frame_rkey(&rkey);
        assert_eq!(unframe_rkey(&md).unwrap(), &rkey[..]);
        assert!(unframe_rkey(b"not an rkey").is_err());
        for cut in 0..md.len() {
            assert!(unframe_rkey(&md[..cut]).is_err());
        }
        let mut flipped = md.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert!(unframe_rkey(&flipped).is_err());
    }
}
