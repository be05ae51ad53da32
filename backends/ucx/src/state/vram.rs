//! GPU memory (VRAM) in the UCX backend.
//!
//! A VRAM region is mapped with `ucp_mem_map` declaring its memory type
//! (`UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE` = `UCS_MEMORY_TYPE_CUDA`), so UCX neither
//! guesses it nor treats device addresses as host memory; the packed rkey then carries
//! what a peer needs (for `cuda_ipc` between processes on one host: the IPC handle).
//! The device is the region's `desc.dev`; its primary context (through `ferry-cuda`) is
//! made current on the thread that maps the region, and before every put or get the
//! context of the device that piece touches: the local range's device when it is VRAM,
//! otherwise (host memory to a peer's VRAM) the peer range's device number where this
//! process has that device, else device 0 — UCX's `cuda_ipc` maps the peer's memory
//! into the current context, so one must be current even for a host-memory initiator.
//! Progress binds the device of the last piece issued (UCX's CUDA transports finish
//! their copies in the context they started them in). Two GPUs in one backend are
//! bound piece by piece; none of this has run on a GPU yet.
//!
//! A range is checked at registration to lie in device memory of its device:
//! `cuMemAlloc` memory in one allocation; VMM memory (PyTorch's expandable segments)
//! may span allocations mapped back to back, which UCX's `cuda_ipc` does not handle
//! (it exports the first allocation's handle only, openucx/ucx#11283): such a region
//! is refused unless the parameter `vmm_spanning=allow` says the UCX in use moves it
//! right (no `cuda_ipc` between the agents, or a UCX with that fix).
//!
//! Whether VRAM can work is decided honestly: the UCX library must report CUDA among
//! its memory types (`ucp_context_query`, `UCP_ATTR_FIELD_MEMORY_TYPES` — a UCX built
//! without CUDA, like Debian's, does not; the `libucx-cu13` / `libucx-cu12` wheels do,
//! when a CUDA driver is present), and the CUDA driver and the device must be there.
//! Without the `cuda` feature VRAM is refused with that reason.

use super::requests::NO_DEVICE;
use super::*;
use ferry_backend_api::Range;

/// Memory kinds the UCX backend moves (VRAM refused at registration when it cannot).
pub(crate) const MEM_KINDS: &[MemKind] = &[MemKind::Dram, MemKind::Vram];

/// VRAM state of one backend instance.
pub(crate) struct VramState {
    /// Why this UCX cannot move CUDA memory, or `None` when it can.
    ucx_refusal: Option<String>,
    /// Devices opened so far, by ordinal (registration opens its region's device; a
    /// post from host memory to a peer's VRAM opens the one it binds).
    #[cfg(feature = "cuda")]
    devices: Vec<Option<ferry_cuda::Device>>,
    /// The device bound on this thread since the last [`Core::vram_bind`] (the core is
    /// used under its lock, one thread at a time).
    #[cfg(feature = "cuda")]
    bound: std::cell::Cell<u16>,
    /// The device of the last piece issued: what progress binds.
    #[cfg(feature = "cuda")]
    last: std::cell::Cell<u16>,
    /// Whether a VMM region spanning several physical allocations is accepted.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    vmm_spanning: bool,
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

    pub(super) fn new(ucp: &Ucp, context: ucp_context_h, vmm_spanning: bool) -> VramState {
        VramState {
            ucx_refusal: cuda_refusal(ucp, context),
            #[cfg(feature = "cuda")]
            devices: Vec::new(),
            #[cfg(feature = "cuda")]
            bound: std::cell::Cell::new(NO_DEVICE),
            #[cfg(feature = "cuda")]
            last: std::cell::Cell::new(NO_DEVICE),
            vmm_spanning,
        }
    }

    /// The device whose context a piece of `post` moving `range` needs ([`NO_DEVICE`]
    /// between host memories): see the module docs.
    pub(super) fn piece_device(&self, post: &Post<'_>, range: &Range) -> u16 {
        if post.local_kind == MemKind::Vram {
            return range.local_dev.min(u64::from(NO_DEVICE - 1)) as u16;
        }
        if post.remote_kind == MemKind::Vram {
            return self.host_initiator_device(range.remote_dev);
        }
        NO_DEVICE
    }

