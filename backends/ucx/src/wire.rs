//! The bytes this backend exchanges with peers, and their parsers: connection info
//! (the addresses of its UCP workers) and public region metadata (a framed packed rkey).
//!
//! Connection info layout: `b"FUCX"`, a format byte (2), a features byte (bit 0,
//! [`FEATURE_BATCH_AM`]: this side handles batch messages; unknown bits are kept and
//! ignored), a worker count byte (1..=255), then per worker a little-endian `u32` length
//! and that many address bytes. Format 1 (no features byte) is still read, as a peer
//! without features: a build from before batching registered no handler for its
//! messages, and UCX drops messages of an unknown id, so batching to it would wait for
//! acks until `peer_timeout_ms`. Peer bytes are checked here once; nothing later trusts
//! them further than "an opaque UCP address".
//!
//! This module is plain byte handling: nothing in it loads or calls libucp, so fuzz
//! targets (`metadata/fuzz`, target `ucx_wire`) and property tests call it directly.

use ferry_backend_api::{Error, Result};

/// The first bytes of connection info.
pub const MAGIC: &[u8; 4] = b"FUCX";
/// The connection-info format this build writes (it also reads [`FORMAT_V1`]).
pub const FORMAT: u8 = 2;
/// The first format: no features byte.
pub const FORMAT_V1: u8 = 1;
/// Feature bit: the sender handles batch messages (`state/batch.rs`): WRITE data, READ
/// requests, their acks and replies.
pub const FEATURE_BATCH_AM: u8 = 1;
/// Feature bit: the sender receives [`BATCH_WRITE_ONE_AM_ID`] pieces sent by rendezvous
/// (checked, then received straight into the region).
pub const FEATURE_RNDV_PIECES: u8 = 2;

/// A peer's decoded connection info.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// Its UCP worker addresses (1..=255), opaque.
    pub addresses: Vec<Vec<u8>>,
    /// Its feature bits ([`FEATURE_BATCH_AM`]; 0 for format 1).
    pub features: u8,
    /// The format it came in ([`FORMAT`] or [`FORMAT_V1`]).
    pub format: u8,
}

impl ConnInfo {
    /// Whether the peer handles batch messages.
    pub fn batches(&self) -> bool {
        self.features & FEATURE_BATCH_AM != 0
    }

    /// Whether the peer receives WRITE pieces by rendezvous.
    pub fn rndv_pieces(&self) -> bool {
        self.features & FEATURE_RNDV_PIECES != 0
    }
}
/// The largest worker address accepted from a peer (UCP addresses are a few hundred
/// bytes; this leaves room for many transports).
pub const ADDRESS_LEN_MAX: usize = 64 * 1024;

/// Encode worker addresses and feature bits as connection info ([`FORMAT`]).
///
/// # Panics
///
/// If `addresses` is empty or has more than 255 entries, or an address is empty or
/// longer than [`ADDRESS_LEN_MAX`]: the backend encodes only its own workers'
/// addresses, and such a list is a bug here, never peer input.
pub fn encode(addresses: &[Vec<u8>], features: u8) -> Vec<u8> {
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
    let mut out = Vec::with_capacity(7 + addresses.iter().map(|a| 4 + a.len()).sum::<usize>());
    out.extend_from_slice(MAGIC);
    out.push(FORMAT);
    out.push(features);
    out.push(addresses.len() as u8);
    for address in addresses {
        out.extend_from_slice(&(address.len() as u32).to_le_bytes());
        out.extend_from_slice(address);
    }
    out
}

