//! `ferry.Agent`: the NIXL `nixl_agent` surface over a Ferry agent.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::{Arc, Mutex};

use ferry::exchange::{ExchangeConfig, StoreConfig, TcpStoreConfig, Via};
use ferry::{FileMode, MemKind, Op, Params, Side, XferStatus};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use slotmap::{Key, KeyData};

use crate::batch::Batch;
use crate::dlist::{indices, prep_id, xfer_id, DList, PrepHandle, XferHandle};
use crate::errors::{invalid, IntoPy};
use crate::memory::{describe, parse_kind, Keep, Purpose};

/// Name NIXL uses for "the local agent" in `prep_xfer_dlist`.
const NIXL_INIT_AGENT: &str = "NIXL_INIT_AGENT";

/// The backend parameter that `enable_prog_thread` sets (UCX has it).
const PROGRESS_THREAD: &str = "progress_thread";

/// How to build an agent (NIXL's `nixl_agent_config`, plus Ferry's exchange options).
#[pyclass(module = "ferry", name = "AgentConfig", get_all, set_all)]
#[derive(Clone)]
pub(crate) struct AgentConfig {
    /// Backends created at start, in order. `None` (the default): Ferry's default set
    /// (`ferry.DEFAULT_BACKENDS`: LOOPBACK, SHM, UCX, POSIX where available), so each
    /// peer takes the fastest backend that reaches it — where NIXL creates UCX alone.
    backends: Option<Vec<String>>,
    /// Parameters per backend name, `{ "UCX": {"key": "value"} }`.
    backend_params: HashMap<String, HashMap<String, String>>,
    /// Run the P2P metadata listener (NIXL's listen thread).
    enable_listen_thread: bool,
    /// Port of the P2P listener (0: ephemeral; see `Agent.listen_addr`).
    listen_port: u16,
    /// Host of the P2P listener (loopback by default).
    listen_host: String,
    /// `HOST:PORT` of a TCPStore server (torch's or `ferry store serve`) for
    /// name-addressed metadata.
    store: Option<String>,
    /// Run Ferry's own TCPStore server in this agent on `HOST:PORT` (port 0:
    /// ephemeral; see `Agent.store_addr`); the agent then uses it as its store.
    serve_store: Option<String>,
    /// Shared secret of the P2P exchange (mutual challenge–response, HMAC frames).
    secret: Option<Vec<u8>>,
    /// Apply the `FERRY_*` environment overrides to the exchange config.
    env_overrides: bool,
    /// Sets the `progress_thread` parameter of backends that have one (UCX) unless
    /// `backend_params` sets it: a thread that progresses the backend (needed by a
    /// target whose process does not call into the agent; UCX 1.13 emulates RMA over
    /// active messages). Without it, progress runs in `transfer`, `check_xfer_state`,
    /// `get_new_notifs` and `flush`. Default true, as NIXL's.
    enable_prog_thread: bool,
    /// Accepted for NIXL compatibility; Ferry always keeps telemetry
    /// (`get_xfer_telemetry`).
    capture_telemetry: bool,
    /// `"unique"` (default: refuse a name another live agent of this process has) or
    /// `"shared"` (allow it, as NIXL does; `ferry.nixl_agent` uses it).
    name_policy: String,
}

#[pymethods]
impl AgentConfig {
    #[new]
    #[pyo3(signature = (enable_prog_thread=true, enable_listen_thread=false, listen_port=0,
        capture_telemetry=true, num_threads=0, backends=None, *, backend_params=None,
        listen_host="127.0.0.1".to_string(), store=None, serve_store=None, secret=None,
        env_overrides=true, name_policy="unique".to_string()))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        enable_prog_thread: bool,
        enable_listen_thread: bool,
        listen_port: u16,
        capture_telemetry: bool,
        num_threads: u32,
        backends: Option<Vec<String>>,
        backend_params: Option<HashMap<String, HashMap<String, String>>>,
        listen_host: String,
        store: Option<String>,
        serve_store: Option<String>,
        secret: Option<Vec<u8>>,
        env_overrides: bool,
        name_policy: String,
    ) -> PyResult<AgentConfig> {
        parse_name_policy(&name_policy)?;
        if num_threads != 0 {
            // Reason: NIXL's worker-thread count; Ferry's backends size their own pools.
            return Err(crate::errors::to_py(&ferry::Error::NotSupported {
                backend: "agent".into(),
                what: "num_threads (set the backend's own parameters instead)".into(),
            }));
        }
        Ok(AgentConfig {
            backends,
            backend_params: backend_params.unwrap_or_default(),
            enable_listen_thread,
            listen_port,
            listen_host,
            store,
            serve_store,
            secret,
            env_overrides,
            enable_prog_thread,
            capture_telemetry,
            name_policy,
        })
    }
}

fn parse_name_policy(text: &str) -> PyResult<ferry::NamePolicy> {
    match text {
        "unique" => Ok(ferry::NamePolicy::Unique),
        "shared" => Ok(ferry::NamePolicy::Shared),
        _ => Err(invalid(format!(
            "name_policy must be \"unique\" or \"shared\", not {text:?}"
        ))),
    }
}

