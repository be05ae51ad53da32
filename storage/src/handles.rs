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
