"""Block ids between an engine's device and the pool's books, without waiting for the device.

SGLang keeps its allocators' free lists on the GPU; the pool keeps its books on the host. A
plain ``.cpu()`` or ``.to(device)`` of a pageable tensor waits for everything queued on the
stream, which undoes SGLang's overlap of scheduling with execution. Here:

- :func:`to_device` copies ids from pinned host memory, asynchronously;
- :func:`start_to_host` starts a copy into pinned host memory and records an event behind
  it on the current stream: the :class:`HostCopy` says when it is done without waiting
  (:meth:`HostCopy.done`), and waits only where memory is needed now (:meth:`HostCopy.wait`).

On a CPU device both are plain tensors and a copy is done at once. This module is the only
place the engine hooks touch CUDA streams for block ids (tests stand in for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["HostCopy", "start_to_host", "to_device"]


class HostCopy:
    """Block ids on their way from the device to the host."""

    def __init__(self, host: torch.Tensor, event: Any = None, source: Any = None) -> None:
        self._host = host
        self._event = event
        self._source = source  # kept alive until the copy is done

    def __len__(self) -> int:
        return int(self._host.numel())

    def done(self) -> bool:
        """Whether the copy has finished (never waits)."""
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block until the copy has finished."""
        if self._event is not None:
            self._event.synchronize()

    def values(self) -> list[int]:
        """The ids (waits if the copy has not finished)."""
        if not self.done():
            self.wait()
        self._source = None
        ids: list[int] = self._host.tolist()
        return ids


def start_to_host(ids: torch.Tensor) -> HostCopy:
    """Start copying ``ids`` to the host; returns at once."""
    import torch

    if not ids.is_cuda:
        return HostCopy(ids.to(torch.int64).clone())
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record(torch.cuda.current_stream(ids.device))
    return HostCopy(host, event, ids)


def to_device(ids: list[int], like: torch.Tensor) -> torch.Tensor:
    """``ids`` as a tensor of ``like``'s dtype on ``like``'s device, copied asynchronously."""
    import torch

    host = torch.tensor(ids, dtype=like.dtype)
    if not like.is_cuda:
        return host.to(like.device)
    return host.pin_memory().to(like.device, non_blocking=True)
