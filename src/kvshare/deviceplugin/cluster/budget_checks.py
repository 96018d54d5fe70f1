"""What the node agent says when a GPU's budget cannot hold what runs on it.

After a restart with a smaller budget (a raised headroom, a smaller configuration, a GPU
reported smaller) the broker reclaims down to the new budget, lowest priority first and
never below a pool's guaranteed minimum. Two things it cannot fix are said, not left to
show as missed deadlines:

- the guaranteed minimums of a GPU's pools need more than its budget
  (``KVMinimumsFit`` is ``False``, reason ``MinimumsExceedBudget``): the budget cannot
  be reached and the minimums are not all guaranteed;
- the GPU reports less memory than the KV caches of its pools were sized for
  (``KVCachesFitGpu`` is ``False``, reason ``GpuSmallerThanKVCaches``): their engines
  believe in memory the GPU does not have until they restart.

:class:`BudgetChecks` reads the broker's books every ``interval_s``, keeps both conditions
for the KVShareNode, logs an error and posts a Warning Event on the Node when one turns
``False``. The metrics say the same (``kvshare_gpu_kv_min_shortfall_bytes``,
``kvshare_gpu_pools_sized_larger``), from the books directly.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

from kvshare.api.kube import Condition
from kvshare.api.quantity import format_bytes_human
from kvshare.deviceplugin.broker.views import BooksView

__all__ = ["MINIMUMS_CONDITION", "SIZE_CONDITION", "BudgetChecks"]

log = logging.getLogger(__name__)

MINIMUMS_CONDITION = "KVMinimumsFit"
SIZE_CONDITION = "KVCachesFitGpu"

#: ``post(reason, message)``: a Warning Event about the Node.
Post = Callable[[str, str], None]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _minimums(view: BooksView) -> tuple[bool, str]:
    short = [g for g in view.gpus if g.min_shortfall > 0]
    if not short:
        return True, "the guaranteed KV minimums of every GPU's pools fit its budget"
    parts = [
        f"GPU {g.index}: the pools' guaranteed KV minimums need "
        f"{format_bytes_human(g.min_shortfall)} more than its budget (total "
        f"{format_bytes_human(g.total)}, headroom {format_bytes_human(g.headroom)}, static "
        f"{format_bytes_human(g.static)})"
        for g in short
    ]
    return False, (
        "; ".join(parts) + ": they are not all guaranteed. Lower kvCache.min of a model "
        "there, move one to another GPU, or lower the node agent's headroom"
    )


def _sizes(view: BooksView) -> tuple[bool, str]:
    small = [g for g in view.gpus if g.pools_sized_larger > 0]
    if not small:
        return True, "every GPU has the memory its pools' KV caches were sized for"
    parts = [
        f"GPU {g.index} reports {format_bytes_human(g.total)}, less than the KV caches of "
        f"{g.pools_sized_larger} pool(s) on it were sized for"
        for g in small
    ]
    return False, (
        "; ".join(parts) + ": restart those model servers so that they size their caches "
        "for this GPU"
    )


class BudgetChecks:
    """Keeps the two budget conditions from the books (see the module doc)."""

    def __init__(
        self, view: Callable[[], BooksView], *, post: Post | None = None, interval_s: float = 1.0
    ) -> None:
        self._view = view
        self._post = post
        self._interval = interval_s
        self._lock = threading.Lock()  # guards _conditions and _post
        self._conditions: dict[str, Condition] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def set_post(self, post: Post | None) -> None:
        """Where Warning Events go (``None``: nowhere, without a Kubernetes API)."""
        with self._lock:
            self._post = post

    def conditions(self) -> list[Condition]:
        """The KVShareNode conditions from the last check."""
        with self._lock:
            return list(self._conditions.values())

    def check(self) -> None:
        """Read the books; a condition that turns ``False`` is logged and posted once."""
        view = self._view()
        turned: list[Condition] = []
        with self._lock:
            for kind, (ok, message), reason in (
                (MINIMUMS_CONDITION, _minimums(view), "MinimumsExceedBudget"),
                (SIZE_CONDITION, _sizes(view), "GpuSmallerThanKVCaches"),
            ):
                status = "True" if ok else "False"
                before = self._conditions.get(kind)
                if before is not None and (before.status, before.message) == (status, message):
                    continue
                since = before.last_transition_time if before and before.status == status else None
                condition = Condition(
                    type=kind,
                    status=status,
                    reason="Fits" if ok else reason,
                    message=message,
                    last_transition_time=since or _now(),
                )
                self._conditions[kind] = condition
                if not ok and (before is None or before.status != "False"):
                    turned.append(condition)
            post = self._post
        for condition in turned:
            log.error("%s: %s", condition.reason, condition.message)
            if post is not None:
                post(condition.reason, condition.message)

    def start(self) -> None:
        """Check every ``interval_s`` on a thread (``kvshare-budget-checks``)."""
        self._thread = threading.Thread(target=self._run, name="kvshare-budget-checks", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.check()
            except Exception:  # a check must never stop the agent
                log.exception("budget check failed; trying again in %.0f s", self._interval)
