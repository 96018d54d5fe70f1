"""Recovery after a broker restart: the pools of the previous broker, expected back.

A broker restart loses nothing: pools keep their memory, reconnect and re-declare what
they hold, and the books are rebuilt from them. The node agent's state file names the
pools the previous broker had admitted (:class:`~kvshare.deviceplugin.broker.records.ExpectedPool`);
until each has re-declared, its process has exited, or the deadline has passed, their
static footprints and minimums stay reserved on their GPUs and the books grant nothing
(a grant could hand out memory a returning pool still holds).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping

from kvshare.deviceplugin.broker.records import ExpectedPool, GpuRecord

__all__ = ["Recovery"]

log = logging.getLogger(__name__)


class Recovery:
    """The pools still expected to re-declare, and until when (see the module doc)."""

    def __init__(
        self,
        gpus: Mapping[str, GpuRecord],
        expected: Iterable[ExpectedPool],
        deadline: float | None,
    ) -> None:
        self._gpus = gpus
        self._expected: dict[int, ExpectedPool] = {}
        for pool in expected:
            home = gpus.get(pool.gpu)
            if home is None:
                log.warning(
                    "pool %s was on unknown GPU %s: not waiting for it", pool.name, pool.gpu
                )
                continue
            self._expected[pool.pid] = pool
            home.expected_static += pool.static
            home.expected_min += pool.kv_min
        self.deadline = deadline if self._expected else None

    @property
    def active(self) -> bool:
        """Whether pools of the previous broker are still expected."""
        return self.deadline is not None

    @property
    def complete(self) -> bool:
        """Every expected pool has re-declared or is gone."""
        return not self._expected

    def claim(self, pid: int) -> ExpectedPool | None:
        """The expected pool of process ``pid``, which has now re-declared (None: not
        expected); its reservation is released to the pool's own charges."""
        pool = self._expected.pop(pid, None)
        if pool is not None:
            self._unreserve(pool)
        return pool

    def forget(self, pid: int) -> bool:
        """Process ``pid`` exited: stop waiting for its pool; whether it was expected."""
        pool = self.claim(pid)
        if pool is not None:
            log.info("pool %s of the previous broker is gone (pid %d exited)", pool.name, pid)
        return pool is not None

    def finish(self) -> bool:
        """Stop waiting (every pool is back, or the deadline passed); whether recovery was
        still on."""
        if self.deadline is None:
            return False
        for pool in self._expected.values():
            log.warning(
                "pool %s (pid %d) did not re-declare after the broker restart; "
                "no longer reserving for it",
                pool.name,
                pool.pid,
            )
            self._unreserve(pool)
        self._expected.clear()
        self.deadline = None
        return True

    def _unreserve(self, pool: ExpectedPool) -> None:
        gpu = self._gpus.get(pool.gpu)
        if gpu is not None:
            gpu.expected_static -= pool.static
            gpu.expected_min -= pool.kv_min