impl AgentConfig {
    fn exchange(&self) -> PyResult<Option<ExchangeConfig>> {
        let mut cfg = ExchangeConfig::default();
        if self.env_overrides {
            cfg = cfg.with_env_overrides().py()?;
        }
        let mut any = cfg.p2p.listen.is_some()
            || cfg.embedded_store.is_some()
            || !matches!(cfg.store, StoreConfig::None);
        if self.enable_listen_thread {
            cfg.p2p.listen = Some(addr(&self.listen_host, self.listen_port)?);
            any = true;
        }
        if let Some(secret) = &self.secret {
            cfg.p2p.secret = Some(Arc::from(secret.as_slice()));
        }
        if let Some(store) = &self.store {
            cfg.store = StoreConfig::TcpStore(TcpStoreConfig::new(store.clone()));
            any = true;
        }
        if let Some(serve) = &self.serve_store {
            cfg.embedded_store = Some(parse_addr(serve)?);
            any = true;
        }
        Ok(any.then_some(cfg))
    }
}

fn addr(host: &str, port: u16) -> PyResult<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| invalid(format!("cannot resolve {host}:{port}")))
}

fn parse_addr(text: &str) -> PyResult<SocketAddr> {
    text.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(|| invalid(format!("{text:?} is not HOST:PORT")))
}

fn parse_op(op: &str) -> PyResult<Op> {
    match op.to_ascii_uppercase().as_str() {
        "READ" => Ok(Op::Read),
        "WRITE" => Ok(Op::Write),
        _ => Err(invalid(format!(
            "operation must be \"READ\" or \"WRITE\", not {op:?}"
        ))),
    }
}

/// NIXL's state strings.
pub(crate) fn status_str(status: XferStatus) -> &'static str {
    match status {
        XferStatus::Done => "DONE",
        XferStatus::InProgress => "PROC",
        XferStatus::NotPosted => "NOT_POSTED",
    }
}

