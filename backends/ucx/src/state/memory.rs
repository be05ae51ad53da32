//! Registered memory: `ucp_mem_map`, packed rkeys, generational tokens.

use super::*;

pub(super) struct MemEntry {
    pub(super) memh: ucp_mem_h,
    pub(super) addr: u64,
    pub(super) len: u64,
    pub(super) packed_rkey: Vec<u8>,
    /// Rkey unpacked on the self endpoint, for local transfers.
    pub(super) self_rkey: ucp_rkey_h,
    /// Host memory (peers' batch messages may write it; `batch.rs`).
    pub(super) dram: bool,
}

impl Core {
    pub(crate) fn register(&mut self, addr: u64, len: u64) -> Result<(u64, Vec<u8>)> {
        self.register_typed(addr, len, None)
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
        let mut buffer: *mut c_void = ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: memh was just mapped in this context; out-pointers valid.
        let status = unsafe { api.ucp_rkey_pack(self.context, memh, &mut buffer, &mut size) };
        if !status.is_ok() {
            // SAFETY: undo the mapping made above.
            unsafe { api.ucp_mem_unmap(self.context, memh) };
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
            addr,
            len,
            packed_rkey: packed,
            self_rkey: ptr::null_mut(),
            dram: memory_type.is_none(),
        };
        if entry.dram {
            self.events
                .batch
                .regions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add(addr, len);
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

    pub(crate) fn deregister(&mut self, token: u64) -> Result<()> {
        let index = self
            .mem_index(token)
            .ok_or_else(|| Error::not_found(token_subject(token)))?;
        let entry = self.mems[index].take().expect("mem_index checked");
        if entry.dram {
            self.events
                .batch
                .regions
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(entry.addr, entry.len);
        }
        let api = self.ucp.api();
        if !entry.self_rkey.is_null() {
            // SAFETY: rkey unpacked by us on the self ep, not used after this.
            unsafe { api.ucp_rkey_destroy(entry.self_rkey) };
        }
        // SAFETY: memh mapped by us in this context; the executor guarantees no request
        // in flight uses it.
        let status = unsafe { api.ucp_mem_unmap(self.context, entry.memh) };
        self.mem_generations[index] = self.mem_generations[index].wrapping_add(1);
        self.free_mems.push(index as u32);
        if !status.is_ok() {
            return Err(ucx_error(&self.ucp, "ucp_mem_unmap", status));
        }
        Ok(())
    }
}
