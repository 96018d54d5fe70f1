"""Read-only views of the broker's books: what metrics, ``kvshare ctl``, ``kvshare top``
and the KVShareNode publisher see. Plain dataclasses of plain values, so they travel
over the admin socket unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PoolView:
    """One KV pool as the broker accounts for it (bytes unless said otherwise)."""

    id: int
    name: str
    gpu: str
    pid: int
    namespace: str
    pod: str
    pod_uid: str
    modelserver: str
    rank: int
    tp_size: int
    engine: str
    priority: int
    page_size: int
    static: int
    kv_min: int
    kv_max: int | None
    lease: int
    """What the pool may hold now."""
    charged: int
    """What the broker counts as taken from the GPU for it (>= lease while a reclaim is
    unacknowledged, >= kv_min always)."""
    want: int
    mapped: int
    used: int
    cached: int
    reserved: int
    device_bytes: int | None
    """What the device shows for the pool's process (None until audited)."""
    over_lease: bool
    reclaim_target: int | None
    """Lease being reclaimed down to, while unacknowledged."""
    reclaim_overdue: bool
    orphaned: bool
    """The connection is gone and the broker is waiting briefly for the process to exit
    or reconnect."""
    age_s: float
    page_bytes: int = 0
    """Physical memory the pool maps and unmaps at a time, as it reported (0: not yet)."""
    layout: str = ""
    """What one of its pages holds: ``block-outer`` or ``per-layer`` (``""``: not said)."""
    layout_reason: str = ""
    """Why it keeps per-layer pages (``kvshare.runtime.paging.LAYOUT_REASONS``)."""
    sized_for: int = 0
    """The GPU's memory its engine sized its KV cache for (0: not known)."""

    def charged_bytes(self) -> int:
        """What the broker counted as taken for the pool (its record's
        :meth:`~kvshare.deviceplugin.broker.records.PoolRecord.charged_bytes`)."""
        return self.charged


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU's budget and usage."""

    uuid: str
    index: int
    name: str
    total: int
    headroom: int
    healthy: bool
    draining: bool
    static: int
    """Static footprints of its pools and of the engine holding the start-up turn."""
    kv_min: int
    kv_lease: int
    kv_charged: int
    kv_mapped: int
    kv_used: int
    free: int
    """total - headroom - static - kv_min: what placement may still commit here."""
    unleased: int
    """Budget not charged to any pool: what can be granted right now without reclaiming."""
    overcommitted: int
    """Charges beyond the budget (after a restart with a smaller one, until reclaimed)."""
    min_shortfall: int
    """Guaranteed minimums beyond the budget: above 0 the budget cannot be reached."""
    pools_sized_larger: int
    """Pools whose KV caches were sized for more memory than the GPU reports now."""
    pools: int
    turn_holder: str
    turn_waiting: int
    """Engines waiting for its start-up turn (ranks waiting for their group's peers too)."""


@dataclass(frozen=True, slots=True)
class BooksView:
    """Everything at one instant."""

    gpus: list[GpuView]
    pools: list[PoolView]
    recovering: bool
