//! Wire encoding of PyTorch's c10d TCPStore protocol (torch >= 2.2), shared by the
//! client and the server. Integers are little-endian; keys and values are a u64 length
//! then raw bytes; requests have no frame header.

use std::io::{self, Read};

/// Opcodes of torch >= 2.2 (append-only).
#[allow(missing_docs)]
pub mod op {
    pub const VALIDATE: u8 = 0;
    pub const SET: u8 = 1;
    pub const COMPARE_SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const CHECK: u8 = 5;
    pub const WAIT: u8 = 6;
    pub const GETNUMKEYS: u8 = 7;
    pub const DELETE_KEY: u8 = 8;
    pub const APPEND: u8 = 9;
    pub const MULTI_GET: u8 = 10;
    pub const MULTI_SET: u8 = 11;
    pub const CANCEL_WAIT: u8 = 12;
    pub const PING: u8 = 13;
    pub const QUEUE_PUSH: u8 = 14;
    pub const QUEUE_POP: u8 = 15;
    pub const QUEUE_LEN: u8 = 16;
    pub const LIST_KEYS: u8 = 17;
    pub const BARRIER: u8 = 18;
}

/// The magic number that follows the VALIDATE opcode.
pub const VALIDATE_MAGIC: u32 = 0x3C85_F7CE;
/// CHECK reply: every key exists.
pub const READY: u8 = 0;
/// CHECK reply: some key is missing.
pub const NOT_READY: u8 = 1;
/// WAIT (and BARRIER) reply: the condition holds.
pub const STOP_WAITING: u8 = 0;
/// CANCEL_WAIT reply.
pub const WAIT_CANCELED: u8 = 1;

/// Append a length-prefixed byte string.
pub fn put_bytes(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    buf.extend_from_slice(bytes);
}

/// Append a u64.
pub fn put_u64(buf: &mut Vec<u8>, v: u64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// Append an i64.
pub fn put_i64(buf: &mut Vec<u8>, v: i64) {
    buf.extend_from_slice(&v.to_le_bytes());
}

/// Read one byte.
pub fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(b[0])
}

/// Read a u32.
pub fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Read a u64.
pub fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Read an i64.
pub fn read_i64(r: &mut impl Read) -> io::Result<i64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(i64::from_le_bytes(b))
}

/// Read a length-prefixed byte string of at most `max_len_bytes`; a longer one is an
/// `InvalidData` error (the stream cannot be resynchronized after it).
pub fn read_bytes(r: &mut impl Read, max_len_bytes: usize) -> io::Result<Vec<u8>> {
    let len = read_u64(r)?;
    if len > max_len_bytes as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("length {len} is over the limit of {max_len_bytes} bytes"),
        ));
    }
    // Read straight into the spare capacity: no zeroing pass over large values.
    let mut v = Vec::with_capacity(len as usize);
    r.take(len).read_to_end(&mut v)?;
    if v.len() as u64 != len {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "connection closed inside a value",
        ));
    }
    Ok(v)
}

/// Read a count of at most `max`.
pub fn read_count(r: &mut impl Read, max: usize) -> io::Result<usize> {
    let n = read_u64(r)?;
    if n > max as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("count {n} is over the limit of {max}"),
        ));
    }
    Ok(n as usize)
}
