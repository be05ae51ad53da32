//! The bytes SHM peers exchange: connection info and public region metadata. Plain byte
//! handling with typed errors; nothing here trusts a peer or touches memory.
//!
//! Connection info (little-endian):
//!
//! ```text
//! magic "FSHM" | version u8 = 1 | pid u32 | backend id u64
//! | inbox fd i32 | inbox nonce [16] | inbox base u64 | inbox len u64
//! | host identity len u16 | host identity bytes (UTF-8)
//! ```
//!
//! Region metadata (little-endian): a tag byte, then
//!
//! ```text
//! tag 0 (ordinary memory):  owner pid u32 | host hash u64
//! tag 1 (shareable memory): owner pid u32 | host hash u64 | fd i32 | nonce [16]
//!                           | segment base u64 | segment len u64
//! ```
//!
//! The host hash is a 64-bit FNV-1a hash of the host identity, so that a region's
//! metadata alone says which host it lives on (the connection info carries the full
//! identity).

use ferry_backend_api::Error;

/// Connection-info magic.
pub const CONN_MAGIC: &[u8; 4] = b"FSHM";
/// Wire version.
pub const VERSION: u8 = 1;
/// Longest host identity accepted.
pub const HOST_ID_MAX: usize = 1024;

/// A peer's connection info, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// The peer's process id.
    pub pid: u32,
    /// The peer backend's process-unique id.
    pub backend_id: u64,
    /// The fd number of the peer's notification inbox (in the peer's process).
    pub inbox_fd: i32,
    /// The inbox segment's nonce (its memfd name carries it).
    pub inbox_nonce: [u8; 16],
    /// The inbox's address in the peer's process (for the CMA probe).
    pub inbox_base: u64,
    /// The inbox's length in bytes.
    pub inbox_len: u64,
    /// The peer's host identity.
    pub host_id: String,
}

impl ConnInfo {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.host_id.len());
        out.extend_from_slice(CONN_MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.backend_id.to_le_bytes());
        out.extend_from_slice(&self.inbox_fd.to_le_bytes());
        out.extend_from_slice(&self.inbox_nonce);
        out.extend_from_slice(&self.inbox_base.to_le_bytes());
        out.extend_from_slice(&self.inbox_len.to_le_bytes());
        let host = self.host_id.as_bytes();
        let host = &host[..host.len().min(HOST_ID_MAX)];
        out.extend_from_slice(&(host.len() as u16).to_le_bytes());
        out.extend_from_slice(host);
        out
    }

    /// Parse a peer's bytes.
    pub fn parse(bytes: &[u8]) -> Result<ConnInfo, Error> {
        let mut r = Reader::new(bytes, "SHM connection info");
        if r.take(4)? != CONN_MAGIC {
            return Err(r.bad("bad magic"));
        }
        if r.u8()? != VERSION {
            return Err(r.bad("unknown version"));
        }
        let pid = r.u32()?;
        let backend_id = r.u64()?;
        let inbox_fd = r.i32()?;
        let inbox_nonce = r.nonce()?;
        let inbox_base = r.u64()?;
        let inbox_len = r.u64()?;
        let host_len = usize::from(r.u16()?);
        if host_len > HOST_ID_MAX {
            return Err(r.bad("host identity too long"));
        }
        let host_id = std::str::from_utf8(r.take(host_len)?)
            .map_err(|_| r.bad("host identity is not UTF-8"))?
            .to_string();
        r.end()?;
        if pid == 0 || inbox_fd < 0 {
            return Err(r.bad("pid 0 or negative fd"));
        }
        Ok(ConnInfo {
            pid,
            backend_id,
            inbox_fd,
            inbox_nonce,
            inbox_base,
            inbox_len,
            host_id,
        })
    }
}

/// Where a shareable region's segment lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentRef {
    /// The fd number in the owner's process.
    pub fd: i32,
    /// The segment's nonce (its memfd name carries it).
    pub nonce: [u8; 16],
    /// The segment's address in the owner's process.
    pub base: u64,
    /// The segment's length in bytes.
    pub len: u64,
}