thread_local! {
    /// Reused index lists of `make_prepped_xfer`, per thread.
    static SCRATCH: std::cell::RefCell<(Vec<u32>, Vec<u32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// A registered region and what keeps its memory alive.
struct Registered {
    _keep: Option<Arc<Keep>>,
}

/// One participant in data movement, with NIXL's `nixl_agent` methods.
#[pyclass(module = "ferry", name = "Agent", frozen)]
pub(crate) struct Agent {
    // Declared first, so dropped first: backends stop before the memory they may touch
    // is let go by `regions`.
    pub(crate) inner: ferry::Agent,
    /// Registered regions (by `as_ffi` value) and their keep-alives.
    regions: Mutex<HashMap<u64, Registered>>,
    /// Notifications taken by `update_notifs`, not yet consumed by
    /// `check_remote_xfer_done`.
    notifs: Mutex<HashMap<String, Vec<Vec<u8>>>>,
}

impl Agent {
    fn side(&self, agent_name: &str) -> PyResult<Side> {
        if agent_name.is_empty() || agent_name == NIXL_INIT_AGENT || agent_name == self.inner.name()
        {
            return Ok(Side::Local);
        }
        self.inner.peer(agent_name).map(Side::from).ok_or_else(|| {
            crate::errors::to_py(&ferry::Error::not_found(ferry::Subject::PeerName(
                agent_name.to_string(),
            )))
        })
    }

    fn check_hints(&self, backends: &Option<Vec<String>>) -> PyResult<()> {
        let Some(hints) = backends else { return Ok(()) };
        if hints.is_empty() {
            return Ok(());
        }
        let created: Vec<&'static str> = self.inner.backends().iter().map(|b| b.name).collect();
        for h in hints {
            if !created.iter().any(|c| c.eq_ignore_ascii_case(h)) {
                return Err(crate::errors::to_py(&ferry::Error::not_found(
                    ferry::Subject::BackendName(h.clone()),
                )));
            }
        }
        if hints.len() < created.len() {
            return Err(crate::errors::to_py(&ferry::Error::NotSupported {
                backend: "agent".into(),
                what: "backend hints narrower than every created backend (Ferry picks the first backend both sides share)".into(),
            }));
        }
        Ok(())
    }

    fn via(ip_addr: Option<&str>, port: u16) -> PyResult<Via> {
        match ip_addr {
            None | Some("") => Ok(Via::Store),
            Some(ip) => Ok(Via::Peer(addr(ip, port)?)),
        }
    }

    fn region_ids(&self, list: &DList) -> Vec<ferry::RegionId> {
        list.regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|&r| ferry::RegionId::from(KeyData::from_ffi(r)))
            .collect()
    }

    fn take_notifs(&self, py: Python<'_>) -> Vec<(String, Vec<u8>)> {
        py.detach(|| self.inner.drain_notifications())
    }
}

#[pymethods]
impl Agent {
    /// `Agent(name, config=None, instantiate_all=False)`: make an agent and create the
    /// config's backends (every available one with `instantiate_all`).
    #[new]
    #[pyo3(signature = (agent_name, nixl_conf=None, instantiate_all=false))]
    fn new(
        agent_name: &str,
        nixl_conf: Option<AgentConfig>,
        instantiate_all: bool,
    ) -> PyResult<Agent> {
        let config = match nixl_conf {
            Some(c) => c,
            None => AgentConfig::new(
                true,
                false,
                0,
                true,
                0,
                None,
                None,
                "127.0.0.1".into(),
                None,
                None,
                None,
                true,
                "unique".into(),
            )?,
        };
        let inner = ferry::Agent::new(
            ferry::AgentConfig::named(agent_name)
                .with_name_policy(parse_name_policy(&config.name_policy)?),
        )
        .py()?;
        let mut names: Vec<String> = if instantiate_all {
            ferry::Agent::available_backends()
                .into_iter()
                .filter(|f| f.available.is_ok())
                .map(|f| f.name.to_string())
                .collect()
        } else {
            Vec::new()
        };
        for b in config.backends.iter().flatten() {
            if !names.iter().any(|n| n.eq_ignore_ascii_case(b)) {
                names.push(b.clone());
            }
        }
        let params_of = |name: &str| -> Params {
            let mut params: Params = config
                .backend_params
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
                .unwrap_or_default();
            // NIXL's `enable_prog_thread` is the backend's own progress thread here.
            let has_thread = ferry::factory(name)
                .map(|f| f.params().iter().any(|p| p.name == PROGRESS_THREAD))
                .unwrap_or(false);
            if has_thread && !params.contains_key(PROGRESS_THREAD) {
                params.insert(
                    PROGRESS_THREAD.into(),
                    config.enable_prog_thread.to_string(),
                );
            }
            params
        };
        for name in &names {
            inner.create_backend(name, &params_of(name)).py()?;
        }
        if config.backends.is_none() {
            inner.create_default_backends(params_of).py()?;
        }
        if let Some(cfg) = config.exchange()? {
            inner.start_exchange(cfg).py()?;
        }
        Ok(Agent {
            inner,
            regions: Mutex::new(HashMap::new()),
            notifs: Mutex::new(HashMap::new()),
        })
    }

    /// The agent's name.
    #[getter]
    fn name(&self) -> &str {
        self.inner.name()
    }

    /// `(host, port)` of the P2P metadata listener, or None.
    #[getter]
    fn listen_addr(&self) -> Option<(String, u16)> {
        self.inner
            .exchange_listen_addr()
            .map(|a| (a.ip().to_string(), a.port()))
    }

    /// `"HOST:PORT"` of the TCPStore server this agent serves, or None.
    #[getter]
    fn store_addr(&self) -> Option<String> {
        self.inner.exchange_store_addr().map(|a| a.to_string())
    }

    // ------------------------------------------------------------------ backends

    /// Backend types this build knows and that work on this machine.
    fn get_plugin_list(&self) -> Vec<&'static str> {
        ferry::Agent::available_backends()
            .into_iter()
            .filter(|f| f.available.is_ok())
            .map(|f| f.name)
            .collect()
    }

    /// Parameters of a backend type, with defaults: `{name: default}`.
    fn get_plugin_params(&self, backend: &str) -> PyResult<HashMap<&'static str, &'static str>> {
        let f = plugin(backend)?;
        Ok(f.params.iter().map(|p| (p.name, p.default)).collect())
    }

    /// Memory kinds a backend type supports.
    fn get_plugin_mem_types(&self, backend: &str) -> PyResult<Vec<&'static str>> {
        Ok(plugin(backend)?
            .mem_kinds
            .iter()
            .map(|k| k.name())
            .collect())
    }

    /// Create a backend of type `backend` with `initParams` (string values; unknown keys
    /// are refused). Returns its name.
    #[pyo3(signature = (backend, initParams=None))]
    #[allow(non_snake_case)]
    fn create_backend(
        &self,
        backend: &str,
        initParams: Option<HashMap<String, String>>,
    ) -> PyResult<&'static str> {
        let params: Params = initParams.unwrap_or_default().into_iter().collect();
        let id = self.inner.create_backend(backend, &params).py()?;
        Ok(self
            .inner
            .backends()
            .into_iter()
            .find(|b| b.id == id)
            .map(|b| b.name)
            .unwrap_or("?"))
    }

    /// Names of the backends created on this agent.
    fn get_backends(&self) -> Vec<&'static str> {
        self.inner.backends().iter().map(|b| b.name).collect()
    }

    /// Effective parameters of a created backend.
    fn get_backend_params(&self, backend: &str) -> PyResult<HashMap<String, String>> {
        self.inner
            .backends()
            .into_iter()
            .find(|b| b.name.eq_ignore_ascii_case(backend))
            .map(|b| b.params.into_iter().collect())
            .ok_or_else(|| {
                crate::errors::to_py(&ferry::Error::not_found(ferry::Subject::BackendName(
                    backend.into(),
                )))
            })
    }

    /// Memory kinds a created backend supports.
    fn get_backend_mem_types(&self, backend: &str) -> PyResult<Vec<&'static str>> {
        self.inner
            .backends()
            .into_iter()
            .find(|b| b.name.eq_ignore_ascii_case(backend))
            .map(|b| b.capabilities.mem_kinds.iter().map(|k| k.name()).collect())
            .ok_or_else(|| {
                crate::errors::to_py(&ferry::Error::not_found(ferry::Subject::BackendName(
                    backend.into(),
                )))
            })
    }

    // ------------------------------------------------------------------ memory

    /// Describe memory for registration (kept alive by the list).
    #[pyo3(signature = (descs, mem_type=None))]
    fn get_reg_descs(&self, descs: &Bound<'_, PyAny>, mem_type: Option<&str>) -> PyResult<DList> {
        let kind = mem_type.map(parse_kind).transpose()?;
        Ok(DList::new(describe(descs, kind, Purpose::Register)?))
    }

    /// Describe memory for transfers (prep_xfer_dlist / initialize_xfer).
    #[pyo3(signature = (descs, mem_type=None))]
    fn get_xfer_descs(&self, descs: &Bound<'_, PyAny>, mem_type: Option<&str>) -> PyResult<DList> {
        let kind = mem_type.map(parse_kind).transpose()?;
        Ok(DList::new(describe(descs, kind, Purpose::Xfer)?))
    }

    /// Register memory with every backend that supports its kind: arrays, tensors,
    /// buffers, `(addr, len, dev)` tuples, lists of them or a `DescList`. The objects
    /// are kept alive until `deregister_memory`. Returns the registered list. All or
    /// nothing: if one descriptor fails, those registered before it are deregistered.
    #[pyo3(signature = (reg_list, mem_type=None, backends=None))]
    fn register_memory(
        &self,
        reg_list: &Bound<'_, PyAny>,
        mem_type: Option<&str>,
        backends: Option<Vec<String>>,
    ) -> PyResult<DList> {
        let reg_py = reg_list.py();
        self.check_hints(&backends)?;
        let kind = mem_type.map(parse_kind).transpose()?;
        let described = describe(reg_list, kind, Purpose::Register)?;
        let kind = described.kind.unwrap_or(MemKind::Dram);
        let mut ids = Vec::with_capacity(described.descs.len());
        for (i, &desc) in described.descs.iter().enumerate() {
            let result = match &described.paths[i] {
                Some(path) => reg_py.detach(|| {
                    self.inner.register_file(
                        Path::new(path),
                        FileMode {
                            write: true,
                            ..FileMode::default()
                        },
                        desc,
                    )
                }),
                None => {
                    // SAFETY: memory from a Python object is kept alive (and exported)
                    // by `described.keeps[i]` until deregistration; raw
                    // `(addr, len, dev)` descriptors are the caller's promise, as in
                    // NIXL; FILE/BLOCK/OBJECT descriptors name no process memory.
                    reg_py.detach(|| unsafe { self.inner.register(kind, desc) })
                }
            };
            match result {
                Ok(id) => ids.push(id),
                Err(e) => {
                    reg_py.detach(|| {
                        for &id in &ids {
                            let _ = deregister_waiting(&self.inner, id);
                        }
                    });
                    return Err(crate::errors::to_py(&e));
                }
            }
        }
        let mut regions = self.regions.lock().unwrap_or_else(|e| e.into_inner());
        let list = DList::new(described);
        {
            let mut own = list.regions.lock().unwrap_or_else(|e| e.into_inner());
            for (i, id) in ids.iter().enumerate() {
                let ffi = id.data().as_ffi();
                own.push(ffi);
                regions.insert(
                    ffi,
                    Registered {
                        _keep: list.described.keeps[i].clone(),
                    },
                );
            }
        }
        Ok(list)
    }

    /// Deregister what `register_memory` returned. Refused (NotAllowedError) while a
    /// request using it is in flight; regions deregistered before the refusal stay
    /// deregistered, the rest stay registered and a later call finishes the job.
    #[pyo3(signature = (dereg_list, backends=None))]
    fn deregister_memory(
        &self,
        dereg_list: &Bound<'_, DList>,
        backends: Option<Vec<String>>,
    ) -> PyResult<()> {
        let dereg_py = dereg_list.py();
        self.check_hints(&backends)?;
        let list = dereg_list.get();
        let ids = self.region_ids(list);
        if ids.is_empty() {
            return Err(crate::errors::to_py(&ferry::Error::not_found(
                ferry::Subject::Named(
                    "registration (this list is not registered, or was deregistered)".into(),
                ),
            )));
        }
        let mut done = 0;
        let mut failure = None;
        for id in &ids {
            let id_now = *id;
            match dereg_py.detach(|| deregister_waiting(&self.inner, id_now)) {
                Ok(()) => {
                    done += 1;
                    self.regions
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&id.data().as_ffi());
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        list.regions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..done);
        match failure {
            Some(e) => Err(crate::errors::to_py(&e)),
            None => Ok(()),
        }
    }

    /// Allocate `size` bytes of `mem_type` memory (default DRAM) through `backend`
    /// (default "UCX"; a shared-memory segment that same-host peers reach with one copy,
    /// as `ucx_perftest` allocates) and register it with every backend. Returns an
    /// `Allocation`: its bytes as a memoryview (`a.view()`,
    /// `numpy.frombuffer(a.view(), dtype=numpy.uint8)`), `a.desc(offset, size)` for descriptor
    /// lists. `free_memory(a)` frees it (refused while a view or a request uses it).
    /// Errors: NotSupportedError where the backend allocates nothing (or not this kind),
    /// InvalidParamError for a zero or oversized size, NotFoundError for an unknown
    /// backend.
    #[pyo3(signature = (size, mem_type=None, backend="UCX"))]
    fn alloc_memory(
        slf: &Bound<'_, Self>,
        size: u64,
        mem_type: Option<&str>,
        backend: &str,
    ) -> PyResult<crate::alloc::Allocation> {
        let this = slf.get();
        let kind = mem_type
            .map(parse_kind)
            .transpose()?
            .unwrap_or(MemKind::Dram);
        let id = this
            .inner
            .backends()
            .iter()
            .find(|b| b.name.eq_ignore_ascii_case(backend))
            .map(|b| b.id)
            .ok_or_else(|| {
                crate::errors::to_py(&ferry::Error::not_found(ferry::Subject::BackendName(
                    backend.to_string(),
                )))
            })?;
        let (region, desc) = slf
            .py()
            .detach(|| this.inner.alloc(id, kind, size))
            .map_err(|e| crate::errors::to_py(&e))?;
        Ok(crate::alloc::Allocation::new(
            slf.clone().unbind(),
            region,
            desc.addr,
            desc.len,
        ))
    }

    /// Free what `alloc_memory` returned. NotAllowedError while a buffer export
    /// (memoryview, numpy array) of it is alive or a request uses it; NotFoundError if
    /// already freed; MismatchError for another agent's allocation.
    fn free_memory(
        &self,
        py: Python<'_>,
        allocation: &Bound<'_, crate::alloc::Allocation>,
    ) -> PyResult<()> {
        allocation.get().free(py, self)
    }

    /// Number of regions registered through this object.
    fn registered_count(&self) -> usize {
        self.regions.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// A descriptor list as bytes (Ferry's descriptor-list wire format), for a side
    /// channel; `deserialize_descs` reads it back (without keep-alives: the bytes name
    /// addresses only).
    fn get_serialized_descs<'py>(
        &self,
        py: Python<'py>,
        descs: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let d = describe(descs, None, Purpose::Xfer)?;
        let bytes =
            ferry::metadata::encode_descs(d.kind.unwrap_or(MemKind::Dram), &d.descs).py()?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Read bytes from `get_serialized_descs` back into a `DescList` (malformed bytes
    /// raise `InvalidParamError`).
    fn deserialize_descs(&self, serialized_descs: &[u8]) -> PyResult<DList> {
        let (kind, descs) = ferry::metadata::decode_descs(serialized_descs).py()?;
        let n = descs.len();
        Ok(DList::new(crate::memory::Described {
            kind: Some(kind),
            descs,
            keeps: vec![None; n],
            paths: vec![None; n],
        }))
    }

    // ------------------------------------------------------------------ prep / make

    /// Prepare a descriptor list once (local: `""`, `"NIXL_INIT_AGENT"` or our name; or a
    /// loaded peer's name) for use by index.
    #[pyo3(signature = (agent_name, xfer_list, mem_type=None, backends=None))]
    fn prep_xfer_dlist(
        &self,
        py: Python<'_>,
        agent_name: &str,
        xfer_list: &Bound<'_, PyAny>,
        mem_type: Option<&str>,
        backends: Option<Vec<String>>,
    ) -> PyResult<PrepHandle> {
        self.check_hints(&backends)?;
        let side = self.side(agent_name)?;
        let kind = mem_type.map(parse_kind).transpose()?;
        let described = describe(xfer_list, kind, Purpose::Xfer)?;
        let kind = described.kind.unwrap_or(MemKind::Dram);
        let descs = described.descs;
        let id = py.detach(|| self.inner.prep(side, kind, &descs)).py()?;
        Ok(PrepHandle::of(id))
    }

    /// Release a prepared list.
    fn release_dlist_handle(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<()> {
        let p = prep_id(handle)?;
        py.detach(|| self.inner.release_prep(p)).py()
    }

    /// Build a request from two prepared lists and index lists (NumPy arrays or
    /// sequences; an empty list means "every descriptor, in order"), with an optional
    /// notification delivered after the data is visible at the target.
    #[pyo3(signature = (operation, local_xfer_side, local_indices, remote_xfer_side, remote_indices,
        notif_msg=None, backends=None, skip_desc_merge=false))]
    #[allow(clippy::too_many_arguments)]
    fn make_prepped_xfer(
        &self,
        py: Python<'_>,
        operation: &str,
        local_xfer_side: &Bound<'_, PyAny>,
        local_indices: &Bound<'_, PyAny>,
        remote_xfer_side: &Bound<'_, PyAny>,
        remote_indices: &Bound<'_, PyAny>,
        notif_msg: Option<&[u8]>,
        backends: Option<Vec<String>>,
        skip_desc_merge: bool,
    ) -> PyResult<XferHandle> {
        if skip_desc_merge {
            return Err(crate::errors::to_py(&ferry::Error::NotSupported {
                backend: "agent".into(),
                what: "skip_desc_merge (Ferry always merges adjacent ranges)".into(),
            }));
        }
        self.check_hints(&backends)?;
        let op = parse_op(operation)?;
        let local = prep_id(local_xfer_side)?;
        let remote = prep_id(remote_xfer_side)?;
        // Per-thread scratch: a lock held across `detach` would deadlock against a
        // thread that waits for it while holding the GIL.
        SCRATCH.with(|cell| {
            let mut guard = cell.borrow_mut();
            let (li, ri) = &mut *guard;
            indices(local_indices, li)?;
            indices(remote_indices, ri)?;
            let notif = notif_msg.filter(|n| !n.is_empty());
            let id = py
                .detach(|| self.inner.make(op, local, li, remote, ri, notif))
                .py()?;
            Ok(XferHandle::of(id))
        })
    }

    /// Build a request in one shot from two descriptor lists, the remote one on
    /// `remote_agent`'s memory.
    #[pyo3(signature = (operation, local_descs, remote_descs, remote_agent, notif_msg=None, backends=None))]
    #[allow(clippy::too_many_arguments)]
    fn initialize_xfer(
        &self,
        py: Python<'_>,
        operation: &str,
        local_descs: &Bound<'_, PyAny>,
        remote_descs: &Bound<'_, PyAny>,
        remote_agent: &str,
        notif_msg: Option<&[u8]>,
        backends: Option<Vec<String>>,
    ) -> PyResult<XferHandle> {
        self.check_hints(&backends)?;
        let op = parse_op(operation)?;
        let side = self.side(remote_agent)?;
        let local = describe(local_descs, None, Purpose::Xfer)?;
        let remote = describe(remote_descs, None, Purpose::Xfer)?;
        let (lk, rk) = (
            local.kind.unwrap_or(MemKind::Dram),
            remote.kind.unwrap_or(MemKind::Dram),
        );
        let notif = notif_msg.filter(|n| !n.is_empty());
        let id = py
            .detach(|| {
                self.inner
                    .create(op, lk, &local.descs, side, rk, &remote.descs, notif)
            })
            .py()?;
        Ok(XferHandle::of(id))
    }

    /// Post (or repost) a request; `"DONE"` or `"PROC"`. A notification is attached
    /// when the request is made (`notif_msg` of make/initialize); passing a different
    /// one here is refused.
    #[pyo3(signature = (handle, notif_msg=None))]
    fn transfer(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
        notif_msg: Option<&[u8]>,
    ) -> PyResult<&'static str> {
        if notif_msg.is_some_and(|n| !n.is_empty()) {
            return Err(crate::errors::to_py(&ferry::Error::NotSupported {
                backend: "agent".into(),
                what: "a notification given at transfer time (give notif_msg to make_prepped_xfer or initialize_xfer)".into(),
            }));
        }
        let x = xfer_id(handle)?;
        let status = py.detach(|| self.inner.post(x)).py()?;
        Ok(status_str(status))
    }

    /// Drive the backends once and give the request's state: `"DONE"`, `"PROC"` or
    /// `"NOT_POSTED"`; a failed request raises its error.
    fn check_xfer_state(
        &self,
        py: Python<'_>,
        handle: &Bound<'_, PyAny>,
    ) -> PyResult<&'static str> {
        let x = xfer_id(handle)?;
        let status = py.detach(|| self.inner.check(x)).py()?;
        Ok(status_str(status))
    }

    /// Release a request (an in-flight one only if its backend can cancel it).
    fn release_xfer_handle(&self, py: Python<'_>, handle: &Bound<'_, PyAny>) -> PyResult<()> {
        let x = xfer_id(handle)?;
        py.detach(|| self.inner.release(x)).py()
    }

    /// Telemetry of a request: `startTime` (µs since the post, as seen now), `postDuration`
    /// and `xferDuration` (µs), `totalBytes`, `descCount` (after merging) and
    /// `descCountUnmerged`.
    fn get_xfer_telemetry<'py>(
        &self,
        py: Python<'py>,
        handle: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = self.inner.telemetry(xfer_id(handle)?).py()?;
        let d = PyDict::new(py);
        d.set_item("startTime", t.start.map(|s| s.elapsed().as_micros() as u64))?;
        d.set_item("postDuration", t.post_duration.as_micros() as u64)?;
        d.set_item("xferDuration", t.xfer_duration.as_micros() as u64)?;
        d.set_item("totalBytes", t.total_bytes)?;
        d.set_item("descCount", t.desc_count)?;
        d.set_item("descCountUnmerged", t.desc_count_unmerged)?;
        // Nanosecond figures and the post's wall-clock time, for callers that round
        // themselves (`ferry.nixl` gives NIXL's µs fields from these).
        d.set_item("postDurationNs", t.post_duration.as_nanos() as u64)?;
        d.set_item("xferDurationNs", t.xfer_duration.as_nanos() as u64)?;
        let start_unix_ns = t.start.map(|s| {
            let ago = s.elapsed();
            std::time::SystemTime::now()
                .checked_sub(ago)
                .and_then(|at| at.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        d.set_item("startUnixNs", start_unix_ns)?;
        Ok(d)
    }

    /// How long a request is expected to take (NIXL's `estimate_xfer_cost`):
    /// `(duration_us, margin_us, method)`, method `"ANALYTICAL_BACKEND"` (the
    /// transport's own model, UCX) or `"MEASURED"` (a fit of this agent's completed
    /// requests on that backend). NoTelemetryError until there is something to go by.
    fn estimate_xfer_cost(&self, handle: &Bound<'_, PyAny>) -> PyResult<(u64, u64, &'static str)> {
        let e = self.inner.estimate(xfer_id(handle)?).py()?;
        let method = match e.method {
            ferry::CostMethod::Analytical => "ANALYTICAL_BACKEND",
            ferry::CostMethod::Measured => "MEASURED",
        };
        Ok((
            e.duration.as_micros() as u64,
            e.margin.as_micros() as u64,
            method,
        ))
    }

    /// A snapshot of the agent's metrics (the figures the `prometheus` endpoint of
    /// `FERRY_METRICS_LISTEN` exports): a dict with `flushes`, `peers`, exchange
    /// counters, `errors` (`{status: count}`) and `backends` (`{name: {posted, bytes,
    /// descriptors, completed, failed, refused, latency_sum_us, latency_buckets}}`,
    /// bucket `i` counting completions under `2**i` µs).
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = self.inner.metrics();
        let d = PyDict::new(py);
        d.set_item("flushes", m.flushes)?;
        d.set_item("peers", m.peers)?;
        d.set_item("fetches", m.fetches)?;
        d.set_item("fetch_failures", m.fetch_failures)?;
        d.set_item("loads", m.loads)?;
        d.set_item("load_failures", m.load_failures)?;
        d.set_item("invalidations", m.invalidations)?;
        d.set_item("send_failures", m.send_failures)?;
        let errors = PyDict::new(py);
        for (kind, n) in &m.errors {
            errors.set_item(*kind, *n)?;
        }
        d.set_item("errors", errors)?;
        let backends = PyDict::new(py);
        for b in &m.backends {
            let e = PyDict::new(py);
            e.set_item("posted", b.posted)?;
            e.set_item("bytes", b.bytes)?;
            e.set_item("descriptors", b.descriptors)?;
            e.set_item("completed", b.completed)?;
            e.set_item("failed", b.failed)?;
            e.set_item("refused", b.refused)?;
            e.set_item("latency_sum_us", b.latency_sum.as_micros() as u64)?;
            e.set_item("latency_buckets", b.latency.to_vec())?;
            backends.set_item(b.name, e)?;
        }
        d.set_item("backends", backends)?;
        Ok(d)
    }

    /// Ask a created backend about memory or files, one answer per descriptor (NIXL's
    /// `query_memory`): `None` where the thing does not exist, else a dict with
    /// `size`, `mode` and `mtime_ns`. FILE descriptors are `(offset, len, dev, path)`.
    #[pyo3(signature = (descs, backend, mem_type=None))]
    fn query_memory<'py>(
        &self,
        py: Python<'py>,
        descs: &Bound<'py, PyAny>,
        backend: &str,
        mem_type: Option<&str>,
    ) -> PyResult<Vec<Option<Bound<'py, PyDict>>>> {
        let id = self
            .inner
            .backends()
            .into_iter()
            .find(|b| b.name.eq_ignore_ascii_case(backend))
            .map(|b| b.id)
            .ok_or_else(|| {
                crate::errors::to_py(&ferry::Error::not_found(ferry::Subject::BackendName(
                    backend.into(),
                )))
            })?;
        let kind = mem_type.map(parse_kind).transpose()?;
        let described = describe(descs, kind, Purpose::Xfer)?;
        let kind = described.kind.or(kind).unwrap_or(MemKind::Dram);
        let paths: Vec<Option<&Path>> = described
            .paths
            .iter()
            .map(|p| p.as_deref().map(Path::new))
            .collect();
        let results = py
            .detach(|| self.inner.query(id, kind, &described.descs, &paths))
            .py()?;
        results
            .into_iter()
            .map(|r| {
                if !r.exists {
                    return Ok(None);
                }
                let d = PyDict::new(py);
                d.set_item("size", r.size)?;
                d.set_item("mode", r.mode)?;
                d.set_item("mtime_ns", r.mtime_ns)?;
                Ok(Some(d))
            })
            .collect()
    }

    // ------------------------------------------------------------------ notifications

    /// Drive the backends once and take every notification that arrived since the last
    /// call: `{agent_name: [payload, …]}`.
    fn get_new_notifs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (from, payload) in self.take_notifs(py) {
            let bytes = PyBytes::new(py, &payload);
            match d.get_item(&from)? {
                Some(list) => list.cast::<PyList>()?.append(bytes)?,
                None => d.set_item(&from, PyList::new(py, [bytes])?)?,
            }
        }
        Ok(d)
    }

    /// Take new notifications into the agent's own store, which
    /// `check_remote_xfer_done` searches.
    fn update_notifs(&self, py: Python<'_>) {
        let new = self.take_notifs(py);
        let mut store = self.notifs.lock().unwrap_or_else(|e| e.into_inner());
        for (from, payload) in new {
            store.entry(from).or_default().push(payload);
        }
    }

    /// Whether a notification from `remote_agent_name` equal to `lookup_msg` (or
    /// starting with it, with `tag_is_prefix`) arrived; consumes it.
    #[pyo3(signature = (remote_agent_name, lookup_msg, tag_is_prefix=true))]
    fn check_remote_xfer_done(
        &self,
        py: Python<'_>,
        remote_agent_name: &str,
        lookup_msg: &[u8],
        tag_is_prefix: bool,
    ) -> bool {
        self.update_notifs(py);
        let mut store = self.notifs.lock().unwrap_or_else(|e| e.into_inner());
        let Some(list) = store.get_mut(remote_agent_name) else {
            return false;
        };
        let pos = list.iter().position(|m| {
            if tag_is_prefix {
                m.starts_with(lookup_msg)
            } else {
                m == lookup_msg
            }
        });
        match pos {
            Some(i) => {
                list.remove(i);
                true
            }
            None => false,
        }
    }

    /// Send a notification alone (to ourselves too).
    fn send_notif(
        &self,
        py: Python<'_>,
        remote_agent_name: &str,
        notif_msg: &[u8],
    ) -> PyResult<()> {
        let side = self.side(remote_agent_name)?;
        py.detach(|| self.inner.notify(side, notif_msg)).py()
    }

    // ------------------------------------------------------------------ metadata

    /// Our full metadata blob (for a side channel).
    fn get_agent_metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.inner.local_md().py()?))
    }

    /// Partial metadata: only the regions of `descs` (a registered list), with or
    /// without connection info.
    #[pyo3(signature = (descs, inc_conn_info=false, backends=None))]
    fn get_partial_agent_metadata<'py>(
        &self,
        py: Python<'py>,
        descs: Option<&Bound<'py, DList>>,
        inc_conn_info: bool,
        backends: Option<Vec<String>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        self.check_hints(&backends)?;
        // `None`: no regions (connection info alone, with `inc_conn_info`).
        let ids = descs.map(|d| self.region_ids(d.get())).unwrap_or_default();
        Ok(PyBytes::new(
            py,
            &self.inner.local_partial_md(&ids, inc_conn_info).py()?,
        ))
    }

    /// Load a peer's metadata blob; returns the peer's agent name.
    fn add_remote_agent(&self, py: Python<'_>, metadata: &[u8]) -> PyResult<String> {
        let name = ferry::metadata::PeerMd::from_bytes(metadata)
            .py()?
            .agent()
            .to_string();
        py.detach(|| self.inner.load_remote_md(metadata)).py()?;
        Ok(name)
    }

    /// Forget a peer's metadata (its requests fail with NotFoundError afterwards).
    fn remove_remote_agent(&self, py: Python<'_>, agent: &str) -> PyResult<()> {
        let Side::Peer(ferry::Ref::Handle(peer)) = self.side(agent)? else {
            return Err(invalid("cannot remove the local agent"));
        };
        py.detach(|| self.inner.invalidate_remote_md(peer)).py()
    }

    /// Connect to a loaded peer now instead of on first use.
    fn make_connection(&self, py: Python<'_>, remote_agent: &str) -> PyResult<()> {
        let Side::Peer(ferry::Ref::Handle(peer)) = self.side(remote_agent)? else {
            return Err(invalid("cannot connect to the local agent"));
        };
        py.detach(|| self.inner.make_connection(peer)).py()
    }

    /// Send our metadata to the P2P listener at `ip_addr:port`, or publish it in the
    /// store when no address is given. Never blocks.
    #[pyo3(signature = (ip_addr=None, port=0))]
    fn send_local_metadata(&self, ip_addr: Option<&str>, port: u16) -> PyResult<()> {
        self.inner.send_local_md(Self::via(ip_addr, port)?).py()
    }

    /// Send (or publish under `label`) partial metadata of a registered list.
    #[pyo3(signature = (descs, inc_conn_info=true, backends=None, ip_addr=None, port=0, label="partial"))]
    fn send_partial_agent_metadata(
        &self,
        descs: Option<&Bound<'_, DList>>,
        inc_conn_info: bool,
        backends: Option<Vec<String>>,
        ip_addr: Option<&str>,
        port: u16,
        label: &str,
    ) -> PyResult<()> {
        self.check_hints(&backends)?;
        if !inc_conn_info {
            return Err(crate::errors::to_py(&ferry::Error::NotSupported {
                backend: "agent".into(),
                what: "sending partial metadata without connection info".into(),
            }));
        }
        let ids = descs.map(|d| self.region_ids(d.get())).unwrap_or_default();
        self.inner
            .send_local_partial_md(&ids, label, Self::via(ip_addr, port)?)
            .py()
    }

    /// Ask for `remote_name`'s metadata from its P2P listener or the store; poll
    /// `check_remote_metadata`. Never blocks.
    #[pyo3(signature = (remote_name, ip_addr=None, port=0, label=None))]
    fn fetch_remote_metadata(
        &self,
        remote_name: &str,
        ip_addr: Option<&str>,
        port: u16,
        label: Option<&str>,
    ) -> PyResult<()> {
        self.inner
            .fetch_remote_md(remote_name, Self::via(ip_addr, port)?, label)
            .py()
    }

    /// Whether `remote_name`'s metadata is loaded (and covers `descs`, if given); a
    /// failed fetch raises its error once.
    #[pyo3(signature = (remote_name, descs=None))]
    fn check_remote_metadata(
        &self,
        py: Python<'_>,
        remote_name: &str,
        descs: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let described = descs
            .map(|d| describe(d, None, Purpose::Xfer))
            .transpose()?;
        let regions = described
            .as_ref()
            .map(|d| (d.kind.unwrap_or(MemKind::Dram), d.descs.as_slice()));
        py.detach(|| self.inner.check_remote_md(remote_name, regions))
            .py()
    }

    /// Withdraw our metadata from the listener at `ip_addr:port`, or from the store.
    #[pyo3(signature = (ip_addr=None, port=0))]
    fn invalidate_local_metadata(&self, ip_addr: Option<&str>, port: u16) -> PyResult<()> {
        self.inner
            .invalidate_local_md(Self::via(ip_addr, port)?)
            .py()
    }

    // ------------------------------------------------------------------ batch

    /// A new command buffer for this agent (see `Batch`).
    #[pyo3(signature = (capacity=4096))]
    fn batch(&self, capacity: usize) -> Batch {
        Batch::with_capacity(capacity)
    }

    /// Flush a batch: run every recorded command in one pass of the executor, without
    /// the GIL. Returns `(failed, posted, completed, notifications)` counts.
    fn flush(&self, py: Python<'_>, batch: &Bound<'_, Batch>) -> PyResult<(u32, u32, u32, u32)> {
        let mut b = batch.borrow_mut();
        let cmds = &mut b.cmds;
        let s = py.detach(|| self.inner.flush(cmds));
        Ok((s.failed, s.posted, s.completed, s.notifications))
    }

    /// Drive every backend once; how many requests completed.
    fn progress(&self, py: Python<'_>) -> u32 {
        py.detach(|| self.inner.progress())
    }

    /// Live `(requests, prepared lists, regions, peers)`.
    fn counts(&self) -> (usize, usize, usize, usize) {
        self.inner.counts()
    }

    fn __repr__(&self) -> String {
        format!("ferry.Agent({:?})", self.inner.name())
    }
}

