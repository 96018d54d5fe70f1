"""Leases enforced where the hardware tells: a pool's process that holds more device memory
than the broker charges it for is asked to give the excess back, and a pod that keeps doing
so is evicted.

On a GPU node the audit (:mod:`.audit`) reads each process's device memory from NVML and
subtracts the static footprints its pools declared: what is left is the process's KV
memory. That is held against the pools' charge (:meth:`~.records.PoolRecord.charged_bytes`:
the lease, and memory asked back and not yet released, so an ordinary reclaim is no
overuse) plus a tolerance for allocator slack. Beyond it:

- every time: the overuse metric, and a reclaim of the excess from the pool's lease (the
  pool gives back KV pages, so that the process's total fits what was charged), unless a
  reclaim is already pending;
- the first time: a Warning Event on the pod (``KVLeaseOverused``) and a log line;
- after ``evict_after`` audits in a row over: the pod is evicted (``KVLeaseEvicted``);
  ``evict_after`` 0 never evicts.

A process back within its charge starts counting from zero again. Only devices that
report per-process memory (NVML) are judged: the host backend's memfd audit only flags.
:class:`LeaseEnforcer` decides; the node agent carries the decisions out (the broker's
reclaim, the cluster's Event and eviction).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.deviceplugin.broker.audit import Finding
from kvshare.deviceplugin.broker.views import BooksView, PoolView

__all__ = ["EnforcementConfig", "LeaseEnforcer", "Overuse"]


@dataclass(frozen=True)
class EnforcementConfig:
    """How much overuse is tolerated, and how long, before the pod is evicted."""

    tolerance: int = 256 * 2**20
    evict_after: int = 10


@dataclass(frozen=True)
class Overuse:
    """One pool whose process holds more than it is charged for, at one audit."""

    pool: PoolView
    device_bytes: int
    """KV memory the device shows for the pool's process (static footprints taken off)."""
    allowed_bytes: int
    """What its pools are charged, plus the tolerance."""
    strikes: int
    """Audits in a row it has been over, this one included."""
    evict: bool
    """This audit makes it ``evict_after`` in a row: evict the pod."""

    @property
    def excess(self) -> int:
        """Bytes over the charge and the tolerance."""
        return self.device_bytes - self.allowed_bytes

    @property
    def first(self) -> bool:
        """The first audit of a run of overuse."""
        return self.strikes == 1


class LeaseEnforcer:
    """Counts overused audits per pool and says what to do (see the module doc). Called
    from the audit's thread only."""

    def __init__(self, config: EnforcementConfig) -> None:
        self.config = config
        self._strikes: dict[int, int] = {}

    def judge(self, view: BooksView, findings: Sequence[Finding]) -> list[Overuse]:
        """The pools over their charge at this audit (one per process and GPU: the device
        cannot tell a process's pools apart, the first of them stands for all)."""
        by_id = {p.id: p for p in view.pools}
        groups: dict[tuple[int, str], list[PoolView]] = defaultdict(list)
        device: dict[tuple[int, str], int] = {}
        for finding in findings:
            pool = by_id.get(finding.pool_id)
            if pool is None or finding.device_bytes is None:
                continue
            key = (pool.pid, pool.gpu)
            groups[key].append(pool)
            device[key] = finding.device_bytes
        found: list[Overuse] = []
        strikes: dict[int, int] = {}
        for key, pools in groups.items():
            first = min(pools, key=lambda p: p.id)
            allowed = sum(p.charged_bytes() for p in pools) + self.config.tolerance
            if device[key] <= allowed:
                continue
            count = self._strikes.get(first.id, 0) + 1
            strikes[first.id] = count
            evict = count == self.config.evict_after and self.config.evict_after > 0
            found.append(Overuse(first, device[key], allowed, count, evict))
        self._strikes = strikes  # pools within their charge (or gone) start again
        return found
