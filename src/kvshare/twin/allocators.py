"""The block allocators of the worlds without a broker: one pool of bytes that every
engine takes blocks from at once (the pooled bound), and first-come pages (kvcached).

Models on one GPU may have blocks of different sizes (Llama-3.1-8B's 2 MiB, Qwen3-8B's
2.25 MiB), so both count the GPU's KV budget in bytes. Block ids are per engine; an
engine never sees another's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvshare.demo.blocks import ModelShare

__all__ = ["FirstComePages", "SharedBytes"]


class SharedBytes:
    """One budget of bytes; an engine's block takes its block size from it at once and
    gives it back when freed (the pooled bound: no pages, no leases, first come)."""

    def __init__(self, budget_bytes: int, block_bytes: Sequence[int]) -> None:
        self.free_bytes = budget_bytes
        self._block_bytes = list(block_bytes)
        self._next_id = [1] * len(block_bytes)  # 0 is every engine's null block
        self._recycled: list[list[int]] = [[] for _ in block_bytes]

    def view(self, model: int) -> ModelShare:
        """The allocator engine ``model`` uses."""
        return ModelShare(self, model)

    def alloc(self, model: int, n: int) -> list[int] | None:
        cost = n * self._block_bytes[model]
        if cost > self.free_bytes:
            return None
        self.free_bytes -= cost
        recycled = self._recycled[model]
        taken = recycled[-n:] if n <= len(recycled) else list(recycled)
        del recycled[len(recycled) - len(taken) :]
        fresh = n - len(taken)
        start = self._next_id[model]
        self._next_id[model] += fresh
        return taken + list(range(start, start + fresh))

    def free(self, model: int, ids: Iterable[int]) -> None:
        ids = list(ids)
        self._recycled[model].extend(ids)
        self.free_bytes += len(ids) * self._block_bytes[model]


class FirstComePages:
    """kvcached alone: an engine maps a whole page (``page_bytes[m]``, holding
    ``blocks_per_page[m]`` blocks) whenever its pages are full and the GPU has the bytes
    free, fills the fullest of its pages that fits first (as kvshare's pool does), and
    unmaps a page only once its last block is freed. No broker, no reclaim."""

    def __init__(
        self, budget_bytes: int, page_bytes: Sequence[int], blocks_per_page: Sequence[int]
    ) -> None:
        self.free_bytes = budget_bytes
        self._page_bytes = list(page_bytes)
        self._per_page = list(blocks_per_page)
        models = len(page_bytes)
        self._next_page = [0] * models
        # Per model: page -> blocks in use; page -> its free block ids (pages with room).
        self._in_use: list[dict[int, int]] = [{} for _ in range(models)]
        self._open: list[dict[int, list[int]]] = [{} for _ in range(models)]
        self._free_in_open = [0] * models
        self.pages_returned = 0

    def view(self, model: int) -> ModelShare:
        """The allocator engine ``model`` uses."""
        return ModelShare(self, model)

    def held_pages(self, model: int) -> int:
        """Pages engine ``model`` holds mapped."""
        return len(self._in_use[model])

    def alloc(self, model: int, n: int) -> list[int] | None:
        per_page = self._per_page[model]
        short = n - self._free_in_open[model]
        new_pages = -(-short // per_page) if short > 0 else 0
        if new_pages * self._page_bytes[model] > self.free_bytes:
            return None
        opened, in_use = self._open[model], self._in_use[model]
        for _ in range(new_pages):
            page = self._next_page[model]
            self._next_page[model] += 1
            self.free_bytes -= self._page_bytes[model]
            first = page * per_page + 1  # block ids from 1: 0 is the null block
            opened[page] = list(range(first + per_page - 1, first - 1, -1))
            in_use[page] = 0
            self._free_in_open[model] += per_page
        taken: list[int] = []
        while len(taken) < n:
            wanted = n - len(taken)
            # The fullest page that fits the rest, else the fullest page.
            page = min(opened, key=lambda p: (len(opened[p]) < wanted, len(opened[p]), p))
            ids = opened[page]
            take = min(wanted, len(ids))
            taken += ids[-take:]
            del ids[-take:]
            in_use[page] += take
            if not ids:
                del opened[page]
        self._free_in_open[model] -= n
        return taken

    def free(self, model: int, ids: Iterable[int]) -> None:
        per_page = self._per_page[model]
        opened, in_use = self._open[model], self._in_use[model]
        for block in ids:
            page = (block - 1) // per_page
            in_use[page] -= 1
            if in_use[page] == 0:  # its last block: the page goes back to the GPU
                del in_use[page]
                self._free_in_open[model] -= len(opened.pop(page, ()))
                self.free_bytes += self._page_bytes[model]
                self.pages_returned += 1
            else:
                opened.setdefault(page, []).append(block)
                self._free_in_open[model] += 1
