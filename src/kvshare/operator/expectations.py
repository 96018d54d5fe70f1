"""Pods the operator created or deleted whose watch events have not arrived yet.

Between a successful create (or delete) call and the watch event that updates kopf's
pod index, the index is behind. Planning from it alone would count that pod's GPUs as
free (and place another replica there) or pick the same pod to delete twice. The
operator records each of its own changes here and overlays them on the index until the
index shows them, or until they expire (a pod deleted by someone else before its
creation was ever seen). All access happens on the event loop's thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from kvshare.operator.views import ModelServerKey, PodView

__all__ = ["Expectations"]

#: Seconds after which an expectation the index never confirmed is dropped.
EXPECTATION_TTL = 300.0


class Expectations:
    """Created pods not yet indexed, and deleted pods still indexed."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._created: dict[tuple[str, str], tuple[PodView, float]] = {}
        self._deleted: dict[str, tuple[ModelServerKey, float]] = {}  # pod uid -> owner, when

    def created(self, pod: PodView) -> None:
        """``pod`` was created; count it until the index has it."""
        self._created[(pod.namespace, pod.name)] = (pod, self._clock())

    def deleted(self, pod: PodView) -> None:
        """``pod`` was deleted; treat it as terminating until the index drops it."""
        self._deleted[pod.uid] = (pod.key, self._clock())
        self._created.pop((pod.namespace, pod.name), None)

    def forget_pod(self, pod: PodView) -> None:
        """``pod`` was planned but not created after all."""
        self._created.pop((pod.namespace, pod.name), None)

    def overlay(
        self, indexed: Iterable[PodView], key: ModelServerKey | None = None
    ) -> list[PodView]:
        """``indexed`` pods (of ModelServer ``key``, or all) with the expectations applied.

        Confirmed or expired expectations are dropped as a side effect, but only those
        the given pods can confirm: a call for one ModelServer prunes only its own.
        """
        now = self._clock()
        pods = list(indexed)
        names = {(p.namespace, p.name) for p in pods}
        uids = {p.uid for p in pods}
        for name, (pod, since) in list(self._created.items()):
            if key is not None and pod.key != key:
                continue
            if name in names or now - since > EXPECTATION_TTL:
                del self._created[name]
        for uid, (owner, since) in list(self._deleted.items()):
            if key is not None and owner != key:
                continue
            if uid not in uids or now - since > EXPECTATION_TTL:
                del self._deleted[uid]
        result = [
            dataclasses.replace(p, terminating=True) if p.uid in self._deleted else p for p in pods
        ]
        result += [pod for pod, _ in self._created.values() if key is None or pod.key == key]
        return result

    def forget(self, key: ModelServerKey) -> None:
        """Drop every expectation of ModelServer ``key`` (it was deleted)."""
        for name, (pod, _) in list(self._created.items()):
            if pod.key == key:
                del self._created[name]
        for uid, (owner, _) in list(self._deleted.items()):
            if owner == key:
                del self._deleted[uid]
