"""Controls: what changes the books from outside the pools' own traffic.

A pool's cap (``kvshare ctl set-max``,
:mod:`kvshare.deviceplugin.broker.connections.admin_requests`), its whole policy when its
pod's kvCache changes (:mod:`kvshare.deviceplugin.broker.overrides`), a GPU's drain
(``kvshare ctl drain``) and health (the inventory), and what the device audit found
(:mod:`kvshare.deviceplugin.broker.audit`). A lowered cap or a drain reclaims what a pool
may no longer hold, a raised minimum is guaranteed at once and a raised cap is lent as
memory allows (:mod:`kvshare.deviceplugin.broker.lending`); a GPU's health only decides
what it takes and lends from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace

from kvshare.deviceplugin.broker.admission import MAX_PRIORITY
from kvshare.deviceplugin.broker.lending import Lender
from kvshare.deviceplugin.broker.records import (
    GpuRecord,
    PoolRecord,
    Send,
    align_down,
    align_up,
    size,
)
from kvshare.deviceplugin.broker.turns import StartupTurns

__all__ = ["Controls"]

log = logging.getLogger(__name__)


class Controls:
    """Changes to pools and GPUs from outside (see the module doc). Not thread-safe: used
    under the books' caller's lock."""

    def __init__(
        self,
        gpus: Mapping[str, GpuRecord],
        pools: Mapping[int, PoolRecord],
        *,
        turns: StartupTurns,
        lender: Lender,
    ) -> None:
        self._gpus = gpus
        self._pools = pools
        self._turns = turns
        self._lender = lender

    def set_max(self, pool_id: int, kv_max: int | None, now: float) -> list[Send]:
        """Change a pool's cap; a lease above the new cap is reclaimed down to it."""
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        if kv_max is not None:
            kv_max = align_down(kv_max, pool.page)
            if kv_max < pool.kv_min:
                raise ValueError(
                    f"max {size(kv_max)} is below pool {pool.name}'s kv min {size(pool.kv_min)}"
                )
        pool.kv_max = kv_max
        sends: list[Send] = []
        # What the pool asked for beyond the old cap is wanted again under a raised one.
        wanted = max(pool.want, pool.asked)
        pool.want = max(pool.floor, wanted if kv_max is None else min(wanted, kv_max))
        if kv_max is not None and pool.lease > kv_max:
            sends.append(self._lender.reclaim(gpu, pool, kv_max, now, "max lowered"))
        log.info("pool %s max set to %s", pool.name, "none" if kv_max is None else size(kv_max))
        return sends + self._lender.serve(gpu, now)

    def set_policy(
        self, pool_id: int, kv_min: int, kv_max: int | None, priority: int, now: float
    ) -> list[Send]:
        """Change a pool's minimum, cap and priority in place (its pod's kvCache changed).

        A raised minimum is guaranteed at once, as at admission; when the GPU cannot hold
        it, or the values break the rules, nothing changes and ``ValueError`` says why. A
        lease above a lowered cap is reclaimed; a lowered priority gives memory back first
        from the next contention on.
        """
        pool = self._pools[pool_id]
        gpu = self._gpus[pool.gpu]
        new_min = align_up(kv_min, pool.page)
        if not 0 <= priority <= MAX_PRIORITY:
            raise ValueError(f"priority {priority} is outside 0-{MAX_PRIORITY}")
        if kv_max is not None and align_down(kv_max, pool.page) < new_min:
            raise ValueError(f"max {size(kv_max)} is below the kv min {size(new_min)}")
        more = new_min - pool.kv_min
        if more > max(gpu.placement_free, 0):
            raise ValueError(
                f"GPU {gpu.info.index} cannot guarantee {size(more)} more kv min to pool "
                f"{pool.name}: {size(max(gpu.placement_free, 0))} is left for placement"
            )
        gpu.min_sum += more
        pool.kv_min = new_min
        pool.hello = replace(pool.hello, priority=priority)
        self._lender.recharge(gpu, pool)
        return self.set_max(pool_id, kv_max, now)

    def set_draining(self, gpu_uuid: str, draining: bool, now: float) -> list[Send]:
        """Drain a GPU (reclaim every pool to its minimum, admit nothing new) or undo it."""
        gpu = self._gpu(gpu_uuid)
        gpu.draining = draining
        sends: list[Send] = []
        if draining:
            # Engines not started yet: start them elsewhere.
            reason = f"GPU {gpu.info.index} is draining: it takes no new engines"
            sends += self._turns.refuse_queued(gpu, reason)
            for pool in gpu.pools.values():
                if pool.lease > pool.floor and (
                    pool.reclaim is None or pool.reclaim.target > pool.floor
                ):
                    sends.append(self._lender.reclaim(gpu, pool, pool.floor, now, "draining"))
        log.info("GPU %d %s", gpu.info.index, "draining" if draining else "no longer draining")
        return sends + self._lender.serve(gpu, now)

    def set_healthy(self, gpu_uuid: str, healthy: bool) -> None:
        """Record a GPU's health: unhealthy GPUs take no new pools and lend nothing more."""
        self._gpu(gpu_uuid).healthy = healthy

    def _gpu(self, selector: str) -> GpuRecord:
        gpu = self._gpus.get(selector)
        if gpu is None and selector.isdigit():
            gpu = next((g for g in self._gpus.values() if g.info.index == int(selector)), None)
        if gpu is None:
            raise KeyError(f"no GPU {selector!r} on this node (by UUID or index)")
        return gpu

    def reclaim_overuse(self, pool_id: int, excess: int, now: float) -> list[Send]:
        """The device shows pool ``pool_id``'s process ``excess`` bytes over its charge:
        reclaim that much of its lease (no lower than its floor), unless a reclaim is
        pending already (:mod:`kvshare.deviceplugin.broker.enforcement`)."""
        pool = self._pools.get(pool_id)
        if pool is None or pool.reclaim is not None:
            return []
        gpu = self._gpus[pool.gpu]
        target = max(pool.floor, align_down(pool.lease - excess, pool.page))
        if target >= pool.lease:
            return []  # at its floor: nothing left to take back
        log.warning(
            "pool %s (pid %d) holds %s more on the device than it is charged for: "
            "reclaiming its lease down to %s",
            pool.name,
            pool.pid,
            size(excess),
            size(target),
        )
        pool.want = min(pool.want, target)
        sends = [self._lender.reclaim(gpu, pool, target, now, "over its charge on the device")]
        return sends + self._lender.serve(gpu, now)

    def record_audit(self, pool_id: int, device_bytes: int | None, over_lease: bool) -> bool:
        """Store what the device shows for a pool; True when ``over_lease`` just turned on."""
        pool = self._pools.get(pool_id)
        if pool is None:
            return False
        turned_on = over_lease and not pool.over_lease
        pool.device_bytes = device_bytes
        pool.over_lease = over_lease
        return turned_on
