//! Host buffers the tool registers.

use ferry::{Agent, Desc, MemKind, RegionId, Result};

/// A page-aligned-enough heap buffer that the tool reads only when no transfer into it
/// is in flight.
pub struct HostBuffer {
    bytes: Box<[u8]>,
}

impl HostBuffer {
    /// `len` bytes filled with a pattern derived from `seed`.
    pub fn pattern(len: usize, seed: u64) -> HostBuffer {
        let mut x = seed.max(1);
        let bytes = (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        HostBuffer { bytes }
    }
    /// `len` bytes, every page touched (so transfers don't measure page faults).
    pub fn zeroed(len: usize) -> HostBuffer {
        let mut bytes = vec![0u8; len].into_boxed_slice();
        for page in bytes.chunks_mut(4096) {
            page[0] = 0xA5;
        }
        HostBuffer { bytes }
    }
    /// Descriptor of `len` bytes at `offset`.
    pub fn desc(&self, offset: usize, len: usize) -> Desc {
        assert!(offset + len <= self.bytes.len());
        Desc::new(self.bytes.as_ptr() as u64 + offset as u64, len as u64, 0)
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
    /// Register the whole buffer with `agent`.
    pub fn register(&self, agent: &Agent) -> Result<RegionId> {
        // SAFETY: every HostBuffer outlives the agents of the command that made it
        // (they are declared after it and dropped first), and the tool reads it only
        // after the transfers touching it completed.
        unsafe { agent.register(MemKind::Dram, self.desc(0, self.bytes.len())) }
    }
}
