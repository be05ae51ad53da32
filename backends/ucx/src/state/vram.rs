//! GPU memory (VRAM) in the UCX backend.
//!
//! A VRAM region is mapped with `ucp_mem_map` declaring its memory type
//! (`UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE` = `UCS_MEMORY_TYPE_CUDA`), so UCX neither
//! guesses it nor treats device addresses as host memory; the packed rkey then carries
//! what a peer needs (for `cuda_ipc` between processes on one host: the IPC handle).
//! The device is the region's `desc.dev`; its primary context (through `ferry-cuda`) is
//! made current on the thread that maps the region and on every thread that posts or
//! progresses, because UCX's CUDA transports work in the current context.
//!
//! Whether VRAM can work is decided honestly: the UCX library must report CUDA among
//! its memory types (`ucp_context_query`, `UCP_ATTR_FIELD_MEMORY_TYPES` — a UCX built
//! without CUDA, like Debian's, does not; the `libucx-cu13` / `libucx-cu12` wheels do,
//! when a CUDA driver is present), and the CUDA driver and the device must be there.
//! Without the `cuda` feature VRAM is refused with that reason.

use super::*;

/// Memory kinds the UCX backend moves (VRAM refused at registration when it cannot).
pub(crate) const MEM_KINDS: &[MemKind] = &[MemKind::Dram, MemKind::Vram];

/// VRAM state of one backend instance.
pub(crate) struct VramState {
    /// Why this UCX cannot move CUDA memory, or `None` when it can.
    ucx_refusal: Option<String>,
    /// The device whose context is bound before posting and progressing (the first
    /// device a region was registered on).
    #[cfg(feature = "cuda")]
    device: Option<ferry_cuda::Device>,
}

/// The memory types a context reports, as a readable list.
fn memory_type_names(bits: u64) -> String {
    let names = [
        (UCS_MEMORY_TYPE_HOST, "host"),
        (UCS_MEMORY_TYPE_CUDA, "cuda"),
        (UCS_MEMORY_TYPE_CUDA_MANAGED, "cuda-managed"),
        (UCS_MEMORY_TYPE_ROCM, "rocm"),
        (UCS_MEMORY_TYPE_ROCM_MANAGED, "rocm-managed"),
    ];
    let list: Vec<&str> = names
        .iter()
        .filter(|(bit, _)| bits & (1u64 << bit) != 0)
        .map(|(_, name)| *name)
        .collect();
    if list.is_empty() {
        "none".into()
    } else {
        list.join(", ")
    }
}

/// `None` if `context` can map CUDA memory, else why not.
pub(super) fn cuda_refusal(ucp: &Ucp, context: ucp_context_h) -> Option<String> {
    // SAFETY: plain C struct; zero = no fields.
    let mut attr: ucp_context_attr_t = unsafe { std::mem::zeroed() };
    attr.field_mask = u64::from(UCP_ATTR_FIELD_MEMORY_TYPES);
    // SAFETY: the context is live; attr is writable and its field mask says what to fill.
    let status = unsafe { ucp.api().ucp_context_query(context, &mut attr) };
    if !status.is_ok() {
        return Some(format!(
            "ucp_context_query failed: {}",
            ucp.status_string(status)
        ));
    }
    if attr.memory_types & (1u64 << UCS_MEMORY_TYPE_CUDA) != 0 {
        return None;
    }
    Some(format!(
        "UCX {} ({}) reports no CUDA memory (its memory types: {}): either it is built \
         without CUDA (use the libucp.so of the libucx-cu13 or libucx-cu12 wheel through the \
         ucx_library parameter) or its CUDA module could not load (it needs libcuda.so.1 and \
         libnvidia-ml.so.1)",
        ucp.version(),
        ucp.library().display(),
        memory_type_names(attr.memory_types)
    ))
}

/// Whether VRAM can work with `ucp` on this machine: the UCX reports CUDA memory and a
/// CUDA driver with a device is present. Every reason that applies, joined.
pub(crate) fn vram_available(ucp: &Ucp) -> std::result::Result<(), String> {
    let mut reasons = Vec::new();
    if let Some(why) = probe(ucp) {
        reasons.push(why);
    }
    if let Err(why) = driver_check() {
        reasons.push(why);
    }
    if reasons.is_empty() {
        Ok(())
    } else {
        Err(reasons.join("; "))
    }
}