/// A region's public metadata, parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionMd {
    /// The owner's process id.
    pub pid: u32,
    /// FNV-1a hash of the owner's host identity.
    pub host_hash: u64,
    /// The segment, for shareable memory; `None` for ordinary memory.
    pub segment: Option<SegmentRef>,
}

impl RegionMd {
    /// Encode.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(49);
        out.push(u8::from(self.segment.is_some()));
        out.extend_from_slice(&self.pid.to_le_bytes());
        out.extend_from_slice(&self.host_hash.to_le_bytes());
        if let Some(s) = &self.segment {
            out.extend_from_slice(&s.fd.to_le_bytes());
            out.extend_from_slice(&s.nonce);
            out.extend_from_slice(&s.base.to_le_bytes());
            out.extend_from_slice(&s.len.to_le_bytes());
        }
        out
    }

    /// Parse a peer's bytes.
    pub fn parse(bytes: &[u8]) -> Result<RegionMd, Error> {
        let mut r = Reader::new(bytes, "SHM region metadata");
        let tag = r.u8()?;
        let pid = r.u32()?;
        let host_hash = r.u64()?;
        let segment = match tag {
            0 => None,
            1 => {
                let fd = r.i32()?;
                let nonce = r.nonce()?;
                let base = r.u64()?;
                let len = r.u64()?;
                if fd < 0 || len == 0 || base.checked_add(len).is_none() {
                    return Err(r.bad("negative fd, empty or wrapping segment"));
                }
                Some(SegmentRef {
                    fd,
                    nonce,
                    base,
                    len,
                })
            }
            _ => return Err(r.bad("unknown region tag")),
        };
        r.end()?;
        Ok(RegionMd {
            pid,
            host_hash,
            segment,
        })
    }
}

/// FNV-1a, 64 bits.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Reader { bytes, at: 0, what }
    }
    fn bad(&self, why: &str) -> Error {
        Error::InvalidMetadata {
            reason: format!("{}: {why} (at byte {})", self.what, self.at).into(),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| self.bad("truncated"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], Error> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.array::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, Error> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32, Error> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn i32(&mut self) -> Result<i32, Error> {
        Ok(i32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, Error> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn nonce(&mut self) -> Result<[u8; 16], Error> {
        self.array()
    }
    fn end(&self) -> Result<(), Error> {
        if self.at == self.bytes.len() {
            Ok(())
        } else {
            Err(self.bad("trailing bytes"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> ConnInfo {
        ConnInfo {
            pid: 42,
            backend_id: 7,
            inbox_fd: 9,
            inbox_nonce: [3; 16],
            inbox_base: 0x7000_0000,
            inbox_len: 1 << 20,
            host_id: "boot/host/pid:[1]".into(),
        }
    }

    #[test]
    fn round_trips() {
        let c = conn();
        assert_eq!(ConnInfo::parse(&c.encode()).unwrap(), c);
        for segment in [
            None,
            Some(SegmentRef {
                fd: 5,
                nonce: [1; 16],
                base: 4096,
                len: 8192,
            }),
        ] {
            let r = RegionMd {
                pid: 1,
                host_hash: fnv1a(b"x"),
                segment,
            };
            assert_eq!(RegionMd::parse(&r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn every_truncation_and_flip_is_a_typed_error_or_a_value() {
        let bytes = conn().encode();
        for n in 0..bytes.len() {
            assert!(matches!(
                ConnInfo::parse(&bytes[..n]),
                Err(Error::InvalidMetadata { .. })
            ));
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(ConnInfo::parse(&longer).is_err());
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                let _ = ConnInfo::parse(&b);
            }
        }
        let region = RegionMd {
            pid: 1,
            host_hash: 2,
            segment: Some(SegmentRef {
                fd: 1,
                nonce: [0; 16],
                base: u64::MAX - 1,
                len: 1,
            }),
        }
        .encode();
        assert!(RegionMd::parse(&region).is_ok());
        let mut wrapping = region.clone();
        wrapping[41..49].copy_from_slice(&2u64.to_le_bytes());
        assert!(RegionMd::parse(&wrapping).is_err());
        for n in 0..region.len() {
            assert!(RegionMd::parse(&region[..n]).is_err());
        }
    }
}