    /// For host memory to a peer's `remote_dev`: that device where it is open here,
    /// else the first device open here, else device 0.
    fn host_initiator_device(&self, remote_dev: u64) -> u16 {
        #[cfg(feature = "cuda")]
        {
            if self
                .devices
                .get(remote_dev as usize)
                .is_some_and(Option::is_some)
            {
                return remote_dev as u16;
            }
            if let Some(first) = self.devices.iter().position(Option::is_some) {
                return first as u16;
            }
        }
        let _ = remote_dev;
        0
    }

    /// Open every device the pieces of `batch` will bind (host memory to a peer's VRAM
    /// with no VRAM of our own opens device 0, once).
    pub(super) fn prepare(&mut self, batch: &[Post<'_>]) -> Result<()> {
        for post in batch {
            if post.remote_kind != MemKind::Vram || post.local_kind == MemKind::Vram {
                continue;
            }
            let Some(range) = post.ranges.first() else {
                continue;
            };
            let dev = self.host_initiator_device(range.remote_dev);
            self.open(u64::from(dev))?;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn open(&mut self, dev: u64) -> Result<&ferry_cuda::Device> {
        let index = dev as usize;
        if self.devices.get(index).is_none_or(Option::is_none) {
            let device = ferry_cuda::Device::open(dev).map_err(|e| e.into_error(BACKEND))?;
            if self.devices.len() <= index {
                self.devices.resize(index + 1, None);
            }
            self.devices[index] = Some(device);
        }
        Ok(self.devices[index].as_ref().expect("opened above"))
    }

    #[cfg(not(feature = "cuda"))]
    fn open(&mut self, _dev: u64) -> Result<()> {
        Err(Error::NotSupported {
            backend: BACKEND.into(),
            what: "VRAM: this build of ferry-ucx has no CUDA support (feature `cuda`)".into(),
        })
    }

    /// Make `dev`'s context current unless it already is (no-op for [`NO_DEVICE`]).
    #[inline]
    pub(super) fn bind_for(&self, dev: u16) {
        #[cfg(feature = "cuda")]
        if dev != NO_DEVICE {
            self.last.set(dev);
            if self.bound.get() != dev {
                self.bind_now(dev);
            }
        }
        let _ = dev;
    }

    #[cfg(feature = "cuda")]
    fn bind_now(&self, dev: u16) {
        match self.devices.get(dev as usize).and_then(Option::as_ref) {
            Some(device) => match device.bind() {
                Ok(()) => self.bound.set(dev),
                Err(e) => log::warn!("UCX: cannot make CUDA device {dev} current: {e}"),
            },
            None => log::warn!("UCX: CUDA device {dev} was never opened; nothing bound"),
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
        let device = self.vram.open(dev)?;
        device.bind().map_err(|e| e.into_error(BACKEND))?;
        let extents =
            ferry_cuda::check_device_range(addr, len, dev).map_err(|e| e.into_error(BACKEND))?;
        check_spanning(&extents, addr, len, self.vram.vmm_spanning)?;
        // Bound now; the next post binds what its pieces need.
        self.vram
            .bound
            .set(dev.min(u64::from(NO_DEVICE - 1)) as u16);
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn vram_device(&mut self, _addr: u64, _len: u64, _dev: u64) -> Result<()> {
        self.vram.open(0)
    }

    /// Make the context of the device last used current on this thread (no-op without
    /// VRAM): what posting starts from and progress needs.
    #[inline]
    pub(crate) fn vram_bind(&self) {
        #[cfg(feature = "cuda")]
        {
            self.vram.bound.set(NO_DEVICE);
            let last = self.vram.last.get();
            let dev = if last != NO_DEVICE {
                Some(last)
            } else {
                self.vram
                    .devices
                    .iter()
                    .position(Option::is_some)
                    .map(|d| d as u16)
            };
            if let Some(dev) = dev {
                self.vram.bind_now(dev);
            }
        }
    }
}

/// Refuse a VMM region that spans several physical allocations unless `allow`
/// (`vmm_spanning=allow`): UCX's `cuda_ipc` would move the first allocation's bytes only.
#[cfg(feature = "cuda")]
fn check_spanning(extents: &[ferry_cuda::Extent], addr: u64, len: u64, allow: bool) -> Result<()> {
    if extents.len() <= 1 || allow {
        return Ok(());
    }
    Err(Error::NotSupported {
        backend: BACKEND.into(),
        what: format!(
            "VRAM region {addr:#x}+{len:#x} spans {} separately mapped VMM allocations (PyTorch \
             expandable segments make such memory); UCX's cuda_ipc exports only the first \
             ({:#x}..{:#x}, openucx/ucx#11283), so bytes past it would go elsewhere: register \
             each allocation on its own, allocate without expandable segments, or set \
             vmm_spanning=allow where no cuda_ipc runs between the agents",
            extents.len(),
            extents[0].base,
            extents[0].end()
        )
        .into(),
    })
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
            ..blank()
        };
        assert!(without.may_move(MemKind::Dram));
        assert!(!without.may_move(MemKind::Vram) && !without.may_move(MemKind::File));
        let with = blank();
        assert!(with.may_move(MemKind::Vram));
    }

    fn blank() -> VramState {
        VramState {
            ucx_refusal: None,
            #[cfg(feature = "cuda")]
            devices: Vec::new(),
            #[cfg(feature = "cuda")]
            bound: std::cell::Cell::new(NO_DEVICE),
            #[cfg(feature = "cuda")]
            last: std::cell::Cell::new(NO_DEVICE),
            vmm_spanning: false,
        }
    }

    #[test]
    fn each_piece_names_the_device_whose_context_it_needs() {
        let state = blank();
        let range = |local_dev, remote_dev| Range {
            local_addr: 0x1000,
            remote_addr: 0x2000,
            len: 64,
            local_dev,
            remote_dev,
            local_token: 0,
            remote_token: 0,
        };
        let post = |local_kind, remote_kind| Post {
            tag: 0,
            op: ferry_backend_api::Op::Write,
            local_kind,
            remote_kind,
            ranges: &[],
            notif: None,
        };
        // VRAM on our side: the local range's device, whatever the peer's is.
        assert_eq!(
            state.piece_device(&post(MemKind::Vram, MemKind::Vram), &range(1, 0)),
            1
        );
        assert_eq!(
            state.piece_device(&post(MemKind::Vram, MemKind::Dram), &range(3, 0)),
            3
        );
        // Host memory to a peer's VRAM (a host-only initiator): a device must still be
        // current; with none open here that is device 0.
        assert_eq!(
            state.piece_device(&post(MemKind::Dram, MemKind::Vram), &range(0, 5)),
            0
        );
        // Host to host: none.
        assert_eq!(
            state.piece_device(&post(MemKind::Dram, MemKind::Dram), &range(0, 0)),
            NO_DEVICE
        );
        // Binding nothing is a no-op.
        state.bind_for(NO_DEVICE);
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn vmm_regions_across_allocations_are_refused_unless_allowed() {
        let m = 2u64 << 20;
        let one = [ferry_cuda::Extent {
            base: 0x4000_0000,
            len: 2 * m,
            device: 0,
            vmm: true,
        }];
        let three: Vec<ferry_cuda::Extent> = (0..3)
            .map(|i| ferry_cuda::Extent {
                base: 0x4000_0000 + i * m,
                len: m,
                device: 0,
                vmm: true,
            })
            .collect();
        check_spanning(&one, 0x4000_0000, 2 * m, false).unwrap();
        let err = check_spanning(&three, 0x4000_0000, 3 * m, false).unwrap_err();
        assert!(matches!(err, Error::NotSupported { .. }), "{err:?}");
        assert!(
            err.to_string()
                .contains("spans 3 separately mapped VMM allocations"),
            "{err}"
        );
        assert!(err.to_string().contains("vmm_spanning=allow"), "{err}");
        check_spanning(&three, 0x4000_0000, 3 * m, true).unwrap();
    }
}
