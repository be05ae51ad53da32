//! Registered regions: registration with backends, the section index, pins.
//!
//! The table itself is [`ferry_storage::RegionTable`]. Overlap at registration is one
//! lookup per section ([`SectionIndex::overlapping`]); a region named by a live request
//! is pinned (its `pins` count), so deregistration is refused in O(1) without scanning
//! requests.
//!
//! [`SectionIndex::overlapping`]: ferry_storage::SectionIndex::overlapping

use std::path::Path;

use ferry_backend_api::RegionSpec;
use ferry_storage::{
    BackendId, BackendMask, Desc, Error, MemKind, RegionId, RegionRow, Subject, MAX_BACKENDS,
};

use super::World;

impl World {
    /// Register one region with every backend in `hint` that supports `kind`; succeeds
    /// if at least one accepts. Overlap with a region of the same section is refused.
    // Reason: calls the backends' `unsafe fn register` (backend safety contract).
    #[allow(unsafe_code)]
    pub(crate) fn register_region(
        &mut self,
        kind: MemKind,
        desc: Desc,
        hint: BackendMask,
        path: Option<(&Path, ferry_backend_api::FileMode)>,
    ) -> Result<RegionId, Error> {
        let subject = || Subject::Descriptor {
            index: 0,
            addr: desc.addr,
            len: desc.len,
            dev: desc.dev,
        };
        // A FILE or OBJECT region of length 0 means "unbounded": index it up to the end of
        // the offset space.
        let indexed = if matches!(kind, MemKind::File | MemKind::Object) && desc.len == 0 {
            Desc::new(desc.addr, u64::MAX - desc.addr, desc.dev)
        } else {
            desc
        };
        if indexed.len == 0 {
            return Err(Error::invalid(subject(), "a region must not be empty"));
        }
        if indexed.end().is_none() {
            return Err(Error::invalid(subject(), "range wraps the address space"));
        }
        if self.regions.len() >= self.bounds.regions_max {
            return Err(Error::Capacity {
                what: "registered regions",
                limit: self.bounds.regions_max,
            });
        }
        let mut candidates = BackendMask::EMPTY;
        for slot in 0..MAX_BACKENDS {
            if hint.contains(slot) && self.backends.caps[slot].is_some_and(|c| c.supports(kind)) {
                candidates.insert(slot);
            }
        }
        if candidates.is_empty() {
            return Err(Error::NotSupported {
                backend: "agent".into(),
                what: format!("no backend (of those hinted) supports memory kind {kind}").into(),
            });
        }
        // Refuse overlap before any backend does work.
        for slot in candidates.iter() {
            if let Some(other) = self.sections[slot][kind as usize].overlapping(indexed) {
                return Err(Error::NotAllowed {
                    subject: subject(),
                    reason: format!("overlaps registered region {other:?}").into(),
                });
            }
        }
        let spec = RegionSpec { kind, desc, path };
        let mut tokens = [0u64; MAX_BACKENDS];
        let mut public = Vec::new();
        let mut accepted = BackendMask::EMPTY;
        let mut first_error = None;
        for slot in candidates.iter() {
            let backend = self.backends.backends[slot]
                .as_mut()
                .expect("candidate slot is filled");
            // SAFETY: the region comes from `CommandBuffer::register` (an `unsafe fn`),
            // whose caller promised that the memory (or fd) stays valid until it is
            // deregistered through this world, which calls `Backend::deregister` first.
            match unsafe { backend.register(&spec) } {
                Ok(reg) => {
                    tokens[slot] = reg.token;
                    public.push((slot as u8, reg.public_md));
                    accepted.insert(slot);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        if accepted.is_empty() {
            return Err(first_error.expect("at least one candidate failed"));
        }
        let Some(public_md) = self
            .region_md
            .push(public.iter().map(|(slot, bytes)| (*slot, bytes.as_slice())))
        else {
            // More than 4 GiB of public metadata for one region: undo the registrations.
            for slot in accepted.iter() {
                if let Some(backend) = self.backends.backends[slot].as_mut() {
                    // SAFETY: registered just above; no request can name it yet.
                    let _ = unsafe { backend.deregister(kind, tokens[slot]) };
                }
            }
            return Err(Error::invalid(
                subject(),
                "the backends' public metadata for this region exceeds 4 GiB",
            ));
        };
        let id = self.regions.insert(RegionRow {
            kinds: kind,
            descs: desc,
            backends: accepted,
            tokens,
            public_md,
            pins: 0,
        });
        for slot in accepted.iter() {
            self.sections[slot][kind as usize]
                .insert(indexed, id)
                .expect("overlap was checked before registering");
        }
        Ok(id)
    }

    /// Deregister a region from every backend that holds it, in two steps where a
    /// backend's peers may still reach it (issue 21): each backend first withdraws it
    /// ([`Backend::withdraw`](ferry_backend_api::Backend::withdraw)); if one answers that
    /// a peer may still be moving bytes, the region leaves the tables, the section index
    /// and the published metadata at once (nothing new can name it) but stays registered
    /// with the backends, and the call answers [`DeregStatus::Pending`]; calling again
    /// with the same handle asks the waiting backends again and completes the
    /// deregistration once they all answer yes. Refused while a live request (made,
    /// posted, done or draining, until released) names it.
    pub(crate) fn deregister_region(&mut self, id: RegionId) -> Result<DeregStatus, Error> {
        if let Some(i) = self.withdrawing.iter().position(|w| w.id == id) {
            return self.poll_withdrawal(i);
        }
        let row = self
            .regions
            .row(id)
            .ok_or_else(|| Error::not_found(Subject::Region(id)))?;
        let kind = self.regions.kinds[row];
        let desc = self.regions.descs[row];
        let tokens = self.regions.tokens[row];
        let backends = self.regions.backends[row];
        let pins = self.regions.pins[row];
        if pins > 0 {
            return Err(Error::NotAllowed {
                subject: Subject::Region(id),
                reason: format!(
                    "in use: {pins} pin(s) by live transfer requests (release them first; a draining one once its backend confirmed its end)"
                )
                .into(),
            });
        }
        let mut waiting = BackendMask::EMPTY;
        let mut first_error = None;
        for slot in backends.iter() {
            if let Some(backend) = self.backends.backends[slot].as_mut() {
                match backend.withdraw(kind, tokens[slot]) {
                    Ok(true) => {}
                    Ok(false) => waiting.insert(slot),
                    // It cannot fence: deregistered like the others, the error reported.
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                }
            }
        }
        let indexed = if matches!(kind, MemKind::File | MemKind::Object) && desc.len == 0 {
            Desc::new(desc.addr, u64::MAX - desc.addr, desc.dev)
        } else {
            desc
        };
        for slot in backends.iter() {
            self.sections[slot][kind as usize].remove(indexed, id);
        }
        let public_md = self.regions.public_md[row];
        self.regions.remove(id);
        if self.region_md.release(public_md) {
            self.region_md.compact(&mut self.regions.public_md);
        }
        self.deregistrations += 1;
        let gone = Withdrawing {
            id,
            kind,
            tokens,
            backends,
            waiting,
        };
        if !waiting.is_empty() {
            log::debug!(
                "agent '{}': region {id:?} withdrawn; its deregistration waits for peers that \
                 may still reach it",
                self.name
            );
            self.withdrawing.push(gone);
            return first_error.map_or(Ok(DeregStatus::Pending), Err);
        }
        let result = self.finish_deregistration(gone);
        match first_error {
            Some(e) => Err(e),
            None => result.map(|()| DeregStatus::Done),
        }
    }

    /// Ask the backends a withdrawn region waits for again; deregister it once none is
    /// left.
    fn poll_withdrawal(&mut self, i: usize) -> Result<DeregStatus, Error> {
        let w = &mut self.withdrawing[i];
        let mut still = BackendMask::EMPTY;
        for slot in w.waiting.iter() {
            if let Some(backend) = self.backends.backends[slot].as_mut() {
                if let Ok(false) = backend.withdraw(w.kind, w.tokens[slot]) {
                    still.insert(slot);
                }
            }
        }
        w.waiting = still;
        if !still.is_empty() {
            return Ok(DeregStatus::Pending);
        }
        let gone = self.withdrawing.swap_remove(i);
        self.finish_deregistration(gone).map(|()| DeregStatus::Done)
    }

    /// Deregister a region (already out of the tables) from its backends; free its
    /// memory if a backend allocated it.
    // Reason: calls the backends' `unsafe fn deregister` and `free` (backend safety
    // contract).
    #[allow(unsafe_code)]
    fn finish_deregistration(&mut self, gone: Withdrawing) -> Result<(), Error> {
        let mut first_error = None;
        for slot in gone.backends.iter() {
            if let Some(backend) = self.backends.backends[slot].as_mut() {
                // SAFETY: the pin count was zero when the region left the tables, and
                // with its handle gone no request can name it since: no post using its
                // token is outstanding in this backend.
                if let Err(e) = unsafe { backend.deregister(gone.kind, gone.tokens[slot]) } {
                    first_error.get_or_insert(e);
                }
            }
        }
        if let Some(at) = self.allocations.iter().position(|a| a.0 == gone.id) {
            let (_, slot, addr) = self.allocations.swap_remove(at);
            if let Some(backend) = self.backends.backends[slot].as_mut() {
                // SAFETY: the region was just deregistered from every backend that held
                // it (it is the whole allocation), and its handle is gone, so nothing
                // this world does reaches the bytes again.
                if let Err(e) = unsafe { backend.free(gone.kind, addr) } {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Allocate `len` bytes of `kind` memory through `backend`
    /// ([`Backend::alloc`](ferry_backend_api::Backend::alloc)) and register them with every
    /// backend that supports `kind` (the allocating one reuses its mapping). The memory is
    /// freed when the region is deregistered (or when the backend goes).
    // Reason: calls the backend's `unsafe fn free` (backend safety contract).
    #[allow(unsafe_code)]
    pub fn alloc_region(
        &mut self,
        backend: BackendId,
        kind: MemKind,
        len: u64,
    ) -> Result<(RegionId, Desc), Error> {
        let slot = self.backend_slot(backend)?;
        if self.regions.len() >= self.bounds.regions_max {
            return Err(Error::Capacity {
                what: "registered regions",
                limit: self.bounds.regions_max,
            });
        }
        let backend = self.backends.backends[slot]
            .as_mut()
            .expect("slot of a live id is filled");
        let allocation = backend.alloc(kind, len)?;
        let desc = Desc::new(allocation.addr, allocation.len, 0);
        // The backend owns the allocation and frees it only from `deregister_region`
        // (after every backend released it) or when it is dropped with the world.
        match self.register_region(kind, desc, BackendMask::ALL, None) {
            Ok(id) => {
                self.allocations.push((id, slot, allocation.addr));
                Ok((id, desc))
            }
            Err(e) => {
                let backend = self.backends.backends[slot]
                    .as_mut()
                    .expect("slot of a live id is filled");
                // SAFETY: no backend registered it (the registration failed as a whole).
                let _ = unsafe { backend.free(kind, allocation.addr) };
                Err(e)
            }
        }
    }
}

/// What a deregistration call found (see `World::deregister_region`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeregStatus {
    /// Deregistered: no backend touches the memory again.
    Done,
    /// Withdrawn (out of the tables and the published metadata), but a backend's peer
    /// may still be moving bytes into or out of it: keep the memory, call `deregister`
    /// again later.
    Pending,
}

/// A region that left the tables and waits for backends to confirm that no peer can
/// reach it any more.
#[derive(Debug)]
pub(crate) struct Withdrawing {
    pub(crate) id: RegionId,
    kind: MemKind,
    tokens: [u64; ferry_storage::MAX_BACKENDS],
    backends: BackendMask,
    /// Backends that have not confirmed yet.
    waiting: BackendMask,
}
