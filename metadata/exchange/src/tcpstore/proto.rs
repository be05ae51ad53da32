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

/// Limits the server's request parser enforces while parsing.
#[derive(Clone, Copy, Debug)]
pub struct RequestLimits {
    /// Longest key.
    pub max_key_bytes: usize,
    /// Longest value (also each of COMPARE_SET's two values).
    pub max_value_bytes: usize,
    /// Most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
    pub max_keys_per_request: usize,
    /// Longest request, opcode included.
    pub max_request_bytes: usize,
}

/// One request of a client, borrowing the bytes it was parsed from.
#[derive(Debug, PartialEq, Eq)]
#[allow(missing_docs)]
pub enum Request<'a> {
    Validate {
        magic: u32,
    },
    Set {
        key: &'a [u8],
        value: &'a [u8],
    },
    CompareSet {
        key: &'a [u8],
        expected: &'a [u8],
        desired: &'a [u8],
    },
    Get {
        key: &'a [u8],
    },
    Add {
        key: &'a [u8],
        delta: i64,
    },
    Check {
        keys: Vec<&'a [u8]>,
    },
    Wait {
        keys: Vec<&'a [u8]>,
    },
    GetNumKeys,
    DeleteKey {
        key: &'a [u8],
    },
    Append {
        key: &'a [u8],
        value: &'a [u8],
    },
    MultiGet {
        keys: Vec<&'a [u8]>,
    },
    MultiSet {
        pairs: Vec<(&'a [u8], &'a [u8])>,
    },
    CancelWait,
    Ping {
        nonce: u32,
    },
    QueuePush {
        key: &'a [u8],
        value: &'a [u8],
    },
    QueuePop {
        key: &'a [u8],
    },
    QueueLen {
        key: &'a [u8],
    },
    ListKeys,
    Barrier {
        key: &'a [u8],
        world: i64,
    },
}

/// What [`parse_request`] found at the start of a buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Parsed<'a> {
    /// A whole request, `len` bytes long.
    Complete {
        /// The request.
        request: Request<'a>,
        /// Its length in bytes, opcode included.
        len: usize,
    },
    /// The request is not whole yet: nothing can be decided before the buffer holds at
    /// least `need` bytes (`need` is above the buffer's length and within
    /// [`RequestLimits::max_request_bytes`]).
    Incomplete {
        /// The least buffer length worth parsing again.
        need: usize,
    },
}

/// Why bytes are not a request the server serves. The stream cannot be resynchronized
/// after any of these: the server closes the connection.
#[derive(Debug, PartialEq, Eq)]
pub enum ParseError {
    /// An opcode this protocol does not have.
    UnknownOpcode(u8),
    /// A length or count over a limit.
    OverLimit {
        /// What is too large: "key", "value", "key count", "request".
        what: &'static str,
        /// Its announced size.
        len: u64,
        /// The limit.
        max: usize,
    },
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ParseError::UnknownOpcode(op) => write!(f, "unknown opcode {op}"),
            ParseError::OverLimit { what, len, max } => {
                write!(f, "{what} of {len} is over the limit of {max}")
            }
        }
    }
}

/// Why a field could not be read: more bytes are needed, or the request is refused.
enum Stop {
    Need(usize),
    Refuse(ParseError),
}

