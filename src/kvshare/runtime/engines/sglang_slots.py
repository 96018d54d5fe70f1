"""SGLang's token and page allocators, served from a kvshare pool (every SGLang line).

The allocator's free list only ever holds pages the pool granted for the call at hand.
Before an allocation the allocator is topped up from ``KVPool.alloc`` with exactly the
pages the call needs (nothing when the pool is exhausted, so SGLang's own "no space" path
runs: evict, retract or wait); freed pages leave the free list at once and reach the pool
when their asynchronous copy to the host is done (:mod:`.host_copies`): nothing on this
path waits for the device. ``available_size`` is what the pool can hand out now plus the
pages on their way back. Allocators kvshare does not serve are refused over pool-backed
buffers, whose pages would never be mapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvshare.runtime.engines import host_copies
from kvshare.runtime.engines.patching import AnyCallable
from kvshare.runtime.engines.pools import EngineConfigError

if TYPE_CHECKING:
    import torch

    from kvshare.runtime.pool import KVPool

__all__ = [
    "attach_pool",
    "clearing_into_pool",
    "counting_the_pool",
    "decode_pages",
    "extend_pages",
    "granting",
    "hand_back",
    "only_served_allocators",
    "pool_of",
    "returning_to_pool",
    "token_pages",
]

_POOL_ATTRIBUTE = "_kvshare_pool"
_GRANTS_ATTRIBUTE = "_kvshare_grants"
_RETURNING_ATTRIBUTE = "_kvshare_returning"


def pool_of(owner: Any) -> KVPool | None:
    """The kvshare pool behind an SGLang KV cache or allocator, if it has one."""
    kvcache = getattr(owner, "_kvcache", owner)
    return getattr(kvcache, _POOL_ATTRIBUTE, None)


def attach_pool(kvcache: Any, pool: KVPool) -> None:
    """``kvcache``'s buffers live in ``pool``: its allocators take their pages from it."""
    setattr(kvcache, _POOL_ATTRIBUTE, pool)


#: Allocators whose every path to the free list is patched (by class name: the classes are
#: the engine's, imported only when patches apply).
_SERVED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")


def _pool_backed_parts(kvcache: Any) -> list[str]:
    """Names of ``kvcache``'s sub-pools whose buffers live in a kvshare pool."""
    return [name for name, part in vars(kvcache).items() if getattr(part, _POOL_ATTRIBUTE, None)]