/// Decode connection info ([`FORMAT`] or [`FORMAT_V1`]), refusing anything malformed
/// with [`Error::InvalidMetadata`] naming what is wrong.
pub fn decode(bytes: &[u8]) -> Result<ConnInfo> {
    let bad = |why: &str| Error::InvalidMetadata {
        reason: format!("UCX connection info: {why}").into(),
    };
    if bytes.len() < 6 || &bytes[..4] != MAGIC {
        return Err(bad("missing FUCX header"));
    }
    let format = bytes[4];
    let (features, rest) = match format {
        FORMAT_V1 => (0, &bytes[5..]),
        FORMAT if bytes.len() >= 7 => (bytes[5], &bytes[6..]),
        FORMAT => return Err(bad("missing worker count")),
        other => return Err(bad(&format!("unknown format {other}"))),
    };
    let count = usize::from(rest[0]);
    if count == 0 {
        return Err(bad("no worker address"));
    }
    let mut rest = &rest[1..];
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
    Ok(ConnInfo {
        addresses,
        features,
        format,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let addrs = vec![vec![1u8, 2, 3], vec![9u8; 300]];
        let info = decode(&encode(&addrs, FEATURE_BATCH_AM | 0x80)).unwrap();
        assert_eq!(info.addresses, addrs);
        assert!(info.batches());
        assert_eq!((info.features, info.format), (0x81, FORMAT));
        assert!(!decode(&encode(&addrs, 0)).unwrap().batches());
    }

    #[test]
    fn reads_the_first_format_as_a_peer_without_batching() {
        let v1 = [&b"FUCX\x01\x01"[..], &3u32.to_le_bytes(), b"abc"].concat();
        let info = decode(&v1).unwrap();
        assert_eq!(info.addresses, vec![b"abc".to_vec()]);
        assert!(!info.batches());
        assert_eq!(info.format, FORMAT_V1);
    }

    #[test]
    fn refuses_malformed_bytes() {
        let good = encode(&[vec![7u8; 10]], FEATURE_BATCH_AM);
        assert!(decode(&good[..good.len() - 1]).is_err());
        assert!(decode(b"XUCX\x01\x01").is_err());
        assert!(decode(b"FUCX\x03\x01\x01").is_err());
        assert!(decode(b"FUCX\x02\x01").is_err());
        assert!(decode(b"FUCX\x01\x00").is_err());
        assert!(decode(b"FUCX\x02\x01\x00").is_err());
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

// ---------------------------------------------------------------------------------------
// Batched small transfers (active messages between two Ferry UCX backends).
//
// A WRITE batch message (AM id [`BATCH_WRITE_AM_ID`], so the id is the format version):
// a 16-byte header — `u64` cookie (the initiator's name for the message, echoed in the
// ack), `u32` range count (≥ 1), `u32` reserved (0) — then per range a 12-byte entry —
// `u64` target address, `u32` length (≥ 1) — followed at once by that many data bytes.
// The ack (AM id [`BATCH_ACK_AM_ID`]): `u64` cookie, `u32` status ([`BatchStatus`]),
// `u32` reserved (0).
//
// A READ batch request (AM id [`BATCH_READ_AM_ID`]): the same 16-byte header, then per
// range only its 12-byte entry (target address, length). The reply (AM id
// [`BATCH_READ_REPLY_AM_ID`]): an ack's 16 bytes, then — status written — the ranges'
// data in request order. Everything little-endian; every length is checked against the
// message before use.

/// Active-message id of a WRITE batch message (format 1).
pub const BATCH_WRITE_AM_ID: u32 = 0x4653;
/// Active-message id of the target's acknowledgement of a batch message (format 1).
pub const BATCH_ACK_AM_ID: u32 = 0x4654;
/// Active-message id of a READ batch request (format 1).
pub const BATCH_READ_AM_ID: u32 = 0x4655;
/// Active-message id of the target's reply to a READ batch request (format 1).
pub const BATCH_READ_REPLY_AM_ID: u32 = 0x4656;
/// Active-message id of a WRITE of one range (format 1): UCX's message header holds a
/// batch header (count 1) and the range's entry, the message itself is the range's data,
/// so the initiator sends it from the caller's memory. Acked as a batch message.
pub const BATCH_WRITE_ONE_AM_ID: u32 = 0x4657;
/// Active-message id of a ping (format 1): an 8-byte cookie, which the target answers
/// with an ack ([`BATCH_ACK_AM_ID`]) on its reply endpoint. A load sends one so that
/// the path back from the target is set up before the first request needs it.
pub const PING_AM_ID: u32 = 0x4658;
/// The cookie of a ping (no batch message has it: their index part is below
/// `am_batch_messages`).
pub const PING_COOKIE: u64 = u64::MAX;
/// Bytes of a [`BATCH_WRITE_ONE_AM_ID`] message's header.
pub const BATCH_WRITE_ONE_HEADER_LEN_BYTES: usize = BATCH_HEADER_LEN_BYTES + BATCH_ENTRY_LEN_BYTES;
/// Largest data a READ batch request may ask for in one reply.
pub const BATCH_READ_DATA_MAX: usize = 1 << 20;
/// Bytes of a batch message's header.
pub const BATCH_HEADER_LEN_BYTES: usize = 16;
/// Bytes of one range entry (before its data).
pub const BATCH_ENTRY_LEN_BYTES: usize = 12;
/// Bytes of an ack.
pub const BATCH_ACK_LEN_BYTES: usize = 16;

/// Why a batch message or ack is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchWireError {
    /// Shorter than its header.
    Truncated,
    /// A reserved field is not zero.
    Reserved,
    /// A count of zero ranges.
    Empty,
    /// Range entry `index` (or its data) runs past the end of the message.
    RangeTruncated {
        /// Index of the range.
        index: u32,
    },
    /// Range `index` has length zero.
    ZeroLength {
        /// Index of the range.
        index: u32,
    },
    /// Bytes left after the last range, or an ack of the wrong length.
    Trailing {
        /// How many.
        bytes: usize,
    },
}

impl std::fmt::Display for BatchWireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchWireError::Truncated => f.write_str("batch message shorter than its header"),
            BatchWireError::Reserved => f.write_str("batch message reserved field not zero"),
            BatchWireError::Empty => f.write_str("batch message with no range"),
            BatchWireError::RangeTruncated { index } => {
                write!(f, "batch range #{index} runs past the end of the message")
            }
            BatchWireError::ZeroLength { index } => write!(f, "batch range #{index} is empty"),
            BatchWireError::Trailing { bytes } => {
                write!(f, "{bytes} trailing bytes after the batch message")
            }
        }
    }
}