#[cfg(feature = "cuda")]
fn driver_check() -> std::result::Result<(), String> {
    match ferry_cuda::device_count() {
        Ok(0) => Err("the CUDA driver reports no device".into()),
        Ok(_) => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(not(feature = "cuda"))]
fn driver_check() -> std::result::Result<(), String> {
    Err("this build of ferry-ucx has no VRAM support (feature `cuda`)".into())
}

/// Make a throw-away context with UCX's environment and ask it for CUDA memory.
fn probe(ucp: &Ucp) -> Option<String> {
    let api = ucp.api();
    let mut config: *mut ucp_config_t = ptr::null_mut();
    // SAFETY: NULL prefix/file = the UCX_ environment; out-pointer valid.
    let status = unsafe { api.ucp_config_read(ptr::null(), ptr::null(), &mut config) };
    if !status.is_ok() {
        return Some(format!(
            "ucp_config_read failed: {}",
            ucp.status_string(status)
        ));
    }
    // SAFETY: plain C struct; zero = no fields.
    let mut params: ucp_params_t = unsafe { std::mem::zeroed() };
    params.field_mask = u64::from(UCP_PARAM_FIELD_FEATURES);
    params.features = u64::from(UCP_FEATURE_RMA);
    let mut context: ucp_context_h = ptr::null_mut();
    // SAFETY: params and config are valid for the call; context is an out-pointer.
    let status = unsafe { ucp.init(&params, config, &mut context) };
    // SAFETY: not needed after init.
    unsafe { api.ucp_config_release(config) };
    if !status.is_ok() {
        return Some(format!("ucp_init failed: {}", ucp.status_string(status)));
    }
    let refusal = cuda_refusal(ucp, context);
    // SAFETY: our context, nothing else uses it.
    unsafe { api.ucp_cleanup(context) };
    refusal
}

impl VramState {
    /// Whether a request naming this kind may reach UCX: DRAM always, VRAM only with a
    /// UCX that maps CUDA memory.
    pub(super) fn may_move(&self, kind: MemKind) -> bool {
        match kind {
            MemKind::Dram => true,
            MemKind::Vram => self.ucx_refusal.is_none(),
            _ => false,
        }
    }

    pub(super) fn new(ucp: &Ucp, context: ucp_context_h) -> VramState {
        VramState {
            ucx_refusal: cuda_refusal(ucp, context),
            #[cfg(feature = "cuda")]
            device: None,
        }
    }
}

impl Core {
    /// Map a VRAM region of device `dev`.
    pub(crate) fn register_vram(
        &mut self,
        addr: u64,
        len: u64,
        dev: u64,
    ) -> Result<(u64, Vec<u8>)> {
        if let Some(why) = &self.vram.ucx_refusal {
            return Err(Error::NotSupported {
                backend: BACKEND.into(),
                what: format!("VRAM: {why}").into(),
            });
        }
        self.vram_device(addr, len, dev)?;
        self.register_typed(addr, len, Some(UCS_MEMORY_TYPE_CUDA))
    }

    #[cfg(feature = "cuda")]
    fn vram_device(&mut self, addr: u64, len: u64, dev: u64) -> Result<()> {
        let device = ferry_cuda::Device::open(dev).map_err(|e| e.into_error(BACKEND))?;
        device.bind().map_err(|e| e.into_error(BACKEND))?;
        ferry_cuda::check_device_range(addr, len, dev).map_err(|e| e.into_error(BACKEND))?;
        if self.vram.device.is_none() {
            self.vram.device = Some(device);
        }
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn vram_device(&mut self, _addr: u64, _len: u64, _dev: u64) -> Result<()> {
        Err(Error::NotSupported {
            backend: BACKEND.into(),
            what: "VRAM: this build of ferry-ucx has no CUDA support (feature `cuda`)".into(),
        })
    }

    /// Make the VRAM device's context current on this thread (no-op without VRAM).
    #[inline]
    pub(crate) fn vram_bind(&self) {
        #[cfg(feature = "cuda")]
        if let Some(device) = &self.vram.device {
            if let Err(e) = device.bind() {
                log::warn!(
                    "UCX: cannot make CUDA device {} current: {e}",
                    device.ordinal()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_types_read_as_names() {
        assert_eq!(memory_type_names(1), "host");
        assert_eq!(memory_type_names(0b11), "host, cuda");
        assert_eq!(memory_type_names(0), "none");
        let without = VramState {
            ucx_refusal: Some("no CUDA".into()),
            #[cfg(feature = "cuda")]
            device: None,
        };
        assert!(without.may_move(MemKind::Dram));
        assert!(!without.may_move(MemKind::Vram) && !without.may_move(MemKind::File));
        let with = VramState {
            ucx_refusal: None,
            #[cfg(feature = "cuda")]
            device: None,
        };
        assert!(with.may_move(MemKind::Vram));
    }
}