def only_served_allocators(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``BaseTokenToKVPoolAllocator.__init__``: an allocator kvshare does not
    serve must not hand out slots of pool-backed buffers (their pages would never be
    mapped); start-up fails naming it instead."""

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        kvcache = getattr(self, "_kvcache", None)
        backed = pool_of(self) is not None or (
            kvcache is not None and bool(_pool_backed_parts(kvcache))
        )
        if backed and type(self).__name__ not in _SERVED_ALLOCATORS:
            raise EngineConfigError(
                f"kvshare does not serve SGLang's {type(self).__name__} (over "
                f"{type(kvcache).__name__}); it serves {', '.join(_SERVED_ALLOCATORS)} — "
                "hybrid, sliding-window and state-space caches are not supported"
            )

    return init


def _free_lists(allocator: Any) -> list[torch.Tensor]:
    """The allocator's free page ids: its free list and the frees waiting to be sorted."""
    lists = [allocator.free_pages]
    release = getattr(allocator, "release_pages", None)
    if release is not None and len(release):
        lists.append(release)
    lists.extend(getattr(allocator, "staged_pages", None) or ())
    return [ids for ids in lists if len(ids)]


def _held_free_pages(allocator: Any) -> int:
    return sum(len(ids) for ids in _free_lists(allocator))


def _grants(allocator: Any) -> set[int]:
    """The block ids the allocator holds from the pool (in use or on its free lists).

    A set, not a tensor indexed by id: it changes on every allocation and free, and a
    tensor's index assignment from a list of ids costs more than the rest of the hook."""
    grants: set[int] | None = getattr(allocator, _GRANTS_ATTRIBUTE, None)
    if grants is None:
        grants = set()
        setattr(allocator, _GRANTS_ATTRIBUTE, grants)
    return grants


def _returning(allocator: Any) -> list[host_copies.HostCopy]:
    """Freed pages on their way back to the pool (copies to the host, oldest first)."""
    returning: list[host_copies.HostCopy] | None = getattr(allocator, _RETURNING_ATTRIBUTE, None)
    if returning is None:
        returning = []
        setattr(allocator, _RETURNING_ATTRIBUTE, returning)
    return returning


def _returning_pages(allocator: Any) -> int:
    return sum(len(copy) for copy in getattr(allocator, _RETURNING_ATTRIBUTE, None) or ())


def hand_back(allocator: Any, pool: KVPool, *, wait: bool = False) -> None:
    """Free the pages whose copy to the host is done in the pool (all of them with ``wait``)."""
    returning = _returning(allocator)
    while returning and (wait or returning[0].done()):
        ids = returning.pop(0).values()
        _grants(allocator).difference_update(ids)
        pool.free(ids)


def _top_up(allocator: Any, pages: int) -> None:
    """Put pages granted by the pool on the free list until it holds ``pages``."""
    pool = pool_of(allocator)
    if pool is None:
        return
    hand_back(allocator, pool)
    short = pages - _held_free_pages(allocator)
    if short <= 0:
        return
    ids = pool.alloc(short)
    if not ids and _returning(allocator):
        hand_back(allocator, pool, wait=True)  # out of room: the pages on their way back
        ids = pool.alloc(short)
    if not isinstance(ids, list) or not ids:
        return  # exhausted: SGLang's own check finds too few pages and says no
    import torch

    _grants(allocator).update(ids)
    granted = host_copies.to_device(ids, allocator.free_pages)
    allocator.free_pages = torch.cat((allocator.free_pages, granted))


def _drain(allocator: Any) -> None:
    """Take every page off the allocator's free lists; each goes back to the pool once its
    copy to the host is done (never waiting for the device here)."""
    pool = pool_of(allocator)
    if pool is None:
        return
    lists = _free_lists(allocator)
    if not lists:
        return
    returning = _returning(allocator)
    returning.extend(host_copies.start_to_host(ids) for ids in lists)
    allocator.free_pages = allocator.free_pages[:0]
    if getattr(allocator, "release_pages", None) is not None:
        allocator.release_pages = allocator.release_pages[:0]
    if getattr(allocator, "staged_pages", None):
        allocator.staged_pages = []
        allocator.num_staged_pages = 0
    hand_back(allocator, pool)


def clearing_into_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``clear``: every page goes back to the pool; the free list starts empty."""

    def clear(self: Any) -> None:
        original(self)
        pool = pool_of(self)
        if pool is None:
            return
        _returning(self).clear()  # still granted: freed with the rest below
        grants = _grants(self)
        held = sorted(grants)
        grants.clear()
        self.free_pages = self.free_pages[:0]
        if getattr(self, "release_pages", None) is not None:
            self.release_pages = self.release_pages[:0]
        if held:
            pool.free(held)

    return clear


def counting_the_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for ``available_size``: the free list plus what the pool can grant now."""

    def available_size(self: Any) -> int:
        pool = pool_of(self)
        own = int(original(self))
        if pool is None:
            return own
        return own + (pool.available() + _returning_pages(self)) * int(self.page_size)

    return available_size


def granting(pages_needed: Callable[..., int]) -> Callable[[AnyCallable], AnyCallable]:
    """Wrapper for an allocation: top up with the pages it needs, run SGLang's own code,
    give back whatever it did not take."""

    def wrap(original: AnyCallable) -> AnyCallable:
        def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
            if pool_of(self) is None:
                return original(self, *args, **kwargs)
            _top_up(self, pages_needed(self, *args, **kwargs))
            try:
                return original(self, *args, **kwargs)
            finally:
                _drain(self)

        return allocate

    return wrap


def returning_to_pool(original: AnyCallable) -> AnyCallable:
    """Wrapper for where freed pages land: they go back to the pool at once."""

    def release(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _drain(self)
        return result

    return release


def token_pages(self: Any, need_size: int) -> int:
    """Pages ``alloc(need_size)`` takes (a page is ``page_size`` tokens)."""
    return -(-int(need_size) // int(self.page_size))


def extend_pages(  # noqa: PLR0917 - SGLang's alloc_extend parameters, as it passes them
    self: Any,
    prefix_lens: Any,
    prefix_lens_cpu: Any,
    seq_lens: Any,
    seq_lens_cpu: Any,
    last_loc: Any,
    extend_num_tokens: int,
    num_new_pages: int | None = None,
) -> int:
    """New pages an ``alloc_extend`` takes, as SGLang counts them."""
    if num_new_pages is not None:
        return int(num_new_pages)
    from sglang.srt.utils import get_num_new_pages

    return int(
        get_num_new_pages(
            seq_lens=seq_lens_cpu, page_size=self.page_size, prefix_lens=prefix_lens_cpu
        )
    )


def decode_pages(self: Any, seq_lens: Any, seq_lens_cpu: Any, last_loc: Any) -> int:
    """New pages an ``alloc_decode`` takes, as SGLang counts them."""
    from sglang.srt.utils import get_num_new_pages

    return int(get_num_new_pages(seq_lens=seq_lens_cpu, page_size=self.page_size, decode=True))