impl std::error::Error for BatchWireError {}

/// The outcome a target reports in an ack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchStatus {
    /// Every range was written.
    Written = 0,
    /// The message did not parse ([`BatchWireError`]); nothing was written.
    Malformed = 1,
    /// A range is not inside memory registered with the target's UCX backend; nothing
    /// was written.
    OutsideRegistered = 2,
    /// The target could not start receiving a rendezvous piece's data (UCX refused the
    /// receive); nothing was written.
    NotReceived = 3,
    /// The target had as many rendezvous receives in flight as it takes
    /// (`am_tcp_rndv_receives_max`); nothing was written.
    Busy = 4,
}

impl BatchStatus {
    /// The status for a wire value (an unknown value is `None`).
    pub fn from_wire(value: u32) -> Option<BatchStatus> {
        match value {
            0 => Some(BatchStatus::Written),
            1 => Some(BatchStatus::Malformed),
            2 => Some(BatchStatus::OutsideRegistered),
            3 => Some(BatchStatus::NotReceived),
            4 => Some(BatchStatus::Busy),
            _ => None,
        }
    }
}

fn le_u32(bytes: &[u8]) -> u32 {
    u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

fn le_u64(bytes: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(b)
}

/// The header of a batch message with `count` ranges.
pub fn batch_header(cookie: u64, count: u32) -> [u8; BATCH_HEADER_LEN_BYTES] {
    let mut h = [0u8; BATCH_HEADER_LEN_BYTES];
    h[..8].copy_from_slice(&cookie.to_le_bytes());
    h[8..12].copy_from_slice(&count.to_le_bytes());
    h
}

/// The entry that precedes `len` data bytes for target address `addr`.
pub fn batch_entry(addr: u64, len: u32) -> [u8; BATCH_ENTRY_LEN_BYTES] {
    let mut e = [0u8; BATCH_ENTRY_LEN_BYTES];
    e[..8].copy_from_slice(&addr.to_le_bytes());
    e[8..].copy_from_slice(&len.to_le_bytes());
    e
}

/// A whole WRITE batch message of `(target address, data)` ranges (tests, tools; the
/// backend packs into its pooled buffers with [`batch_header`] and [`batch_entry`]).
pub fn encode_batch_write(cookie: u64, ranges: &[(u64, &[u8])]) -> Vec<u8> {
    let body: usize = ranges
        .iter()
        .map(|(_, d)| BATCH_ENTRY_LEN_BYTES + d.len())
        .sum();
    let mut out = Vec::with_capacity(BATCH_HEADER_LEN_BYTES + body);
    out.extend_from_slice(&batch_header(cookie, ranges.len() as u32));
    for (addr, data) in ranges {
        out.extend_from_slice(&batch_entry(*addr, data.len() as u32));
        out.extend_from_slice(data);
    }
    out
}

/// A parsed WRITE batch message: every entry was checked against the message length.
#[derive(Clone, Copy, Debug)]
pub struct BatchWrite<'a> {
    /// The initiator's cookie.
    pub cookie: u64,
    /// Number of ranges.
    pub count: u32,
    body: &'a [u8],
}

