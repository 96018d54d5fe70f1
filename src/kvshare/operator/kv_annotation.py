"""The KV-policy annotation: the controller writes a ModelServer's current ``kvCache`` into
each of its pods that does not carry it, and the node agent applies it to the pods' pools
in place (no restart). Touched on the event loop's thread only."""

from __future__ import annotations

from kvshare.api import names
from kvshare.operator.client import KubeApi, pods_path
from kvshare.operator.inplace import WantedPolicy, pods_to_annotate
from kvshare.operator.status import Event
from kvshare.operator.views import ModelServerKey, ModelServerRef, PodView

__all__ = ["KVAnnotations"]


class KVAnnotations:
    """The annotation last written per ModelServer, and the pods (by uid) given it."""

    def __init__(self) -> None:
        self._annotated: dict[ModelServerKey, tuple[str, set[str]]] = {}

    async def annotate(
        self,
        api: KubeApi,
        ms: ModelServerRef,
        pods: list[PodView],
        wanted: WantedPolicy,
        events: list[Event],
    ) -> None:
        """Write the current KV policy into the pods that do not carry it: the node agent
        applies it to their pools in place."""
        # Pods patched already, until the watch shows the annotation: not patched twice.
        done = self._annotated.get(ms.key)
        if done is None or done[0] != wanted.annotation:
            done = self._annotated[ms.key] = (wanted.annotation, set())
        done[1].difference_update(p.uid for p in pods if p.kv_policy == wanted.annotation)
        stale = [p for p in pods_to_annotate(pods, wanted) if p.uid not in done[1]]
        patch = {"metadata": {"annotations": {names.ANNOTATION_KV_POLICY: wanted.annotation}}}
        patched = []
        for pod in stale:
            if await api.merge_patch(pods_path(ms.namespace, pod.name), patch) is not None:
                done[1].add(pod.uid)
                patched.append(pod.name)
        if patched:
            events.append(
                Event(
                    "Normal",
                    "KVPolicyChanged",
                    f"applying kvCache {wanted.description} in place to {len(patched)} "
                    f"replica(s): {', '.join(patched[:5])}",
                )
            )

    def forget(self, key: ModelServerKey) -> None:
        """ModelServer ``key`` was deleted."""
        self._annotated.pop(key, None)
