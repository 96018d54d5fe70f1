"""The audit: what pools say they hold, checked against what the device shows.

- GPUs (NVML): the device memory each pool's process holds on the pool's GPU, less the
  static footprints its pools declared there, is its KV memory.
- Host backend: the KV memory of a process is what the kernel has allocated to the
  memfds it holds open (``/proc/<pid>/fd/*`` that point at ``/memfd:``; ``st_blocks`` of
  each, counted once per inode). Reading them needs the same user or CAP_SYS_PTRACE.

A process whose KV memory exceeds the leases of its pools by more than one page is
flagged: the ``kvshare_pool_over_lease`` metric, ``kvshare ctl pools`` and a warning.
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

__all__ = ["Auditor", "Finding", "audit", "memfd_bytes"]

log = logging.getLogger(__name__)


def memfd_bytes(pid: int) -> int | None:
    """Bytes the kernel has allocated to the memfds that ``pid`` holds open, or None
    when its file descriptors cannot be read."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return None
    total = 0
    seen: set[tuple[int, int]] = set()
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
    return total


@dataclass(frozen=True)
class Finding:
    """What the device shows for one pool."""

    pool_id: int
    device_bytes: int | None
    over_lease: bool


def audit(
    view: BooksView,
    backend: str,
    process_memory: Callable[[str], Mapping[int, int] | None],
    host_memory: Callable[[int], int | None] = memfd_bytes,
) -> list[Finding]:
    """Compare every pool with the device: one :class:`Finding` per pool.

    Pools of one process on one GPU are judged together (the device cannot tell them
    apart); each of them carries the process's figure.
    """
    groups: dict[tuple[int, str], list[PoolView]] = defaultdict(list)
    for pool in view.pools:
        key = (pool.pid, pool.gpu if backend == "cuda" else "")
        groups[key].append(pool)
    per_gpu: dict[str, Mapping[int, int] | None] = {}
    findings: list[Finding] = []
    for (pid, gpu), pools in groups.items():
        device: int | None
        if backend == "cuda":
            if gpu not in per_gpu:
                per_gpu[gpu] = process_memory(gpu)
            held = per_gpu[gpu]
            device = None
            if held is not None:
                device = max(held.get(pid, 0) - sum(p.static for p in pools), 0)
        else:
            device = host_memory(pid)
        allowed = sum(p.lease for p in pools) + max(p.page_size for p in pools)
        over = device is not None and device > allowed
        findings.extend(Finding(p.id, device, over) for p in pools)
    return findings


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
        """Audit now; the names of pools that just went over their lease."""
        view = self._view()
        findings = audit(view, self._backend, self._process_memory)
        flagged = self._record((f.pool_id, f.device_bytes, f.over_lease) for f in findings)
        if self._on_findings is not None:
            self._on_findings(view, findings)
        by_id = {p.id: p for p in view.pools}
        for finding in findings:
            pool = by_id[finding.pool_id]
            if pool.name in flagged and finding.device_bytes is not None:
                log.warning(
                    "pool %s (pid %d) holds %s on the device, more than its lease %s plus a page",
                    pool.name,
                    pool.pid,
                    format_bytes_human(finding.device_bytes),
                    format_bytes_human(pool.lease),
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
