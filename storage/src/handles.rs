//! Typed generational handles. Each is a slotmap key: a slot index plus a generation,
//! so a handle whose object was removed is refused instead of reaching a new occupant.

slotmap::new_key_type! {
    /// A registered memory or file region of the local agent.
    pub struct RegionId;
    /// A prepared descriptor list (resolved once against sections, reusable by index).
    pub struct PrepId;
    /// A transfer request built from two prepared lists (or created in one shot).
    pub struct XferId;
    /// A remote agent whose metadata has been loaded.
    pub struct PeerId;
    /// A backend instance created on an agent.
    pub struct BackendId;
}

use slotmap::{Key, KeyData};

/// Bits of a handle's slot index that a table may use; the bits above them carry the
/// owning agent's [`AgentTag`]. A table therefore holds at most [`SLOTS_MAX`] rows.
pub const TAG_SHIFT: u32 = 22;
/// Most rows (live handles) one table of a tagged agent can hold.
pub const SLOTS_MAX: usize = 1 << TAG_SHIFT;
/// Largest tag: tags are 1..=TAG_MAX (0 is "untagged"; `TAG_MAX + 1` would make a full
/// table's last index collide with slotmap's null key).
pub const TAG_MAX: u16 = (1 << (32 - TAG_SHIFT)) - 2;

/// The identity of one live agent inside its handles. Every handle an agent's tables
/// hand out has the agent's tag XORed into the high bits of its slot index, and every
/// lookup XORs it out again. A handle of another live agent (another tag) comes out
/// with a slot index of at least [`SLOTS_MAX`], which no table of this agent has, so the
/// lookup fails (`NotFound`) instead of reaching this agent's object in the same slot.
/// Cost: one XOR per handle created or looked up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct AgentTag(u16);

impl AgentTag {
    /// No tag: handles are the slot map's own keys (tables outside an agent, tests).
    pub const NONE: AgentTag = AgentTag(0);

    /// Tag `n` (1..=[`TAG_MAX`]); `None` outside that range.
    pub fn new(n: u16) -> Option<AgentTag> {
        (1..=TAG_MAX).contains(&n).then_some(AgentTag(n))
    }

    /// The tag's number (0 for [`AgentTag::NONE`]).
    pub fn get(self) -> u16 {
        self.0
    }

    #[inline(always)]
    fn salt(self) -> u64 {
        u64::from(self.0) << TAG_SHIFT
    }

    /// The public handle of a slot map key (and back: the operation is its own inverse).
    #[inline(always)]
    pub fn stamp<K: Key + From<KeyData>>(self, key: K) -> K {
        K::from(KeyData::from_ffi(key.data().as_ffi() ^ self.salt()))
    }

    /// Whether `key` was stamped by this tag (or is a stale handle of it): its slot index
    /// lies below [`SLOTS_MAX`] once the tag is taken out. For error messages only; a
    /// lookup needs no separate check.
    pub fn owns<K: Key>(self, key: K) -> bool {
        ((key.data().as_ffi() ^ self.salt()) & 0xffff_ffff) < SLOTS_MAX as u64
    }
}