impl<'a> BatchWrite<'a> {
    /// The ranges as (target address, data).
    pub fn ranges(&self) -> BatchRanges<'a> {
        BatchRanges {
            rest: self.body,
            left: self.count,
        }
    }
}

/// Iterator over the ranges of a parsed [`BatchWrite`].
#[derive(Clone, Debug)]
pub struct BatchRanges<'a> {
    rest: &'a [u8],
    left: u32,
}

impl<'a> Iterator for BatchRanges<'a> {
    type Item = (u64, &'a [u8]);

    fn next(&mut self) -> Option<(u64, &'a [u8])> {
        if self.left == 0 || self.rest.len() < BATCH_ENTRY_LEN_BYTES {
            return None;
        }
        let addr = le_u64(self.rest);
        let len = le_u32(&self.rest[8..]) as usize;
        let rest = &self.rest[BATCH_ENTRY_LEN_BYTES..];
        let (data, rest) = rest.split_at(len.min(rest.len()));
        self.rest = rest;
        self.left -= 1;
        Some((addr, data))
    }
}

/// Parse a WRITE batch message, checking every entry and length before anything uses it.
pub fn parse_batch_write(msg: &[u8]) -> Result<BatchWrite<'_>, BatchWireError> {
    if msg.len() < BATCH_HEADER_LEN_BYTES {
        return Err(BatchWireError::Truncated);
    }
    let cookie = le_u64(msg);
    let count = le_u32(&msg[8..]);
    if le_u32(&msg[12..]) != 0 {
        return Err(BatchWireError::Reserved);
    }
    if count == 0 {
        return Err(BatchWireError::Empty);
    }
    let body = &msg[BATCH_HEADER_LEN_BYTES..];
    let mut rest = body;
    for index in 0..count {
        if rest.len() < BATCH_ENTRY_LEN_BYTES {
            return Err(BatchWireError::RangeTruncated { index });
        }
        let len = le_u32(&rest[8..]) as usize;
        if len == 0 {
            return Err(BatchWireError::ZeroLength { index });
        }
        rest = &rest[BATCH_ENTRY_LEN_BYTES..];
        if len > rest.len() {
            return Err(BatchWireError::RangeTruncated { index });
        }
        rest = &rest[len..];
    }
    if !rest.is_empty() {
        return Err(BatchWireError::Trailing { bytes: rest.len() });
    }
    Ok(BatchWrite {
        cookie,
        count,
        body,
    })
}

