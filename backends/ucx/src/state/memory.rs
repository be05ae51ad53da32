//! Registered memory: `ucp_mem_map`, packed rkeys, generational tokens; and memory
//! allocated through UCX (`ucp_mem_map` with `UCP_MEM_MAP_ALLOCATE`), whose mapping a
//! registration inside it reuses.
//!
//! Why allocate through UCX: with the default `UCX_ALLOC_PRIO` (`md:sysv,md:posix,…`)
//! the memory is a shared-memory segment of UCX's `sysv` (or `posix`) memory domain,
//! and its packed rkey names that segment, so a same-host peer that unpacks the rkey
//! attaches the segment and UCX's put/get on the mm transport is one `memcpy` into (or
//! out of) that mapping. Memory UCX did not allocate is reached over CMA or, on UCX
//! 1.13, by emulating the put with active messages (two copies through the FIFO).

use super::*;

/// Longest allocation [`Core::alloc`] accepts (1 TiB): anything longer is a caller's
/// mistake rather than a buffer, and is refused before UCX is asked.
pub(crate) const ALLOC_LEN_MAX: u64 = 1 << 40;

/// Memory UCX allocated for this backend.
pub(super) struct AllocEntry {
    pub(super) memh: ucp_mem_h,
    pub(super) addr: u64,
    pub(super) len: u64,
    /// Registrations (entries of `Core::mems`) that reuse `memh`.
    pub(super) registrations: u32,
}

pub(super) struct MemEntry {
    /// The mapping: our own, or that of the allocation at `alloc_addr`.
    pub(super) memh: ucp_mem_h,
    /// The allocation whose mapping this registration reuses (not unmapped with it).
    pub(super) alloc_addr: Option<u64>,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) packed_rkey: Vec<u8>,
    /// Rkey unpacked on the self endpoint, for local transfers.
    pub(super) self_rkey: ucp_rkey_h,
    /// In the region index peers' batch messages are checked against (`batch.rs`): host
    /// memory, until withdrawn.
    pub(super) indexed: bool,
}

impl Core {
    pub(crate) fn register(&mut self, addr: u64, len: u64) -> Result<(u64, Vec<u8>)> {
        let inside = self
            .allocs
            .iter()
            .position(|a| addr >= a.addr && addr.saturating_add(len) <= a.addr + a.len);
        match inside {
            Some(index) => {
                let alloc = &self.allocs[index];
                let (memh, alloc_addr) = (alloc.memh, alloc.addr);
                let registered = self.add_mem_entry(memh, Some(alloc_addr), addr, len, true)?;
                self.allocs[index].registrations += 1;
                Ok(registered)
            }
            None => self.register_typed(addr, len, None),
        }
    }

    /// Allocate `len` bytes of DRAM through UCX (see the module docs).
    pub(crate) fn alloc(&mut self, len: u64) -> Result<ferry_backend_api::Allocation> {
        if len == 0 || len > ALLOC_LEN_MAX {
            return Err(Error::invalid(
                Subject::Named(format!("UCX allocation of {len} bytes").into()),
                format!("length must be 1..={ALLOC_LEN_MAX} bytes"),
            ));
        }
        let api = self.ucp.api();
        // SAFETY: plain C struct, zero = no fields.
        let mut params: ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask = u64::from(
            UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        );
        params.address = ptr::null_mut();
        params.length = len as usize;
        params.flags = u64::from(UCP_MEM_MAP_ALLOCATE) as _;
        let mut memh: ucp_mem_h = ptr::null_mut();
        // SAFETY: NULL address with ALLOCATE: UCX allocates and owns the memory; the
        // context is live; memh is an out-pointer.
        let status = unsafe { api.ucp_mem_map(self.context, &params, &mut memh) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_mem_map(ALLOCATE)", status));
        }
        // SAFETY: plain C struct, zero = no fields.
        let mut attr: ucp_mem_attr_t = unsafe { std::mem::zeroed() };
        attr.field_mask = u64::from(UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH);
        // SAFETY: memh was just mapped; attr is valid for writing.
        let status = unsafe { api.ucp_mem_query(memh, &mut attr) };
        if !status.is_ok() || attr.address.is_null() || (attr.length as u64) < len {
            // SAFETY: undo the allocation made above; nothing else knows it.
            unsafe { api.ucp_mem_unmap(self.context, memh) };
            return Err(if status.is_ok() {
                Error::Backend {
                    backend: BACKEND.into(),
                    errno: libc::ENOMEM,
                    desc: None,
                    detail: format!(
                        "ucp_mem_map(ALLOCATE) of {len} bytes returned {} bytes at {:p}",
                        attr.length, attr.address
                    )
                    .into(),
                }
            } else {
                ucx_error(&self.ucp, "ucp_mem_query", status)
            });
        }
        let addr = attr.address as u64;
        self.allocs.push(AllocEntry {
            memh,
            addr,
            len,
            registrations: 0,
        });
        Ok(ferry_backend_api::Allocation { addr, len })
    }

