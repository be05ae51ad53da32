"""NIXL 1.5.1's ``nixl._api`` on Ferry: ``nixl_agent`` and its config, handles and
enums, with NIXL's argument forms, return values and exceptions.

Built on ``ferry.nixl._bindings`` (looked up at call time, as NIXL's module does, so a
test may replace ``_bindings.nixlAgent``). Where NIXL logs an error and returns
``None`` (a descriptor list it cannot build), so does this; where NIXL lets a builtin
exception out (``KeyError`` for an unknown memory type, operation or backend name,
``ValueError`` for an empty agent name), so does this.
"""

from __future__ import annotations

import enum
import pickle
import sys
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ferry.nixl import _bindings
from ferry.nixl.logging import get_logger

logger = get_logger(__name__)

DEFAULT_COMM_PORT = _bindings.DEFAULT_COMM_PORT

#: NIXL's `_api` module names its bindings `nixlBind`; some callers import that name.
nixlBind = _bindings

#: Backend handles are plain ints.
nixl_backend_handle = int


def _torch_tensor(obj: Any) -> bool:
    """Whether ``obj`` is a torch tensor (never imports torch: a tensor exists only if
    torch is imported already)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


class nixl_thread_sync_t(enum.Enum):
    """Thread-synchronisation modes of an agent (see ``_bindings.nixl_thread_sync_t``:
    Ferry's agent is thread-safe in every mode)."""

    NIXL_THREAD_SYNC_NONE = _bindings.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = _bindings.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = _bindings.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = _bindings.NIXL_THREAD_SYNC_DEFAULT


class _Handle:
    """An integer handle that releases itself when dropped (best effort)."""

    __slots__ = ("_handle", "_agent", "_released")
    _release_method = ""

    def __init__(self, agent: Any, value: int) -> None:
        self._handle = int(value)
        self._agent = agent
        self._released = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(0x{self._handle:x}, released={self._released})"

    def __int__(self) -> int:
        return self._handle

    def release(self) -> None:
        """Release it now (later calls do nothing)."""
        if not self._released:
            getattr(self._agent, self._release_method)(self._handle)
            self._released = True

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            try:
                self.release()
            except Exception:
                pass


class nixl_prepped_dlist_handle(_Handle):
    """A prepared descriptor list (from ``prep_xfer_dlist``)."""

    __slots__ = ()
    _release_method = "releasedDlistH"


class nixl_xfer_handle(_Handle):
    """A transfer request (from ``make_prepped_xfer`` / ``initialize_xfer``)."""

    __slots__ = ()
    _release_method = "releaseXferReq"


class nixl_agent_config:
    """How ``nixl_agent`` builds its agent.

    ``enable_prog_thread``: the backends' progress thread (UCX: sleeps on the
    transport's events). ``enable_listen_thread`` / ``listen_port``: the P2P metadata
    listener (Ferry binds 127.0.0.1 here). ``capture_telemetry``: keep per-request
    telemetry (``NIXL_TELEMETRY_ENABLE``, when set, decides instead). ``num_threads``:
    accepted, unused (Ferry's UCX sizes its own workers). ``backends``: created at start.
    ``sync_mode``: a ``nixl_thread_sync_t``, or None for NIXL's default (STRICT with a
    listener, NONE without).
    """

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Optional[List[str]] = None,
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ) -> None:
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(
                f"sync_mode must be a nixl_thread_sync_t, not {type(sync_mode).__name__!r}"
            )
        self.backends = ["UCX"] if backends is None else backends
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


_MEMS = {
    "DRAM": _bindings.DRAM_SEG,
    "VRAM": _bindings.VRAM_SEG,
    "FILE": _bindings.FILE_SEG,
    "BLOCK": _bindings.BLK_SEG,
    "OBJ": _bindings.OBJ_SEG,
    "cpu": _bindings.DRAM_SEG,
    "cuda": _bindings.VRAM_SEG,
}
_OPS = {"WRITE": _bindings.NIXL_WRITE, "READ": _bindings.NIXL_READ}


