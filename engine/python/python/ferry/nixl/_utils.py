"""NIXL's ``nixl._utils`` test helpers: raw memory from the C allocator."""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size: int) -> int:
    """``malloc(size)``; the address as an int (MemoryError if it fails)."""
    addr = _libc.malloc(int(size))
    if not addr:
        raise MemoryError(f"malloc({size}) failed")
    return int(addr)


def free_passthru(addr: int) -> None:
    """``free(addr)`` of an address from ``malloc_passthru``."""
    _libc.free(int(addr))


def ba_buf(addr: int, size: int) -> None:
    """Fill ``size`` bytes at ``addr`` with 0xBA."""
    ctypes.memset(int(addr), 0xBA, int(size))


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Assert that ``size`` bytes at ``addr1`` and ``addr2`` are equal."""
    a = ctypes.string_at(int(addr1), int(size))
    b = ctypes.string_at(int(addr2), int(size))
    assert a == b, "the two buffers differ"