    /// Free the allocation at `addr` (refused while a registration reuses it).
    pub(crate) fn free(&mut self, addr: u64) -> Result<()> {
        let subject = || Subject::Named(format!("UCX allocation at {addr:#x}").into());
        let index = self
            .allocs
            .iter()
            .position(|a| a.addr == addr)
            .ok_or_else(|| Error::not_found(subject()))?;
        let registrations = self.allocs[index].registrations;
        if registrations > 0 {
            return Err(Error::NotAllowed {
                subject: subject(),
                reason: format!("{registrations} UCX registration(s) still use it").into(),
            });
        }
        let alloc = self.allocs.swap_remove(index);
        // SAFETY: our own allocation; no registration uses its memh any more and the
        // caller promised nothing touches its bytes (Backend::free).
        let status = unsafe { self.ucp.api().ucp_mem_unmap(self.context, alloc.memh) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_mem_unmap", status));
        }
        Ok(())
    }

    /// Allocations alive (memory UCX allocated for this backend and not freed).
    pub(crate) fn allocations(&self) -> usize {
        self.allocs.len()
    }

    /// Map a region, declaring its memory type when given (VRAM: `vram.rs`).
    pub(super) fn register_typed(
        &mut self,
        addr: u64,
        len: u64,
        memory_type: Option<ucs_memory_type_t>,
    ) -> Result<(u64, Vec<u8>)> {
        let api = self.ucp.api();
        // SAFETY: plain C struct, zero = no fields.
        let mut params: ucp_mem_map_params_t = unsafe { std::mem::zeroed() };
        params.field_mask =
            u64::from(UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH);
        params.address = addr as *mut c_void;
        params.length = len as usize;
        if let Some(memory_type) = memory_type {
            params.field_mask |= u64::from(UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE);
            params.memory_type = memory_type;
        }
        let mut memh: ucp_mem_h = ptr::null_mut();
        // SAFETY: the caller owns the range (BackendApi contract: it stays valid until
        // deregistered); UCX only pins/registers it.
        let status = unsafe { api.ucp_mem_map(self.context, &params, &mut memh) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_mem_map", status));
        }
        let registered = self.add_mem_entry(memh, None, addr, len, memory_type.is_none());
        if registered.is_err() {
            // SAFETY: undo the mapping made above; nothing else knows it.
            unsafe { self.ucp.api().ucp_mem_unmap(self.context, memh) };
        }
        registered
    }