/// Parse a [`BATCH_WRITE_ONE_AM_ID`] message from its header and data: `(cookie, target
/// address, data)`, the entry's length checked against the data.
pub fn parse_batch_write_one<'a>(
    header: &[u8],
    data: &'a [u8],
) -> Result<(u64, u64, &'a [u8]), BatchWireError> {
    let (cookie, addr, _) = parse_batch_write_one_header(header, data.len())?;
    Ok((cookie, addr, data))
}

/// Parse the header of a [`BATCH_WRITE_ONE_AM_ID`] message whose data is `data_len`
/// bytes (a rendezvous message's data is not here yet, only its length): `(cookie,
/// target address, length)`, the entry's length checked against `data_len`.
pub fn parse_batch_write_one_header(
    header: &[u8],
    data_len: usize,
) -> Result<(u64, u64, usize), BatchWireError> {
    if header.len() < BATCH_WRITE_ONE_HEADER_LEN_BYTES {
        return Err(BatchWireError::Truncated);
    }
    if header.len() > BATCH_WRITE_ONE_HEADER_LEN_BYTES {
        return Err(BatchWireError::Trailing {
            bytes: header.len() - BATCH_WRITE_ONE_HEADER_LEN_BYTES,
        });
    }
    let cookie = le_u64(header);
    let count = le_u32(&header[8..]);
    if le_u32(&header[12..]) != 0 {
        return Err(BatchWireError::Reserved);
    }
    match count {
        0 => return Err(BatchWireError::Empty),
        1 => {}
        // The header has room for one entry only.
        _ => return Err(BatchWireError::RangeTruncated { index: 1 }),
    }
    let entry = &header[BATCH_HEADER_LEN_BYTES..];
    let addr = le_u64(entry);
    let len = le_u32(&entry[8..]) as usize;
    if len == 0 {
        return Err(BatchWireError::ZeroLength { index: 0 });
    }
    match len.cmp(&data_len) {
        std::cmp::Ordering::Greater => Err(BatchWireError::RangeTruncated { index: 0 }),
        std::cmp::Ordering::Less => Err(BatchWireError::Trailing {
            bytes: data_len - len,
        }),
        std::cmp::Ordering::Equal => Ok((cookie, addr, len)),
    }
}

/// A whole READ batch request of `(target address, length)` ranges.
pub fn encode_batch_read(cookie: u64, ranges: &[(u64, u32)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(BATCH_HEADER_LEN_BYTES + ranges.len() * BATCH_ENTRY_LEN_BYTES);
    out.extend_from_slice(&batch_header(cookie, ranges.len() as u32));
    for &(addr, len) in ranges {
        out.extend_from_slice(&batch_entry(addr, len));
    }
    out
}

/// A parsed READ batch request: every entry checked, the data asked for at most
/// [`BATCH_READ_DATA_MAX`].
#[derive(Clone, Copy, Debug)]
pub struct BatchRead<'a> {
    /// The initiator's cookie.
    pub cookie: u64,
    /// Bytes asked for, all ranges together.
    pub data_bytes: usize,
    entries: &'a [u8],
}

impl<'a> BatchRead<'a> {
    /// The ranges as (target address, length).
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u32)> + 'a {
        self.entries
            .chunks_exact(BATCH_ENTRY_LEN_BYTES)
            .map(|e| (le_u64(e), le_u32(&e[8..])))
    }
}

