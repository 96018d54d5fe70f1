"""ModelServers held back by an exhausted namespace quota.

When the API server refuses a pod for a ResourceQuota, the other missing replicas would
meet the same quota: the controller remembers the refusal and the quota as the watch
showed it then, and creates no pod for the ModelServer until that quota changes and has
room. A change of the quota brings the next try (never a loop of refused creates).
Touched on the event loop's thread only.
"""

from __future__ import annotations

from dataclasses import replace

from kvshare.operator.caches import Caches
from kvshare.operator.plan import Plan
from kvshare.operator.quota import QuotaRefusal, QuotaView
from kvshare.operator.views import ModelServerKey

__all__ = ["QuotaHolds"]


class QuotaHolds:
    """The last pod refused for an exhausted quota per ModelServer, while replicas are
    missing, and the quota as it was seen then."""

    def __init__(self) -> None:
        self._waits: dict[ModelServerKey, tuple[QuotaRefusal, QuotaView | None]] = {}

    def hold(self, key: ModelServerKey, plan: Plan, caches: Caches) -> Plan:
        """``plan`` without its creates while the quota that refused the last one still
        has no room for it; a quota change brings the next try (never a loop)."""
        wait = self._waits.get(key)
        if wait is None:
            return plan
        if not plan.creates:  # nothing missing any more: nothing waits for quota
            del self._waits[key]
            return plan
        refusal, seen = wait
        quota = caches.quota(key[0], refusal.quota)
        if quota != seen and (quota is None or quota.has_room(refusal)):
            return plan  # try again; a refusal with the new numbers holds it back again
        return replace(plan, creates=())

    def refused(self, key: ModelServerKey, refusal: QuotaRefusal, seen: QuotaView | None) -> None:
        """A pod of ``key`` was refused (``refusal``) while the quota was ``seen``."""
        self._waits[key] = (refusal, seen)

    def created(self, key: ModelServerKey) -> None:
        """A pod of ``key`` was created: no quota holds it back."""
        self._waits.pop(key, None)

    def refusal(self, key: ModelServerKey) -> QuotaRefusal | None:
        """The refusal that holds ``key`` back, if any."""
        wait = self._waits.get(key)
        return wait[0] if wait is not None else None

    def affected(self, namespace: str | None, name: str) -> set[ModelServerKey]:
        """ModelServers a change of quota ``namespace/name`` matters to: those it refused."""
        return {
            key
            for key, (refusal, _) in self._waits.items()
            if key[0] == namespace and refusal.quota == name
        }

    def forget(self, key: ModelServerKey) -> None:
        """ModelServer ``key`` was deleted."""
        self._waits.pop(key, None)