    /// Pack `memh`'s rkey and enter the registration in the token table; `dram`: host
    /// memory, which batched transfers from peers may write (`batch.rs`).
    fn add_mem_entry(
        &mut self,
        memh: ucp_mem_h,
        alloc_addr: Option<u64>,
        addr: u64,
        len: u64,
        dram: bool,
    ) -> Result<(u64, Vec<u8>)> {
        let api = self.ucp.api();
        let mut buffer: *mut c_void = ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: memh is mapped in this context; out-pointers valid.
        let status = unsafe { api.ucp_rkey_pack(self.context, memh, &mut buffer, &mut size) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_rkey_pack", status));
        }
        // SAFETY: UCX returned `size` readable bytes; copied, then released.
        let packed = unsafe {
            let packed = std::slice::from_raw_parts(buffer as *const u8, size).to_vec();
            api.ucp_rkey_buffer_release(buffer);
            packed
        };
        let public_md = crate::wire::frame_rkey(&packed);
        let entry = MemEntry {
            memh,
            alloc_addr,
            addr,
            len,
            packed_rkey: packed,
            self_rkey: ptr::null_mut(),
            indexed: dram,
        };
        if entry.indexed {
            self.events.batch.regions().add(addr, len);
        }
        let index = match self.free_mems.pop() {
            Some(i) => {
                self.mems[i as usize] = Some(entry);
                i
            }
            None => {
                self.mems.push(Some(entry));
                self.mem_generations.push(0);
                (self.mems.len() - 1) as u32
            }
        };
        let token = (u64::from(self.mem_generations[index as usize]) << 32) | u64::from(index);
        Ok((token, public_md))
    }

    pub(super) fn mem_index(&self, token: u64) -> Option<usize> {
        let index = (token & u64::from(u32::MAX)) as usize;
        let generation = (token >> 32) as u32;
        match (self.mems.get(index), self.mem_generations.get(index)) {
            (Some(Some(_)), Some(&g)) if g == generation => Some(index),
            _ => None,
        }
    }

    /// Withdraw a registration from peers: out of the region index (their messages into
    /// it are refused from now on), then done once no rendezvous receive into it is in
    /// flight (`batch.rs`: such a receive was checked before it started and lands after).
    pub(crate) fn withdraw(&mut self, token: u64) -> Result<bool> {
        let index = self
            .mem_index(token)
            .ok_or_else(|| Error::not_found(token_subject(token)))?;
        let entry = self.mems[index].as_mut().expect("mem_index checked");
        let (addr, len) = (entry.addr, entry.len);
        if entry.indexed {
            entry.indexed = false;
            self.events.batch.regions().remove(addr, len);
        }
        if !self.events.batch.receiving_into(addr, len) {
            return Ok(true);
        }
        // Let UCX move what it can; the engine asks again later.
        self.pump();
        Ok(!self.events.batch.receiving_into(addr, len))
    }

    pub(crate) fn deregister(&mut self, token: u64) -> Result<()> {
        let index = self
            .mem_index(token)
            .ok_or_else(|| Error::not_found(token_subject(token)))?;
        let entry = self.mems[index].take().expect("mem_index checked");
        if entry.indexed {
            self.events.batch.regions().remove(entry.addr, entry.len);
        }
        let api = self.ucp.api();
        if !entry.self_rkey.is_null() {
            // SAFETY: rkey unpacked by us on the self ep, not used after this.
            unsafe { api.ucp_rkey_destroy(entry.self_rkey) };
        }
        self.mem_generations[index] = self.mem_generations[index].wrapping_add(1);
        self.free_mems.push(index as u32);
        if let Some(alloc_addr) = entry.alloc_addr {
            // The mapping belongs to the allocation, which outlives this registration.
            if let Some(alloc) = self.allocs.iter_mut().find(|a| a.addr == alloc_addr) {
                alloc.registrations -= 1;
            }
            return Ok(());
        }
        // SAFETY: memh mapped by us in this context; the executor guarantees no request
        // in flight uses it.
        let status = unsafe { api.ucp_mem_unmap(self.context, entry.memh) };
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_mem_unmap", status));
        }
        Ok(())
    }

    /// Build the index of registered memory the batch handlers check ranges against
    /// now, if a registration changed it ([`super::batch::RegionIndex::settle`]).
    pub(crate) fn settle_region_index(&self) {
        self.events.batch.regions().settle();
    }
}