/// Parse a READ batch request.
pub fn parse_batch_read(msg: &[u8]) -> Result<BatchRead<'_>, BatchWireError> {
    if msg.len() < BATCH_HEADER_LEN_BYTES {
        return Err(BatchWireError::Truncated);
    }
    let cookie = le_u64(msg);
    let count = le_u32(&msg[8..]) as usize;
    if le_u32(&msg[12..]) != 0 {
        return Err(BatchWireError::Reserved);
    }
    if count == 0 {
        return Err(BatchWireError::Empty);
    }
    let entries = &msg[BATCH_HEADER_LEN_BYTES..];
    let whole = entries.len() / BATCH_ENTRY_LEN_BYTES;
    if whole < count {
        return Err(BatchWireError::RangeTruncated {
            index: whole as u32,
        });
    }
    if entries.len() != count * BATCH_ENTRY_LEN_BYTES {
        return Err(BatchWireError::Trailing {
            bytes: entries.len() - count * BATCH_ENTRY_LEN_BYTES,
        });
    }
    let mut data_bytes = 0usize;
    for (index, e) in entries.chunks_exact(BATCH_ENTRY_LEN_BYTES).enumerate() {
        let len = le_u32(&e[8..]) as usize;
        if len == 0 {
            return Err(BatchWireError::ZeroLength {
                index: index as u32,
            });
        }
        data_bytes += len;
        if data_bytes > BATCH_READ_DATA_MAX {
            return Err(BatchWireError::RangeTruncated {
                index: index as u32,
            });
        }
    }
    Ok(BatchRead {
        cookie,
        data_bytes,
        entries,
    })
}

/// Parse a READ reply: (cookie, status as sent, data).
pub fn parse_read_reply(bytes: &[u8]) -> Result<(u64, u32, &[u8]), BatchWireError> {
    if bytes.len() < BATCH_ACK_LEN_BYTES {
        return Err(BatchWireError::Truncated);
    }
    let (head, data) = bytes.split_at(BATCH_ACK_LEN_BYTES);
    let (cookie, status) = parse_ack(head)?;
    Ok((cookie, status, data))
}

/// An ack of the message `cookie`.
pub fn encode_ack(cookie: u64, status: BatchStatus) -> [u8; BATCH_ACK_LEN_BYTES] {
    let mut a = [0u8; BATCH_ACK_LEN_BYTES];
    a[..8].copy_from_slice(&cookie.to_le_bytes());
    a[8..12].copy_from_slice(&(status as u32).to_le_bytes());
    a
}

/// Parse an ack: (cookie, status as sent; see [`BatchStatus::from_wire`]).
pub fn parse_ack(bytes: &[u8]) -> Result<(u64, u32), BatchWireError> {
    if bytes.len() < BATCH_ACK_LEN_BYTES {
        return Err(BatchWireError::Truncated);
    }
    if bytes.len() > BATCH_ACK_LEN_BYTES {
        return Err(BatchWireError::Trailing {
            bytes: bytes.len() - BATCH_ACK_LEN_BYTES,
        });
    }
    if le_u32(&bytes[12..]) != 0 {
        return Err(BatchWireError::Reserved);
    }
    Ok((le_u64(bytes), le_u32(&bytes[8..])))
}

#[cfg(test)]
mod batch_tests {
    use super::*;

