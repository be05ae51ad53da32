"""NIXL 1.5.1's ``nixl._bindings`` names, on Ferry.

NIXL's ``_bindings`` is its C++ agent seen from Python; this module gives the same
names (enums, descriptor lists, ``nixlAgent``, ``nixlAgentConfig``, the exception
classes, ``nixlXferTelemetry``) over a ``ferry.Agent``. ``ferry.nixl._api`` (NIXL's
``nixl_agent``) is written against it, and so is code that uses the bindings directly.

What differs from NIXL is listed in ``engine/python/README.md`` ("ferry.nixl").
"""

from __future__ import annotations

import enum
import itertools
import math
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ferry import _ferry

# ---------------------------------------------------------------------------- enums


class nixl_mem_t(enum.IntEnum):
    """Memory kinds (NIXL's segment types)."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


class nixl_xfer_op_t(enum.IntEnum):
    """Transfer direction."""

    NIXL_READ = 0
    NIXL_WRITE = 1


class nixl_status_t(enum.IntEnum):
    """Status codes."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9


class nixl_thread_sync_t(enum.IntEnum):
    """Thread-synchronisation modes. Ferry's agent is always safe to share between
    threads (one lock around each flush), so every mode behaves as STRICT; the value
    is kept on the config for callers that read it back."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 0  # an alias of NONE, as in NIXL


class nixl_cost_t(enum.IntEnum):
    """How an estimate was made."""

    NIXL_COST_ANALYTICAL_BACKEND = 0


DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG
NIXL_READ = nixl_xfer_op_t.NIXL_READ
NIXL_WRITE = nixl_xfer_op_t.NIXL_WRITE
NIXL_IN_PROG = nixl_status_t.NIXL_IN_PROG
NIXL_SUCCESS = nixl_status_t.NIXL_SUCCESS
NIXL_ERR_NOT_POSTED = nixl_status_t.NIXL_ERR_NOT_POSTED
NIXL_ERR_INVALID_PARAM = nixl_status_t.NIXL_ERR_INVALID_PARAM
NIXL_ERR_BACKEND = nixl_status_t.NIXL_ERR_BACKEND
NIXL_ERR_NOT_FOUND = nixl_status_t.NIXL_ERR_NOT_FOUND
NIXL_ERR_MISMATCH = nixl_status_t.NIXL_ERR_MISMATCH
NIXL_ERR_NOT_ALLOWED = nixl_status_t.NIXL_ERR_NOT_ALLOWED
NIXL_ERR_REPOST_ACTIVE = nixl_status_t.NIXL_ERR_REPOST_ACTIVE
NIXL_ERR_UNKNOWN = nixl_status_t.NIXL_ERR_UNKNOWN
NIXL_ERR_NOT_SUPPORTED = nixl_status_t.NIXL_ERR_NOT_SUPPORTED
NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT
NIXL_COST_ANALYTICAL_BACKEND = nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND

#: Port of the metadata listener when none is given.
DEFAULT_COMM_PORT = 8888
#: The local agent's name in ``prepXferDlist``.
NIXL_INIT_AGENT = ""
#: Ferry has no device-initiated API (``prep_mem_view``).
HAVE_UCX_GPU_DEVICE_API = False

#: Ferry's memory-kind names, by segment type.
MEM_NAMES = {
    nixl_mem_t.DRAM_SEG: "DRAM",
    nixl_mem_t.VRAM_SEG: "VRAM",
    nixl_mem_t.BLK_SEG: "BLOCK",
    nixl_mem_t.OBJ_SEG: "OBJECT",
    nixl_mem_t.FILE_SEG: "FILE",
}

# ---------------------------------------------------------------------------- errors
# NIXL's class per status. Where Ferry has the status, the class *is* Ferry's, so an
# `except nixlNotFoundError` catches what Ferry raises (and `except ferry.FerryError`
# catches all of them).

nixlInvalidParamError = _ferry.InvalidParamError
nixlBackendError = _ferry.BackendError
nixlNotFoundError = _ferry.NotFoundError
nixlMismatchError = _ferry.MismatchError
nixlNotAllowedError = _ferry.NotAllowedError
nixlRepostActiveError = _ferry.RepostActiveError
nixlNotSupportedError = _ferry.NotSupportedError
nixlRemoteDisconnectError = _ferry.RemoteDisconnectError
nixlCancelledError = _ferry.CanceledError
nixlNoTelemetryError = _ferry.NoTelemetryError


class nixlNotPostedError(_ferry.FerryError):
    """The request was never posted (``NIXL_ERR_NOT_POSTED``)."""

    status = "NOT_POSTED"


class nixlUnknownError(_ferry.FerryError):
    """An error without a more precise status (``NIXL_ERR_UNKNOWN``)."""

    status = "UNKNOWN"


# ---------------------------------------------------------------------------- lists


def _mem(value: Any) -> nixl_mem_t:
    try:
        return nixl_mem_t(int(value))
    except (TypeError, ValueError):
        raise TypeError(f"a memory type (nixl_mem_t) is needed, not {value!r}") from None


def _meta_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, int):
        return str(value).encode()
    raise TypeError(f"descriptor metadata must be str or bytes, not {type(value).__name__}")


def _rows(descs: Any, width: int, what: str) -> Tuple[np.ndarray, list]:
    """(N, 3) uint64 rows and the extra column (metadata or agent names) of a list of
    ``width``-tuples or an (N, 3) array."""
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise ValueError(f"{what}: an (N, 3) array of (addr, len, dev) rows is needed")
        rows = np.ascontiguousarray(descs, dtype=np.uint64)
        return rows, [b"" if width == 4 else ""] * rows.shape[0]
    items = descs if isinstance(descs, list) else list(descs)
    extra: list = []
    if not items:
        return np.zeros((0, 3), dtype=np.uint64), extra
    if width == 3:
        # One conversion for the whole list (NIXL's desc_perf builds 1.5 M of them);
        # anything not N rows of 3 integers fails here or in the shape check.
        try:
            rows = np.array(items, dtype=np.uint64)
        except (TypeError, ValueError, OverflowError):
            rows = None
        if rows is None or rows.ndim != 2 or rows.shape[1] != 3:
            raise ValueError(f"{what}: every descriptor must be an (addr, len, dev) 3-tuple")
        return rows, extra
    for t in items:
        if not isinstance(t, tuple) or len(t) != width:
            raise ValueError(f"{what}: every descriptor must be a {width}-tuple, got {t!r}")
    rows = np.array([t[:3] for t in items], dtype=np.uint64)
    extra = [t[3] for t in items]
    return rows, extra


class _DList:
    """A descriptor list of one memory kind: (addr, len, dev) rows in an (N, 3)
    ``uint64`` array, plus one extra item per row for the kinds that have one."""

    _width = 3
    _what = "descriptor list"

    def __init__(self, type: Any, descs: Any = 0) -> None:  # noqa: A002 (NIXL's name)
        self._type = _mem(type)
        if isinstance(descs, (int, np.integer)) and not isinstance(descs, bool):
            self._rows = np.zeros((0, 3), dtype=np.uint64)
            self._extra: list = []
        else:
            self._rows, self._extra = _rows(descs, self._width, self._what)
            self._extra = [self._convert_extra(e) for e in self._extra]

    @staticmethod
    def _convert_extra(value: Any) -> Any:
        return value

    # NIXL's methods
    def descCount(self) -> int:
        """Number of descriptors."""
        return int(self._rows.shape[0])

    def getType(self) -> nixl_mem_t:
        """The memory kind."""
        return self._type

    def isEmpty(self) -> bool:
        """Whether it has no descriptors."""
        return self._rows.shape[0] == 0

    def _row(self, i: int) -> tuple:
        r = self._rows[i]
        t = (int(r[0]), int(r[1]), int(r[2]))
        return t + (self._extra[i],) if self._width == 4 else t

    def __getitem__(self, i: int) -> tuple:
        n = self.descCount()
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("descriptor index out of range")
        return self._row(i)

    def __iter__(self):
        return (self._row(i) for i in range(self.descCount()))

    def addDesc(self, desc: tuple) -> None:
        """Append one descriptor."""
        rows, extra = _rows([desc], self._width, self._what)
        self._rows = np.concatenate([self._rows, rows])
        self._extra += [self._convert_extra(e) for e in extra]

    append = addDesc

    def remDesc(self, index: int) -> None:
        """Remove the descriptor at ``index``."""
        if not 0 <= index < self.descCount():
            raise IndexError("descriptor index out of range")
        self._rows = np.delete(self._rows, index, axis=0)
        if self._extra:
            del self._extra[index]

    def clear(self) -> None:
        """Remove every descriptor."""
        self._rows = np.zeros((0, 3), dtype=np.uint64)
        self._extra = []

    def index(self, desc: tuple) -> int:
        """Position of the first descriptor equal to ``desc`` (its first three items)."""
        want = tuple(int(x) for x in desc[:3])
        hits = np.nonzero((self._rows == np.array(want, dtype=np.uint64)).all(axis=1))[0]
        if hits.size == 0:
            raise ValueError(f"{desc!r} is not in the list")
        return int(hits[0])

    def print(self) -> None:
        """Print the list."""
        print(f"DescList of mem type {int(self._type)}")
        for i in range(self.descCount()):
            print(f"  {self._row(i)}")

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and other._type == self._type  # type: ignore[attr-defined]
            and np.array_equal(other._rows, self._rows)  # type: ignore[attr-defined]
            and other._extra == self._extra  # type: ignore[attr-defined]
        )

    __hash__ = None  # type: ignore[assignment]

    def __getstate__(self) -> Dict[str, Any]:
        # What keeps tensors alive stays here: a pickled list names memory, it owns none.
        state = dict(self.__dict__)
        state.pop("_keep", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._type.name}, {self.descCount()} descriptors)"

    # Ferry's side
    def _key(self) -> bytes:
        """What identifies the list's memory (kind and rows), for lookups."""
        return bytes([int(self._type)]) + self._rows.tobytes()


