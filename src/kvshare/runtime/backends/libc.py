"""The few Linux system calls the host backend needs, through ctypes.

Python's :mod:`mmap` module cannot map at a fixed address, so ``mmap``, ``munmap`` and
``fallocate`` are called from libc directly. Every function raises :class:`OSError`
with the C ``errno`` on failure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = [
    "FALLOC_FL_KEEP_SIZE",
    "FALLOC_FL_PUNCH_HOLE",
    "MAP_ANONYMOUS",
    "MAP_FIXED",
    "MAP_FIXED_NOREPLACE",
    "MAP_NORESERVE",
    "MAP_PRIVATE",
    "MAP_SHARED",
    "PROT_NONE",
    "PROT_READ",
    "PROT_WRITE",
    "fallocate",
    "map_shared_fixed",
    "mmap",
    "munmap",
    "protect_none_fixed",
]

# Linux values (identical on x86-64 and arm64).
PROT_NONE = 0x0
PROT_READ = 0x1
PROT_WRITE = 0x2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MAP_FIXED_NOREPLACE = 0x100000
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02

_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_fallocate = _libc.fallocate
_fallocate.restype = ctypes.c_int
_fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def _error(call: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{call}: {os.strerror(code)}")


def mmap(address: int, size: int, prot: int, flags: int, *, fd: int = -1, offset: int = 0) -> int:
    """``mmap(2)``; returns the mapped address."""
    result = _mmap(address or None, size, prot, flags, fd, offset)
    if result is None or result == _MAP_FAILED:
        raise _error("mmap")
    return int(result)


def munmap(address: int, size: int) -> None:
    """``munmap(2)``."""
    if _munmap(address, size) != 0:
        raise _error("munmap")


def fallocate(fd: int, mode: int, offset: int, size: int) -> None:
    """``fallocate(2)``."""
    if _fallocate(fd, mode, offset, size) != 0:
        raise _error("fallocate")


def map_shared_fixed(address: int, size: int, fd: int, offset: int) -> None:
    """Map ``fd[offset:offset+size]`` read-write and shared at exactly ``address``."""
    mmap(address, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd=fd, offset=offset)


def protect_none_fixed(address: int, size: int) -> None:
    """Replace whatever is at ``address`` by inaccessible, unbacked address space."""
    mmap(address, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE)
