"""The processes the broker watches through pidfds, so that it acts the moment one exits:
a pool's process (its lease returns) or a process a restarted broker expects back (it
stops waiting for it).

Touched by the broker's loop thread only; each pidfd is registered with the loop's
selector as ``("pidfd", fd)``.
"""

from __future__ import annotations

import contextlib
import os
import selectors
from typing import Literal

from kvshare.deviceplugin.broker import peers

__all__ = ["Kind", "ProcessWatch"]

#: What a watched process is to the broker: a pool's (keyed by pool id) or one expected
#: back after a restart (keyed by pid).
Kind = Literal["pool", "expected"]


class ProcessWatch:
    """The pidfds open, what each watches, and which pool each pool's process is."""

    def __init__(self, selector: selectors.BaseSelector) -> None:
        self._selector = selector
        self._fds: dict[int, tuple[Kind, int]] = {}
        self._pool_fds: dict[int, int] = {}

    def watch(self, pid: int, kind: Kind, key: int) -> bool:
        """Watch process ``pid`` for ``(kind, key)``; False when it has exited already.
        Without pidfds (an old kernel) nothing is watched and True is returned."""
        try:
            fd = peers.open_pidfd(pid)
        except ProcessLookupError:
            return False
        if fd is None:
            return True
        self._fds[fd] = (kind, key)
        if kind == "pool":
            self._pool_fds[key] = fd
        self._selector.register(fd, selectors.EVENT_READ, ("pidfd", fd))
        return True

    def watches_pool(self, pool_id: int) -> bool:
        """Whether pool ``pool_id``'s process is watched."""
        return pool_id in self._pool_fds

    def unwatch(self, fd: int) -> tuple[Kind, int]:
        """Close pidfd ``fd``; what it watched."""
        kind, key = self._fds.pop(fd)
        if kind == "pool":
            self._pool_fds.pop(key, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(fd)
        os.close(fd)
        return kind, key

    def unwatch_pool(self, pool_id: int) -> None:
        """Stop watching pool ``pool_id``'s process, if it is watched."""
        fd = self._pool_fds.get(pool_id)
        if fd is not None:
            self.unwatch(fd)

    def close(self) -> None:
        """Close every pidfd."""
        for fd in list(self._fds):
            self.unwatch(fd)
