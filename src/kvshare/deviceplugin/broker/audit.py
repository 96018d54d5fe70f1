"""The audit: what pools say they hold, checked against what the device shows.

- GPUs (NVML): the device memory each pool's process holds on the pool's GPU, less the
  static footprints its pools declared there, is its KV memory.
- Host backend: the KV memory of a process is what the kernel has allocated to the
  memfds it holds open (``/proc/<pid>/fd/*`` that point at ``/memfd:``; ``st_blocks`` of
  each, counted once per inode). Reading them needs the same user or CAP_SYS_PTRACE.

A process whose KV memory exceeds what its pools may hold by more than one page is
flagged: the ``kvshare_pool_over_lease`` metric, ``OVER-LEASE`` in ``kvshare ctl pools``, a
warning, and the chart's ``KVSharePoolOverLease`` alert. What a pool may hold
(:func:`allowance`) is what the broker charges it: its lease, plus the memory a reclaim
asked back while that reclaim is within its deadline (an ordinary reclaim lowers the
lease at once and the memory follows as requests finish: that is not over-use). Past the
deadline, only the lease: memory kept longer is flagged, as is anything beyond the charge.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvshare.api.quantity import format_bytes_human
from kvshare.deviceplugin.broker.views import BooksView, PoolView

__all__ = ["Auditor", "Finding", "allowance", "audit", "memfd_bytes", "memfd_bytes_of"]

log = logging.getLogger(__name__)


def memfd_bytes(pid: int) -> int | None:
    """Bytes the kernel has allocated to the memfds that ``pid`` holds open, or None
    when its file descriptors cannot be read."""
    return memfd_bytes_of([pid])


def memfd_bytes_of(pids: Iterable[int]) -> int | None:
    """Bytes the kernel has allocated to the memfds any of ``pids`` holds open, each
    memfd counted once (processes of one server share some), or None when the file
    descriptors of none of them can be read."""
    total = 0
    seen: set[tuple[int, int]] = set()
    readable = False
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        readable = True
        for name in names:
            path = f"{fd_dir}/{name}"
            try:
                if not os.readlink(path).startswith("/memfd:"):
                    continue
                info = os.stat(path)
            except OSError:
                continue  # closed meanwhile
            key = (info.st_dev, info.st_ino)
            if key not in seen:
                seen.add(key)
                total += info.st_blocks * 512
    return total if readable else None


@dataclass(frozen=True)
class Finding:
    """What the device shows for one pool, against what it may hold there."""

    pool_id: int
    device_bytes: int | None
    allowed: int
    """What the pool's process may hold for its pools on that device (a page of slack
    aside): see :func:`allowance`."""
    over_lease: bool


def allowance(pool: PoolView) -> int:
    """What ``pool`` may hold on the device, a page of slack aside.

    While a reclaim of it runs within its deadline, what the broker still charges it (its
    lease and the memory asked back, released as the requests on it finish: an ordinary
    reclaim is not over-use); once that deadline has passed, only its lease.
    """
    return pool.lease if pool.reclaim_overdue else pool.charged


def audit(
    view: Callable[[], BooksView],
    backend: str,
    process_memory: Callable[[str], Mapping[int, int] | None],
    host_memory: Callable[[int], int | None] = memfd_bytes,
) -> tuple[BooksView, list[Finding]]:
    """Compare every pool with the device: the books as of the reading, and one
    :class:`Finding` per pool.

    Pools of one process on one GPU are judged together (the device cannot tell them
    apart); each of them carries the process's figure. The books are read before and
    after the device, and a pool is over only if it holds more than it may in both: a
    grant, or a reclaim completing, between the readings is not over-use.
    """
    before = view()
    groups: dict[tuple[int, str], list[PoolView]] = defaultdict(list)
    for pool in before.pools:
        key = (pool.pid, pool.gpu if backend == "cuda" else "")
        groups[key].append(pool)
    per_gpu: dict[str, Mapping[int, int] | None] = {}
    device: dict[tuple[int, str], int | None] = {}
    for (pid, gpu), pools in groups.items():
        if backend == "cuda":
            if gpu not in per_gpu:
                per_gpu[gpu] = process_memory(gpu)
            held = per_gpu[gpu]
            device[pid, gpu] = None
            if held is not None:
                device[pid, gpu] = max(held.get(pid, 0) - sum(p.static for p in pools), 0)
        else:
            device[pid, gpu] = host_memory(pid)
    later = {p.id: p for p in view().pools}
    findings: list[Finding] = []
    for key, pools in groups.items():
        allowed = sum(
            max(allowance(p), allowance(later[p.id]) if p.id in later else 0) for p in pools
        )
        found = device[key]
        over = found is not None and found > allowed + max(p.page_size for p in pools)
        findings.extend(Finding(p.id, found, allowed, over) for p in pools)
    return before, findings


class Auditor:
    """Runs :func:`audit` every ``interval_s`` on its own thread (``kvshare-audit``)."""

    def __init__(
        self,
        view: Callable[[], BooksView],
        record: Callable[[Iterable[tuple[int, int | None, bool]]], list[str]],
        backend: str,
        process_memory: Callable[[str], Mapping[int, int] | None],
        interval_s: float = 2.0,
        *,
        on_findings: Callable[[BooksView, list[Finding]], None] | None = None,
    ) -> None:
        """``on_findings(view, findings)`` gets every audit's findings (lease enforcement,
        :mod:`.enforcement`)."""
        self._view = view
        self._record = record
        self._on_findings = on_findings
        self._backend = backend
        self._process_memory = process_memory
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_once(self) -> list[str]:
        """Audit now; the names of pools that just went over what they may hold."""
        view, findings = audit(self._view, self._backend, self._process_memory)
        flagged = self._record((f.pool_id, f.device_bytes, f.over_lease) for f in findings)
        if self._on_findings is not None:
            self._on_findings(view, findings)
        by_id = {p.id: p for p in view.pools}
        for finding in findings:
            pool = by_id[finding.pool_id]
            if pool.name in flagged and finding.device_bytes is not None:
                log.warning(
                    "pool %s (pid %d) holds %s on the device, more than it may hold (%s) "
                    "plus a page: %s",
                    pool.name,
                    pool.pid,
                    format_bytes_human(finding.device_bytes),
                    format_bytes_human(finding.allowed),
                    "its lease, past the deadline of a reclaim"
                    if pool.reclaim_overdue
                    else "its lease and what it was asked to give back",
                )
        return flagged

    def start(self) -> None:
        """Audit periodically until :meth:`stop`."""
        self._thread = threading.Thread(target=self._loop, name="kvshare-audit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop auditing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.run_once()
            except Exception:
                log.exception("audit failed; trying again in %.0f s", self._interval)
