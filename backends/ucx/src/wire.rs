//! The bytes this backend exchanges with peers, and their parsers: connection info
//! (the addresses of its UCP workers) and public region metadata (a framed packed rkey).
//!
//! Connection info layout: `b"FUCX"`, a format byte (1), a worker count byte (1..=255),
//! then per worker a little-endian `u32` length and that many address bytes. Peer bytes
//! are checked here once; nothing later trusts them further than "an opaque UCP
//! address".
//!
//! This module is plain byte handling: nothing in it loads or calls libucp, so fuzz
//! targets (`metadata/fuzz`, target `ucx_wire`) and property tests call it directly.

use ferry_backend_api::{Error, Result};

/// The first bytes of connection info.
pub const MAGIC: &[u8; 4] = b"FUCX";
/// The connection-info format this build writes and reads.
pub const FORMAT: u8 = 1;
/// The largest worker address accepted from a peer (UCP addresses are a few hundred
/// bytes; this leaves room for many transports).
pub const ADDRESS_LEN_MAX: usize = 64 * 1024;

/// Encode worker addresses as connection info.
///
/// # Panics
///
/// If `addresses` is empty or has more than 255 entries, or an address is empty or
/// longer than [`ADDRESS_LEN_MAX`]: the backend encodes only its own workers'
/// addresses, and such a list is a bug here, never peer input.
pub fn encode(addresses: &[Vec<u8>]) -> Vec<u8> {
    assert!(
        !addresses.is_empty() && addresses.len() <= usize::from(u8::MAX),
        "{} worker addresses (1..=255 fit the format)",
        addresses.len()
    );
    assert!(
        addresses
            .iter()
            .all(|a| !a.is_empty() && a.len() <= ADDRESS_LEN_MAX),
        "a worker address is empty or longer than {ADDRESS_LEN_MAX} bytes"
    );
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

/// Decode connection info into worker addresses, refusing anything malformed with
/// [`Error::InvalidMetadata`] naming what is wrong.
pub fn decode(bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
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

/// The first bytes of framed rkey metadata.
pub const RKEY_MAGIC: &[u8; 4] = b"FRK1";
/// Bytes before the packed rkey in framed rkey metadata (magic, length, checksum).
pub const RKEY_HEADER_LEN_BYTES: usize = 16;

/// Why public region metadata is not a framed rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RkeyFrameError {
    /// Shorter than the header, or not starting with [`RKEY_MAGIC`].
    MissingHeader,
    /// The header's length is 0 or differs from the bytes that follow it.
    LengthMismatch,
    /// The bytes do not hash to the header's checksum.
    ChecksumMismatch,
}

impl std::fmt::Display for RkeyFrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RkeyFrameError::MissingHeader => "not a Ferry UCX rkey (missing FRK1 header)",
            RkeyFrameError::LengthMismatch => "rkey length does not match its header",
            RkeyFrameError::ChecksumMismatch => "rkey checksum mismatch",
        })
    }
}

impl std::error::Error for RkeyFrameError {}

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
///
/// # Panics
///
/// If `rkey` is longer than `u32::MAX` bytes (UCX packs rkeys of a few hundred bytes).
pub fn frame_rkey(rkey: &[u8]) -> Vec<u8> {
    let len = u32::try_from(rkey.len()).expect("a packed rkey shorter than 4 GiB");
    let mut out = Vec::with_capacity(RKEY_HEADER_LEN_BYTES + rkey.len());
    out.extend_from_slice(RKEY_MAGIC);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&fnv1a64(rkey).to_le_bytes());
    out.extend_from_slice(rkey);
    out
}

/// The packed rkey inside public region metadata, or why the bytes are refused.
pub fn unframe_rkey(md: &[u8]) -> std::result::Result<&[u8], RkeyFrameError> {
    let Some((header, rkey)) = md.split_first_chunk::<RKEY_HEADER_LEN_BYTES>() else {
        return Err(RkeyFrameError::MissingHeader);
    };
    let (magic, rest) = header.split_at(4);
    let (len, hash) = rest.split_at(4);
    if magic != RKEY_MAGIC {
        return Err(RkeyFrameError::MissingHeader);
    }
    let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]) as usize;
    if len == 0 || rkey.len() != len {
        return Err(RkeyFrameError::LengthMismatch);
    }
    let mut hash_bytes = [0u8; 8];
    hash_bytes.copy_from_slice(hash);
    if fnv1a64(rkey) != u64::from_le_bytes(hash_bytes) {
        return Err(RkeyFrameError::ChecksumMismatch);
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
