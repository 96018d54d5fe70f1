"""Typed errors of the KV pool. Each message says what happened and what to do about it.

Lack of memory is not an error on the allocation path: :meth:`KVPool.alloc` returns a falsy
:class:`~kvshare.runtime.pool.Exhausted` instead. The exceptions here are for bad
configuration, bad input, broken backends and failed tensor-parallel peers.
"""

from __future__ import annotations


class PoolError(Exception):
    """Base class of every error the KV pool raises."""


class GeometryError(PoolError, ValueError):
    """The KV geometry cannot be served (e.g. a block larger than a page)."""


class InvalidBlockError(PoolError, ValueError):
    """``free`` got a block id that is not allocated (double free, null block, out of range)."""


class PoolClosedError(PoolError):
    """The pool was closed; nothing can be allocated from it any more."""


class BackendError(PoolError):
    """A virtual-memory backend call failed."""


class BackendUnavailableError(BackendError):
    """The backend cannot run on this machine (e.g. no CUDA driver); the reason says why."""


class AddressOutOfRangeError(BackendError):
    """An address range is not inside a live reservation, or not aligned to the granularity.

    Refused before any system call: a fixed mapping outside the reservation would silently
    replace whatever the process has mapped there.
    """


class AlreadyMappedError(BackendError):
    """A page was mapped at an address that already has one (a duplicate map)."""


class OutOfDeviceMemoryError(BackendError):
    """The device has no physical memory left for a new page."""


class MapCountExceededError(BackendError):
    """The kernel refused another mapping: ``vm.max_map_count`` is reached."""


class PeerError(PoolError):
    """A tensor-parallel peer failed, timed out or went away; its pages are not in step."""