class nixl_agent:
    """An agent with NIXL 1.5.1's Python methods, on Ferry.

    ``nixl_agent(name, nixl_conf=None, instantiate_all=False)``; ``.agent`` is the
    ``_bindings.nixlAgent``, ``.agent.ferry`` the ``ferry.Agent`` underneath.
    """

    def __init__(
        self,
        agent_name: str,
        nixl_conf: Optional[nixl_agent_config] = None,
        instantiate_all: bool = False,
    ) -> None:
        if nixl_conf is not None and instantiate_all:
            logger.warning("instantiate_all is ignored when a config is given")
            instantiate_all = False
        conf = nixl_conf or nixl_agent_config()
        if conf.sync_mode is not None:
            sync = conf.sync_mode
        elif conf.enable_listen:
            sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        else:
            sync = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        bind_conf = _bindings.nixlAgentConfig()
        bind_conf.useProgThread = conf.enable_pthread
        bind_conf.useListenThread = conf.enable_listen
        bind_conf.listenPort = conf.port
        bind_conf.syncMode = sync.value
        bind_conf.captureTelemetry = conf.capture_telemetry
        self.agent = _bindings.nixlAgent(agent_name, bind_conf)

        self.name = agent_name
        self.notifs: Dict[str, List[bytes]] = {}
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self.plugin_list = self.agent.getAvailPlugins()
        if not self.plugin_list:
            raise RuntimeError("no backend is available on this machine")
        self.plugin_b_options: Dict[str, Dict[str, str]] = {}
        self.plugin_mem_types: Dict[str, List[str]] = {}
        self.nixl_mems = dict(_MEMS)
        self.nixl_ops = dict(_OPS)

        names = list(self.plugin_list) if instantiate_all else list(conf.backends)
        for name in names:
            if name not in self.plugin_list:
                logger.warning("backend %s is not available here; not created", name)
                continue
            params: Dict[str, str] = {}
            if conf.num_threads > 0 and name == "UCX":
                params["num_threads"] = str(conf.num_threads)
            self.create_backend(name, params)
        logger.info("agent %s ready (Ferry %s)", agent_name, _bindings._ferry.__version__)

    # ------------------------------------------------------------ plugins, backends
    def _plugin(self, name: str) -> bool:
        if name not in self.plugin_list:
            return False
        if name not in self.plugin_b_options:
            params, mems = self.agent.getPluginParams(name)
            self.plugin_b_options[name] = params
            self.plugin_mem_types[name] = mems
        return True

    def get_plugin_list(self) -> List[str]:
        """Backend types available on this machine."""
        return self.plugin_list

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        """Memory types a backend type supports ([] for an unknown one)."""
        if not self._plugin(backend):
            logger.warning("no plugin %s", backend)
            return []
        return self.plugin_mem_types[backend]

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        """Parameters of a backend type and their defaults ({} for an unknown one)."""
        if not self._plugin(backend):
            logger.warning("no plugin %s", backend)
            return {}
        return self.plugin_b_options[backend]

    def get_backend_mem_types(self, backend: str) -> List[str]:
        """Memory types of a created backend ([] if not created)."""
        if backend not in self.backend_mems:
            logger.warning("backend %s is not created", backend)
            return []
        return self.backend_mems[backend]

    def get_backend_params(self, backend: str) -> Dict[str, str]:
        """Parameters of a created backend ({} if not created)."""
        if backend not in self.backend_options:
            logger.warning("backend %s is not created", backend)
            return {}
        return self.backend_options[backend]

    def create_backend(self, backend: str, initParams: Optional[Dict[str, str]] = None) -> None:
        """Create a backend (``nixlNotFoundError`` for an unknown type)."""
        handle = self.agent.createBackend(backend, dict(initParams or {}))
        self.backends[backend] = handle
        options, mems = self.agent.getBackendParams(handle)
        self.backend_options[backend] = options
        self.backend_mems[backend] = mems

    def _backend_handles(self, backends: Optional[List[str]]) -> List[int]:
        return [self.backends[b] for b in (backends or [])]  # KeyError, as NIXL

    # ------------------------------------------------------------ memory
    def register_memory(
        self,
        reg_list: Any,
        mem_type: Optional[str] = None,
        backends: Optional[List[str]] = None,
    ) -> Any:
        """Register tensors, ``(addr, len, dev, meta)`` tuples with ``mem_type``, an
        (N, 3) array with ``mem_type`` or a ``nixlRegDList``; returns the list."""
        descs = self.get_reg_descs(reg_list, mem_type)
        handles = self._backend_handles(backends)
        self.agent.registerMem(descs, handles)
        return descs

    def deregister_memory(self, dereg_list: Any, backends: Optional[List[str]] = None) -> None:
        """Deregister what ``register_memory`` returned (or an equal list)."""
        self.agent.deregisterMem(dereg_list, self._backend_handles(backends))

    def query_memory(
        self, reg_list: Any, backend: str, mem_type: Optional[str] = None
    ) -> List[Optional[Dict[str, Any]]]:
        """Ask a created backend about each descriptor (FILE: the path in ``meta``):
        ``None`` where it does not exist, else a dict of strings (``size``, ``mode``,
        ``mtime`` in seconds)."""
        descs = self.get_reg_descs(reg_list, mem_type)
        if backend not in self.backends:
            raise ValueError(
                f"backend {backend!r} is not created (created: {list(self.backends)})"
            )
        return self.agent.queryMem(descs, self.backends[backend])

    def make_connection(self, remote_agent: str, backends: Optional[List[str]] = None) -> None:
        """Connect to a loaded peer now rather than at the first transfer."""
        self.agent.makeConnection(remote_agent, self._backend_handles(backends))

    # ------------------------------------------------------------ requests
    def prep_xfer_dlist(
        self,
        agent_name: str,
        xfer_list: Any,
        mem_type: Optional[str] = None,
        backends: Optional[List[str]] = None,
    ) -> nixl_prepped_dlist_handle:
        """Prepare a descriptor list for use by index: local with ``"NIXL_INIT_AGENT"``
        (or ``""``), a loaded peer's memory with its name, loopback with our own name."""
        if isinstance(xfer_list, np.ndarray) and xfer_list.ndim == 2 and xfer_list.shape[1] == 5:
            raise _bindings.nixlNotSupportedError(
                "Nx5 strided descriptor arrays (expand them to (N, 3) rows)"
            )
        if isinstance(agent_name, (bytes, bytearray)):
            agent_name = agent_name.decode()
        if agent_name in ("NIXL_INIT_AGENT", ""):
            agent_name = _bindings.NIXL_INIT_AGENT
        handles = self._backend_handles(backends)
        descs = self.get_xfer_descs(xfer_list, mem_type)
        handle = self.agent.prepXferDlist(agent_name, descs, handles)
        return nixl_prepped_dlist_handle(self.agent, handle)

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Union[List[int], np.ndarray],
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Union[List[int], np.ndarray],
        notif_msg: Union[bytes, str] = b"",
        backends: Optional[List[str]] = None,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A request from two prepared lists and index lists (lists or integer arrays),
        with an optional notification (bytes or str) for the target."""
        op = self.nixl_ops[operation]
        handles = self._backend_handles(backends)
        handle = self.agent.makeXferReq(
            op,
            local_xfer_side._handle,
            local_indices,
            remote_xfer_side._handle,
            remote_indices,
            notif_msg,
            handles,
            skip_desc_merge,
        )
        return nixl_xfer_handle(self.agent, handle)

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: str,
        notif_msg: Union[bytes, str] = b"",
        backends: Optional[List[str]] = None,
    ) -> nixl_xfer_handle:
        """A request from two transfer lists, the remote one on ``remote_agent``."""
        op = self.nixl_ops[operation]
        handles = self._backend_handles(backends)
        handle = self.agent.createXferReq(
            op, local_descs, remote_descs, remote_agent, notif_msg, handles
        )
        return nixl_xfer_handle(self.agent, handle)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Union[bytes, str] = b"") -> str:
        """Post (or repost) a request, optionally with a new notification: ``"DONE"``
        or ``"PROC"`` (errors raise)."""
        status = self.agent.postXferReq(handle._handle, notif_msg)
        return "DONE" if status == _bindings.NIXL_SUCCESS else "PROC"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """``"DONE"`` or ``"PROC"``; a failed request raises its error."""
        status = self.agent.getXferStatus(handle._handle)
        return "DONE" if status == _bindings.NIXL_SUCCESS else "PROC"

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> Any:
        """The request's ``nixlXferTelemetry`` (``nixlNoTelemetryError`` when off)."""
        return self.agent.getXferTelemetry(handle._handle)

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> Tuple[int, int, str]:
        """``(duration_us, margin_us, method)``; method ``"ANALYTICAL_BACKEND"`` (the
        transport's model) or ``"MEASURED"`` (a fit of this agent's completed requests;
        Ferry's addition)."""
        duration, margin, method = self.agent.estimateXferCost(req_handle._handle)
        if method == _bindings.NIXL_COST_ANALYTICAL_BACKEND:
            return duration, margin, "ANALYTICAL_BACKEND"
        return duration, margin, str(method)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """Name of the backend the request uses."""
        b = self.agent.queryXferBackend(handle._handle)
        return next(name for name, h in self.backends.items() if h == b)

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Release a request (an in-flight one is canceled if its backend can)."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        """Release a prepared list."""
        handle.release()

    def prep_mem_view(self, dlist: Any, *, backends: Optional[List[str]] = None) -> int:
        """Not provided: Ferry has no device-initiated API (raises nixlNotSupportedError)."""
        return self.agent.prepMemView(dlist, self._backend_handles(backends))

    def release_mem_view(self, mvh: int) -> None:
        """Not provided (see ``prep_mem_view``)."""
        self.agent.releaseMemView(mvh)

    # ------------------------------------------------------------ notifications
    def get_new_notifs(self, backends: Optional[List[str]] = None) -> Dict[str, List[bytes]]:
        """Notifications that arrived since the last call: ``{agent: [bytes, ...]}``."""
        return self.agent.getNotifs({}, self._backend_handles(backends))

    def update_notifs(self, backends: Optional[List[str]] = None) -> Dict[str, List[bytes]]:
        """Add new notifications to ``self.notifs`` and return it."""
        self.notifs = self.agent.getNotifs(self.notifs, self._backend_handles(backends))
        return self.notifs

    def check_remote_xfer_done(
        self,
        remote_agent_name: str,
        lookup_tag: Union[bytes, str],
        backends: Optional[List[str]] = None,
        tag_is_prefix: bool = True,
    ) -> bool:
        """Whether a notification from ``remote_agent_name`` starting with
        ``lookup_tag`` (containing it, with ``tag_is_prefix=False``) arrived; the first
        such one is consumed. An empty tag matches any notification."""
        self.update_notifs(backends)
        tag = lookup_tag.encode() if isinstance(lookup_tag, str) else bytes(lookup_tag)
        msgs = self.notifs.get(remote_agent_name, [])
        for i, msg in enumerate(msgs):
            if (msg.startswith(tag) if tag_is_prefix else tag in msg):
                del msgs[i]
                return True
        return False

    def send_notif(
        self, remote_agent_name: str, notif_msg: Union[bytes, str], backend: Optional[str] = None
    ) -> None:
        """Send a notification alone (bytes or str)."""
        if backend is None:
            self.agent.genNotif(remote_agent_name, notif_msg)
        else:
            self.agent.genNotif(remote_agent_name, notif_msg, self.backends[backend])

    # ------------------------------------------------------------ metadata
    def get_agent_metadata(self) -> bytes:
        """Our metadata, for a side channel."""
        return self.agent.getLocalMD()

    def get_partial_agent_metadata(
        self, descs: Any, inc_conn_info: bool = False, backends: Optional[List[str]] = None
    ) -> bytes:
        """Metadata of some registered lists only (empty: connection info only)."""
        return self.agent.getLocalPartialMD(descs, inc_conn_info, self._backend_handles(backends))

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Load a peer's metadata; returns its name (bytes, as NIXL's binding does)."""
        return self.agent.loadRemoteMD(metadata)

    def remove_remote_agent(self, agent: str) -> None:
        """Forget a peer (and disconnect from it)."""
        self.agent.invalidateRemoteMD(agent)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Send our metadata to a peer's listener (or to the store without ``ip_addr``)."""
        self.agent.sendLocalMD(ip_addr, port)

    def send_partial_agent_metadata(
        self,
        descs: Any,
        inc_conn_info: bool = False,
        backends: Optional[List[str]] = None,
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        """Send metadata of some registered lists to a peer or the store."""
        self.agent.sendLocalPartialMD(
            descs, inc_conn_info, self._backend_handles(backends), ip_addr, port, label
        )

    def fetch_remote_metadata(
        self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        """Ask a peer's listener (or the store) for its metadata; poll
        ``check_remote_metadata``."""
        self.agent.fetchRemoteMD(remote_agent, ip_addr, port, label)

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Withdraw our metadata from a peer (or the store)."""
        self.agent.invalidateLocalMD(ip_addr, port)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        """Whether ``agent``'s metadata is loaded (and covers ``descs``, if given)."""
        return self.agent.checkRemoteMD(agent, descs) == _bindings.NIXL_SUCCESS

    # ------------------------------------------------------------ descriptor lists
    @staticmethod
    def _tensor_rows(tensors: List[Any]) -> Optional[Tuple[np.ndarray, str]]:
        device = tensors[0].device
        rows = np.zeros((len(tensors), 3), dtype=np.uint64)
        for i, t in enumerate(tensors):
            if t.device != device:
                logger.error("all tensors of one list must be on one device")
                return None
            if not t.is_contiguous():
                logger.error("tensors must be contiguous")
                return None
            dev = t.get_device()
            rows[i] = (t.data_ptr(), t.numel() * t.element_size(), 0 if dev < 0 else dev)
        return rows, ("DRAM" if tensors[0].get_device() < 0 else "VRAM")

    def _from_tensors(self, descs: Any, cls: type) -> Any:
        tensors = [descs] if _torch_tensor(descs) else list(descs)
        got = self._tensor_rows(tensors)
        if got is None:
            return None
        rows, mem = got
        out = cls(self.nixl_mems[mem], rows)
        out._keep = tensors
        return out

    def get_xfer_descs(self, descs: Any, mem_type: Optional[str] = None) -> Any:
        """A ``nixlXferDList`` from ``(addr, len, dev)`` tuples or an (N, 3) array
        (both with ``mem_type``), a tensor or a list of tensors, or a
        ``nixlXferDList`` (returned as is). ``None`` for anything else."""
        if isinstance(descs, _bindings.nixlXferDList):
            return descs
        if isinstance(descs, _bindings.nixlRegDList):
            logger.error("a registration list was given where a transfer list is needed")
            return None
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("mem_type is needed with an array of descriptors")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("an (N, 3) array is needed for a transfer list")
                return None
            return _bindings.nixlXferDList(self.nixl_mems[mem_type], descs)
        if _torch_tensor(descs) or (
            isinstance(descs, (list, tuple)) and descs and _torch_tensor(descs[0])
        ):
            return self._from_tensors(descs, _bindings.nixlXferDList)
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("mem_type is needed with descriptor tuples")
                return None
            if len(descs[0]) != 3:
                logger.error("a transfer list takes (addr, len, dev) 3-tuples")
                return None
            return _bindings.nixlXferDList(self.nixl_mems[mem_type], list(descs))
        return None

    def get_remote_descs(self, descs: Any, mem_type: Optional[str] = None) -> Any:
        """A ``nixlRemoteDList`` from ``(addr, len, dev, agent_name)`` tuples with
        ``mem_type``, or one given. ``None`` for anything else."""
        if isinstance(descs, _bindings.nixlRemoteDList):
            return descs
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("mem_type is needed with descriptor tuples")
                return None
            if len(descs[0]) != 4:
                logger.error("a remote list takes (addr, len, dev, agent_name) 4-tuples")
                return None
            return _bindings.nixlRemoteDList(self.nixl_mems[mem_type], list(descs))
        return None

    def get_reg_descs(self, descs: Any, mem_type: Optional[str] = None) -> Any:
        """A ``nixlRegDList`` from ``(addr, len, dev, meta)`` tuples or an (N, 3) array
        (both with ``mem_type``), a tensor or a list of tensors, or a ``nixlRegDList``
        (returned as is). ``None`` for anything else. Tensors are kept alive by the list
        (and, once registered, by the agent until deregistered)."""
        if isinstance(descs, _bindings.nixlRegDList):
            return descs
        if isinstance(descs, _bindings.nixlXferDList):
            logger.error("a transfer list was given where a registration list is needed")
            return None
        if isinstance(descs, np.ndarray):
            if mem_type is None:
                logger.error("mem_type is needed with an array of descriptors")
                return None
            if descs.ndim != 2 or descs.shape[1] != 3:
                logger.error("an (N, 3) array is needed for a registration list")
                return None
            return _bindings.nixlRegDList(self.nixl_mems[mem_type], descs)
        if _torch_tensor(descs) or (
            isinstance(descs, (list, tuple)) and descs and _torch_tensor(descs[0])
        ):
            return self._from_tensors(descs, _bindings.nixlRegDList)
        if isinstance(descs, (list, tuple)) and descs and isinstance(descs[0], tuple):
            if mem_type is None:
                logger.error("mem_type is needed with descriptor tuples")
                return None
            if len(descs[0]) != 4:
                logger.error("a registration list takes (addr, len, dev, meta) 4-tuples")
                return None
            return _bindings.nixlRegDList(self.nixl_mems[mem_type], list(descs))
        return None

    def get_serialized_descs(self, descs: Any) -> bytes:
        """A descriptor list as bytes (pickle, as NIXL)."""
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes) -> Any:
        """The list ``get_serialized_descs`` gave (pickle: only from a trusted peer)."""
        return pickle.loads(serialized_descs)

    # ------------------------------------------------------------ Ferry's additions
    def metrics(self) -> Dict[str, Any]:
        """The agent's metrics (see ``ferry.Agent.metrics``)."""
        return self.agent.ferry.metrics()