    #[test]
    fn one_range_write_round_trip_and_refusals() {
        let data = [7u8; 40];
        let mut header = [0u8; BATCH_WRITE_ONE_HEADER_LEN_BYTES];
        header[..BATCH_HEADER_LEN_BYTES].copy_from_slice(&batch_header(0xfeed, 1));
        header[BATCH_HEADER_LEN_BYTES..].copy_from_slice(&batch_entry(0x4000, 40));
        assert_eq!(
            parse_batch_write_one(&header, &data),
            Ok((0xfeed, 0x4000, &data[..]))
        );
        // The data is the range: no more, no less.
        assert_eq!(
            parse_batch_write_one(&header, &data[..39]),
            Err(BatchWireError::RangeTruncated { index: 0 })
        );
        let longer = [7u8; 41];
        assert_eq!(
            parse_batch_write_one(&header, &longer),
            Err(BatchWireError::Trailing { bytes: 1 })
        );
        // A rendezvous message's header against the length UCX announces.
        assert_eq!(
            parse_batch_write_one_header(&header, 40),
            Ok((0xfeed, 0x4000, 40))
        );
        assert_eq!(
            parse_batch_write_one_header(&header, 41),
            Err(BatchWireError::Trailing { bytes: 1 })
        );
        assert_eq!(
            parse_batch_write_one_header(&header[..27], 40),
            Err(BatchWireError::Truncated)
        );
        // Every shorter header, and one longer, is refused.
        for cut in 0..header.len() {
            assert_eq!(
                parse_batch_write_one(&header[..cut], &data),
                Err(BatchWireError::Truncated),
                "cut at {cut}"
            );
        }
        let mut long = header.to_vec();
        long.push(0);
        assert_eq!(
            parse_batch_write_one(&long, &data),
            Err(BatchWireError::Trailing { bytes: 1 })
        );
        // Counts other than one, a reserved field, a zero length.
        for (count, want) in [
            (0, BatchWireError::Empty),
            (2, BatchWireError::RangeTruncated { index: 1 }),
        ] {
            let mut h = header;
            h[..BATCH_HEADER_LEN_BYTES].copy_from_slice(&batch_header(0xfeed, count));
            assert_eq!(parse_batch_write_one(&h, &data), Err(want));
        }
        let mut h = header;
        h[12] = 1;
        assert_eq!(
            parse_batch_write_one(&h, &data),
            Err(BatchWireError::Reserved)
        );
        let mut h = header;
        h[BATCH_HEADER_LEN_BYTES..].copy_from_slice(&batch_entry(0x4000, 0));
        assert_eq!(
            parse_batch_write_one(&h, &[]),
            Err(BatchWireError::ZeroLength { index: 0 })
        );
    }

    #[test]
    fn batch_round_trip_and_refusals() {
        let a = [1u8; 5];
        let b = [2u8; 70];
        let msg = encode_batch_write(0xabc, &[(0x1000, &a), (0x2000, &b)]);
        let parsed = parse_batch_write(&msg).unwrap();
        assert_eq!(parsed.cookie, 0xabc);
        let ranges: Vec<(u64, &[u8])> = parsed.ranges().collect();
        assert_eq!(ranges, vec![(0x1000, &a[..]), (0x2000, &b[..])]);
        for cut in 0..msg.len() {
            assert!(parse_batch_write(&msg[..cut]).is_err(), "prefix {cut}");
        }
        let mut trailing = msg.clone();
        trailing.push(0);
        assert_eq!(
            parse_batch_write(&trailing).unwrap_err(),
            BatchWireError::Trailing { bytes: 1 }
        );
        let mut huge = msg.clone();
        huge[16 + 8..16 + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            parse_batch_write(&huge).unwrap_err(),
            BatchWireError::RangeTruncated { index: 0 }
        );
        assert_eq!(
            parse_batch_write(&batch_header(1, 0)).unwrap_err(),
            BatchWireError::Empty
        );
        let read = encode_batch_read(5, &[(0x10, 3), (0x20, 9)]);
        let parsed = parse_batch_read(&read).unwrap();
        assert_eq!(parsed.data_bytes, 12);
        assert_eq!(
            parsed.ranges().collect::<Vec<_>>(),
            vec![(0x10, 3), (0x20, 9)]
        );
        for cut in 0..read.len() {
            assert!(parse_batch_read(&read[..cut]).is_err(), "prefix {cut}");
        }
        let greedy = encode_batch_read(5, &[(0, u32::MAX)]);
        assert!(parse_batch_read(&greedy).is_err());
        let mut reply = encode_ack(5, BatchStatus::Written).to_vec();
        reply.extend_from_slice(b"abc");
        assert_eq!(parse_read_reply(&reply).unwrap(), (5, 0, &b"abc"[..]));
        let ack = encode_ack(77, BatchStatus::OutsideRegistered);
        assert_eq!(parse_ack(&ack).unwrap(), (77, 2));
        assert!(parse_ack(&ack[..15]).is_err());
    }
}