impl Stop {
    /// `items` more items of at least `min_bytes` each follow the one that stopped: a
    /// buffer shorter than that is not worth parsing again.
    fn plus(self, items: usize, min_bytes: usize) -> Stop {
        match self {
            Stop::Need(n) => Stop::Need(n.saturating_add(items.saturating_mul(min_bytes))),
            refuse => refuse,
        }
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    limits: RequestLimits,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Stop> {
        let end = self.pos.checked_add(n).ok_or(Stop::Need(usize::MAX))?;
        if end > self.buf.len() {
            return Err(Stop::Need(end));
        }
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Stop> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, Stop> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, Stop> {
        self.array().map(u64::from_le_bytes)
    }
    fn i64(&mut self) -> Result<i64, Stop> {
        self.array().map(i64::from_le_bytes)
    }
    fn bytes(&mut self, max: usize, what: &'static str) -> Result<&'a [u8], Stop> {
        let len = self.u64()?;
        if len > max as u64 {
            return Err(Stop::Refuse(ParseError::OverLimit { what, len, max }));
        }
        self.take(len as usize)
    }
    fn key(&mut self) -> Result<&'a [u8], Stop> {
        self.bytes(self.limits.max_key_bytes, "key")
    }
    fn value(&mut self) -> Result<&'a [u8], Stop> {
        self.bytes(self.limits.max_value_bytes, "value")
    }
    /// A count of items each at least `min_item_bytes` long: the count is checked
    /// against the limit, and against the bytes present before anything is reserved.
    fn count(&mut self, min_item_bytes: usize) -> Result<usize, Stop> {
        let n = self.u64()?;
        let max = self.limits.max_keys_per_request;
        if n > max as u64 {
            return Err(Stop::Refuse(ParseError::OverLimit {
                what: "key count",
                len: n,
                max,
            }));
        }
        let n = n as usize;
        let least = self.pos.saturating_add(n.saturating_mul(min_item_bytes));
        if least > self.buf.len() {
            return Err(Stop::Need(least));
        }
        Ok(n)
    }
    fn keys(&mut self) -> Result<Vec<&'a [u8]>, Stop> {
        let n = self.count(8)?;
        // `count` saw at least 8 bytes per key in the buffer: the reservation is
        // bounded by twice the bytes that arrived.
        let mut keys = Vec::with_capacity(n);
        for i in 0..n {
            keys.push(self.key().map_err(|s| s.plus(n - i - 1, 8))?);
        }
        Ok(keys)
    }
}

/// Parse the request at the start of `buf` (a pure function: it reads nothing else and
/// reserves at most twice `buf.len()` bytes).
pub fn parse_request<'a>(buf: &'a [u8], limits: &RequestLimits) -> Result<Parsed<'a>, ParseError> {
    let mut c = Cursor {
        buf,
        pos: 0,
        limits: *limits,
    };
    let result = parse_fields(&mut c);
    let (outcome, len) = match result {
        Ok(request) => (
            Ok(Parsed::Complete {
                request,
                len: c.pos,
            }),
            c.pos,
        ),
        Err(Stop::Need(need)) => (Ok(Parsed::Incomplete { need }), need),
        Err(Stop::Refuse(e)) => return Err(e),
    };
    if len > limits.max_request_bytes {
        return Err(ParseError::OverLimit {
            what: "request",
            len: len as u64,
            max: limits.max_request_bytes,
        });
    }
    outcome
}

fn parse_fields<'a>(c: &mut Cursor<'a>) -> Result<Request<'a>, Stop> {
    let opcode = c.array::<1>()?[0];
    Ok(match opcode {
        op::VALIDATE => Request::Validate { magic: c.u32()? },
        op::SET => Request::Set {
            key: c.key()?,
            value: c.value()?,
        },
        op::COMPARE_SET => Request::CompareSet {
            key: c.key()?,
            expected: c.value()?,
            desired: c.value()?,
        },
        op::GET => Request::Get { key: c.key()? },
        op::ADD => Request::Add {
            key: c.key()?,
            delta: c.i64()?,
        },
        op::CHECK => Request::Check { keys: c.keys()? },
        op::WAIT => Request::Wait { keys: c.keys()? },
        op::GETNUMKEYS => Request::GetNumKeys,
        op::DELETE_KEY => Request::DeleteKey { key: c.key()? },
        op::APPEND => Request::Append {
            key: c.key()?,
            value: c.value()?,
        },
        op::MULTI_GET => Request::MultiGet { keys: c.keys()? },
        op::MULTI_SET => {
            let n = c.count(16)?;
            let mut pairs = Vec::with_capacity(n);
            for i in 0..n {
                let rest = |s: Stop| s.plus(n - i - 1, 16);
                pairs.push((c.key().map_err(rest)?, c.value().map_err(rest)?));
            }
            Request::MultiSet { pairs }
        }
        op::CANCEL_WAIT => Request::CancelWait,
        op::PING => Request::Ping { nonce: c.u32()? },
        op::QUEUE_PUSH => Request::QueuePush {
            key: c.key()?,
            value: c.value()?,
        },
        op::QUEUE_POP => Request::QueuePop { key: c.key()? },
        op::QUEUE_LEN => Request::QueueLen { key: c.key()? },
        op::LIST_KEYS => Request::ListKeys,
        op::BARRIER => Request::Barrier {
            key: c.key()?,
            world: c.i64()?,
        },
        other => return Err(Stop::Refuse(ParseError::UnknownOpcode(other))),
    })
}