class nixlXferDList(_DList):
    """Descriptors of memory to transfer: ``(addr, len, dev)``."""

    _what = "transfer descriptor list"


class nixlRegDList(_DList):
    """Descriptors of memory to register: ``(addr, len, dev, meta)``; ``meta`` (str
    or bytes, kept as bytes) is a FILE's path, empty otherwise."""

    _width = 4
    _what = "registration descriptor list"
    _convert_extra = staticmethod(_meta_bytes)

    def trim(self) -> nixlXferDList:
        """The same descriptors without their metadata, as a transfer list."""
        out = nixlXferDList(self._type)
        out._rows = self._rows.copy()
        return out


class nixlRemoteDList(_DList):
    """Descriptors of a peer's memory: ``(addr, len, dev, agent_name)``."""

    _width = 4
    _what = "remote descriptor list"

    @staticmethod
    def _convert_extra(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------- config


class nixlAgentConfig:
    """How ``nixlAgent`` is built (NIXL's fields; the delays and the etcd timeout are
    kept but unused: Ferry's progress thread sleeps on the transport's events and its
    listener is event-driven)."""

    def __init__(
        self,
        useProgThread: bool = False,
        useListenThread: bool = False,
        listenPort: int = DEFAULT_COMM_PORT,
        syncMode: Any = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE,
        captureTelemetry: bool = False,
        pthrDelay: int = 0,
        lthrDelay: int = 100000,
    ) -> None:
        self.useProgThread = useProgThread
        self.useListenThread = useListenThread
        self.listenPort = listenPort
        self.syncMode = syncMode
        self.captureTelemetry = captureTelemetry
        self.pthrDelay = pthrDelay
        self.lthrDelay = lthrDelay
        self.etcdWatchTimeout = 5.0


class nixlXferTelemetry:
    """Telemetry of one request, in NIXL's units: ``startTime`` (µs since the Unix
    epoch), ``postDuration`` and ``xferDuration`` (µs, a nonzero duration rounded up
    to 1), ``totalBytes`` and ``descCount`` (as given, before Ferry merges adjacent
    ranges)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, ferry_telemetry: Dict[str, Any]) -> None:
        t = ferry_telemetry
        self.startTime = (t.get("startUnixNs") or 0) // 1000
        self.postDuration = math.ceil(t["postDurationNs"] / 1000)
        self.xferDuration = math.ceil(t["xferDurationNs"] / 1000)
        self.totalBytes = t["totalBytes"]
        # NIXL counts the request's descriptors as given (its test makes two adjacent
        # halves of one buffer and expects 2); Ferry merges them into one range.
        self.descCount = t["descCountUnmerged"]

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)}" for k in self.__slots__)
        return f"nixlXferTelemetry({fields})"


def _telemetry_enabled(capture: bool) -> bool:
    """NIXL's rule: ``NIXL_TELEMETRY_ENABLE`` decides when set, else the config."""
    env = os.environ.get("NIXL_TELEMETRY_ENABLE")
    if env is None:
        return bool(capture)
    return env.strip().lower() in ("y", "yes", "1", "true", "on")


def _name(agent: Union[str, bytes]) -> str:
    """An agent name given as str or bytes (``loadRemoteMD`` returns bytes, as NIXL's
    does, and callers pass that back)."""
    return agent.decode() if isinstance(agent, (bytes, bytearray)) else agent


def _bytes(msg: Union[str, bytes, None]) -> bytes:
    if msg is None:
        return b""
    if isinstance(msg, str):
        return msg.encode()
    return bytes(msg)


class _Xfer:
    """A request as the compatibility layer sees it: Ferry's handle and how to make it
    again (a notification given at ``postXferReq`` that differs from the one it was
    made with re-makes it; Ferry attaches notifications when a request is made)."""

    __slots__ = ("handle", "notif", "remake")

    def __init__(self, handle: Any, notif: bytes, remake: Any) -> None:
        self.handle = handle
        self.notif = notif
        self.remake = remake


# ---------------------------------------------------------------------------- agent


class nixlAgent:
    """NIXL's C++ agent methods over a ``ferry.Agent`` (``.ferry``).

    Handles are integers, as in NIXL. Backends are created one by one with
    ``createBackend``; a second agent with the same name is allowed (NIXL allows it).
    """

    def __init__(self, name: str, config: Optional[nixlAgentConfig] = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("the agent name must be a non-empty string")
        config = config or nixlAgentConfig()
        self.name = name
        self.config = config
        self.telemetry = _telemetry_enabled(config.captureTelemetry)
        self.ferry = _ferry.Agent(
            name,
            _ferry.AgentConfig(
                enable_prog_thread=bool(config.useProgThread),
                enable_listen_thread=bool(config.useListenThread),
                listen_port=int(config.listenPort),
                backends=[],
                name_policy="shared",
            ),
        )
        # Handles come from counters whose next() is atomic under the GIL, so threads
        # sharing the agent (vLLM's handshake thread) never get the same one.
        self._backends: Dict[int, str] = {}
        self._backend_ids = itertools.count(1)
        self._preps: Dict[int, Any] = {}
        self._xfers: Dict[int, _Xfer] = {}
        self._handle_ids = itertools.count(1)
        # Registered lists by content (kind + rows), for deregistration and partial
        # metadata from a list equal to the one registered.
        self._registered: Dict[bytes, List[Any]] = {}

    # -- plugins and backends
    def getAvailPlugins(self) -> List[str]:
        return list(self.ferry.get_plugin_list())

    def getPluginParams(self, plugin: str) -> Tuple[Dict[str, str], List[str]]:
        return (
            dict(self.ferry.get_plugin_params(plugin)),
            list(self.ferry.get_plugin_mem_types(plugin)),
        )

    def createBackend(self, backend: str, params: Optional[Dict[str, str]] = None) -> int:
        params = {str(k): str(v) for k, v in (params or {}).items()}
        # NIXL's UCX takes num_threads (worker threads); Ferry's UCX sizes its own.
        params.pop("num_threads", None)
        # NIXL's `useProgThread` is the backend's own progress thread in Ferry.
        if "progress_thread" not in params:
            known = self.ferry.get_plugin_params(backend)
            if "progress_thread" in known:
                params["progress_thread"] = "true" if self.config.useProgThread else "false"
        self.ferry.create_backend(backend, params)
        handle = next(self._backend_ids)
        self._backends[handle] = backend
        return handle

    def getBackendParams(self, handle: int) -> Tuple[Dict[str, str], List[str]]:
        name = self._backend_name(handle)
        return (
            dict(self.ferry.get_backend_params(name)),
            list(self.ferry.get_backend_mem_types(name)),
        )

    def _backend_name(self, handle: int) -> str:
        try:
            return self._backends[handle]
        except KeyError:
            raise nixlNotFoundError(f"no backend with handle {handle}") from None

    # -- memory
    def registerMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> None:
        if not isinstance(descs, nixlRegDList):
            raise TypeError("registerMem needs a nixlRegDList")
        for b in backends:
            self._backend_name(b)
        mem = MEM_NAMES[descs.getType()]
        if descs.getType() == FILE_SEG and any(descs._extra):
            ferry_descs: Any = [
                (int(r[0]), int(r[1]), int(r[2]), m.decode() or None)
                for r, m in zip(descs._rows, descs._extra)
            ]
        else:
            ferry_descs = descs._rows
        keep = getattr(descs, "_keep", None)
        registered = self.ferry.register_memory(ferry_descs, mem)
        self._registered.setdefault(descs._key(), []).append((registered, keep))

    def deregisterMem(self, descs: nixlRegDList, backends: Sequence[int] = ()) -> None:
        for b in backends:
            self._backend_name(b)
        entries = self._registered.get(descs._key())
        if not entries:
            raise nixlNotFoundError("these descriptors are not registered (as one list)")
        registered, _keep = entries[-1]
        self.ferry.deregister_memory(registered)
        entries.pop()
        if not entries:
            del self._registered[descs._key()]

    def queryMem(self, descs: nixlRegDList, backend: int) -> List[Optional[Dict[str, str]]]:
        name = self._backend_name(backend)
        mem = MEM_NAMES[descs.getType()]
        items = [
            (int(r[0]), int(r[1]), int(r[2]), m.decode() if m else None)
            for r, m in zip(descs._rows, descs._extra)
        ]
        if not items:
            return []
        # NIXL's answers are strings: size, mode, mtime (whole seconds).
        return [
            None
            if r is None
            else {"size": str(r["size"]), "mode": str(r["mode"]), "mtime": str(r["mtime_ns"] // 10**9)}
            for r in self.ferry.query_memory(items, name, mem)
        ]

    # -- prepared lists and requests
    def _handle(self) -> int:
        return next(self._handle_ids)

    def prepXferDlist(self, agent_name: str, descs: nixlXferDList, backends: Sequence[int] = ()) -> int:
        if not isinstance(descs, nixlXferDList):
            raise TypeError("prepXferDlist needs a nixlXferDList")
        for b in backends:
            self._backend_name(b)
        agent_name = _name(agent_name)
        side = "NIXL_INIT_AGENT" if agent_name == NIXL_INIT_AGENT else agent_name
        prep = self.ferry.prep_xfer_dlist(side, descs._rows, MEM_NAMES[descs.getType()])
        h = self._handle()
        self._preps[h] = prep
        return h

    def releasedDlistH(self, handle: int) -> None:
        prep = self._preps.pop(handle, None)
        if prep is None:
            raise nixlNotFoundError(f"no prepared list with handle {handle}")
        self.ferry.release_dlist_handle(prep)

    def _prep(self, handle: int) -> Any:
        try:
            return self._preps[int(handle)]
        except KeyError:
            raise nixlNotFoundError(f"no prepared list with handle {handle}") from None

    def makeXferReq(
        self,
        op: nixl_xfer_op_t,
        local_handle: int,
        local_indices: Any,
        remote_handle: int,
        remote_indices: Any,
        notif_msg: Union[str, bytes] = b"",
        backends: Sequence[int] = (),
        skip_desc_merge: bool = False,
    ) -> int:
        for b in backends:
            self._backend_name(b)
        operation = "READ" if op == NIXL_READ else "WRITE"
        local, remote = self._prep(local_handle), self._prep(remote_handle)
        li, ri = local_indices, remote_indices

        def make(notif: bytes) -> Any:
            return self.ferry.make_prepped_xfer(operation, local, li, remote, ri, notif)

        notif = _bytes(notif_msg)
        h = self._handle()
        self._xfers[h] = _Xfer(make(notif), notif, make)
        return h

    def createXferReq(
        self,
        op: nixl_xfer_op_t,
        local_descs: nixlXferDList,
        remote_descs: nixlXferDList,
        remote_agent: str,
        notif_msg: Union[str, bytes] = b"",
        backends: Sequence[int] = (),
    ) -> int:
        for b in backends:
            self._backend_name(b)
        if not isinstance(local_descs, nixlXferDList) or not isinstance(remote_descs, nixlXferDList):
            raise TypeError("createXferReq needs two nixlXferDList")
        operation = "READ" if op == NIXL_READ else "WRITE"
        remote_agent = _name(remote_agent)
        local = (local_descs._rows, MEM_NAMES[local_descs.getType()])
        remote = (remote_descs._rows, MEM_NAMES[remote_descs.getType()])

        def make(notif: bytes) -> Any:
            lp = self.ferry.prep_xfer_dlist("NIXL_INIT_AGENT", local[0], local[1])
            try:
                rp = self.ferry.prep_xfer_dlist(remote_agent, remote[0], remote[1])
            except BaseException:
                self.ferry.release_dlist_handle(lp)
                raise
            try:
                return self.ferry.make_prepped_xfer(operation, lp, [], rp, [], notif)
            finally:
                self.ferry.release_dlist_handle(lp)
                self.ferry.release_dlist_handle(rp)

        notif = _bytes(notif_msg)
        h = self._handle()
        self._xfers[h] = _Xfer(make(notif), notif, make)
        return h

    def _xfer(self, handle: int) -> _Xfer:
        try:
            return self._xfers[int(handle)]
        except KeyError:
            raise nixlNotFoundError(f"no transfer request with handle {handle}") from None

    def postXferReq(self, handle: int, notif_msg: Union[str, bytes, None] = b"") -> nixl_status_t:
        x = self._xfer(handle)
        notif = _bytes(notif_msg)
        if notif and notif != x.notif:
            # Ferry attaches a notification when a request is made: make it again with
            # this one (refused, like a repost, while the old one is in flight).
            new = x.remake(notif)
            try:
                self.ferry.release_xfer_handle(x.handle)
            except BaseException:
                self.ferry.release_xfer_handle(new)
                raise
            x.handle, x.notif = new, notif
        state = self.ferry.transfer(x.handle)
        return NIXL_SUCCESS if state == "DONE" else NIXL_IN_PROG

    def getXferStatus(self, handle: int) -> nixl_status_t:
        state = self.ferry.check_xfer_state(self._xfer(handle).handle)
        if state == "DONE":
            return NIXL_SUCCESS
        if state == "PROC":
            return NIXL_IN_PROG
        raise nixlNotPostedError("the request was not posted")

    def releaseXferReq(self, handle: int) -> None:
        x = self._xfer(handle)
        self.ferry.release_xfer_handle(x.handle)
        del self._xfers[int(handle)]

    def getXferTelemetry(self, handle: int) -> nixlXferTelemetry:
        x = self._xfer(handle)
        if not self.telemetry:
            raise nixlNoTelemetryError(
                "telemetry is off (capture_telemetry=False, or NIXL_TELEMETRY_ENABLE says no)"
            )
        return nixlXferTelemetry(self.ferry.get_xfer_telemetry(x.handle))

    def estimateXferCost(self, handle: int) -> Tuple[int, int, Union[nixl_cost_t, str]]:
        duration, margin, method = self.ferry.estimate_xfer_cost(self._xfer(handle).handle)
        return duration, margin, (
            nixl_cost_t.NIXL_COST_ANALYTICAL_BACKEND if method == "ANALYTICAL_BACKEND" else method
        )

    def queryXferBackend(self, handle: int) -> int:
        # Ferry picks a backend per peer at post time; with one backend it is that one.
        self._xfer(handle)
        if len(self._backends) == 1:
            return next(iter(self._backends))
        raise nixlNotSupportedError("query_xfer_backend with more than one backend")

    # -- notifications
    def getNotifs(self, notifs: Dict[str, List[bytes]], backends: Sequence[int] = ()) -> Dict[str, List[bytes]]:
        for b in backends:
            self._backend_name(b)
        for name, msgs in self.ferry.get_new_notifs().items():
            notifs.setdefault(name, []).extend(msgs)
        return notifs

    def genNotif(self, remote_agent: str, msg: Union[str, bytes], backend: Optional[int] = None) -> None:
        if backend is not None:
            self._backend_name(backend)
        self.ferry.send_notif(_name(remote_agent), _bytes(msg))

    # -- metadata
    def getLocalMD(self) -> bytes:
        return bytes(self.ferry.get_agent_metadata())

    def _registered_list(self, descs: Optional[nixlRegDList]) -> Any:
        if descs is None or descs.isEmpty():
            return None
        entries = self._registered.get(descs._key())
        if not entries:
            raise nixlNotFoundError("partial metadata: these descriptors are not registered (as one list)")
        return entries[-1][0]

    def getLocalPartialMD(self, descs: nixlRegDList, inc_conn_info: bool, backends: Sequence[int] = ()) -> bytes:
        for b in backends:
            self._backend_name(b)
        return bytes(
            self.ferry.get_partial_agent_metadata(self._registered_list(descs), bool(inc_conn_info))
        )

    def loadRemoteMD(self, metadata: bytes) -> bytes:
        return self.ferry.add_remote_agent(bytes(metadata)).encode()

    def invalidateRemoteMD(self, agent: str) -> None:
        self.ferry.remove_remote_agent(_name(agent))

    def makeConnection(self, agent: str, backends: Sequence[int] = ()) -> None:
        for b in backends:
            self._backend_name(b)
        self.ferry.make_connection(_name(agent))

    def sendLocalMD(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.ferry.send_local_metadata(ip_addr or None, int(port))

    def sendLocalPartialMD(
        self,
        descs: nixlRegDList,
        inc_conn_info: bool,
        backends: Sequence[int] = (),
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        for b in backends:
            self._backend_name(b)
        self.ferry.send_partial_agent_metadata(
            self._registered_list(descs),
            bool(inc_conn_info),
            None,
            ip_addr or None,
            int(port),
            label or "partial",
        )

    def fetchRemoteMD(self, agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = "") -> None:
        self.ferry.fetch_remote_metadata(_name(agent), ip_addr or None, int(port), label or None)

    def checkRemoteMD(self, agent: str, descs: Optional[nixlXferDList] = None) -> nixl_status_t:
        agent = _name(agent)
        if descs is not None and not descs.isEmpty():
            # A Ferry list carries the memory kind (raw rows would be read as DRAM).
            rows = self.ferry.get_xfer_descs(descs._rows, MEM_NAMES[descs.getType()])
            ready = self.ferry.check_remote_metadata(agent, rows)
        else:
            ready = self.ferry.check_remote_metadata(agent)
        return NIXL_SUCCESS if ready else nixl_status_t.NIXL_ERR_NOT_FOUND

    def invalidateLocalMD(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        self.ferry.invalidate_local_metadata(ip_addr or None, int(port))

    def prepMemView(self, *args: Any, **kwargs: Any) -> int:
        raise nixlNotSupportedError("prep_mem_view (Ferry has no device-initiated API)")

    def releaseMemView(self, *args: Any, **kwargs: Any) -> None:
        raise nixlNotSupportedError("release_mem_view (Ferry has no device-initiated API)")