fn plugin(name: &str) -> PyResult<ferry::FactoryInfo> {
    ferry::Agent::available_backends()
        .into_iter()
        .find(|f| f.name.eq_ignore_ascii_case(name))
        .ok_or_else(|| {
            crate::errors::to_py(&ferry::Error::not_found(ferry::Subject::BackendName(
                name.into(),
            )))
        })
}

/// How long a Python deregistration waits for peers that may still be copying into the
/// region (SHM senders mid-batch finish in microseconds; a frozen one does not).
const DEREGISTER_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Deregister `id`, polling while the engine reports it pending (a peer may still be
/// moving bytes: `ferry::DeregStatus::Pending`): Python callers free the memory when
/// this returns, so it returns only once no backend touches it. Past
/// [`DEREGISTER_WAIT`] it fails with `NotAllowed` and a later call finishes the job.
/// Called with the GIL released.
pub(crate) fn deregister_waiting(agent: &ferry::Agent, id: ferry::RegionId) -> ferry::Result<()> {
    let deadline = std::time::Instant::now() + DEREGISTER_WAIT;
    loop {
        match agent.deregister(id)? {
            ferry::DeregStatus::Done => return Ok(()),
            ferry::DeregStatus::Pending if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_micros(100));
            }
            ferry::DeregStatus::Pending => {
                return Err(ferry::Error::NotAllowed {
                    subject: ferry::Subject::Region(id),
                    reason: format!(
                        "withdrawn, but a peer may still reach it after {DEREGISTER_WAIT:?}; \
                         keep the memory and deregister again"
                    )
                    .into(),
                })
            }
        }
    }
}
