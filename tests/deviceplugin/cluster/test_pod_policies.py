"""A pod's KV-policy annotation, read by the node agent and applied by the broker's books
to the pod's pools only: what the annotation may not do (guarantee memory the pod's
request does not cover, break the books' rules) changes nothing and says why."""

from __future__ import annotations

from typing import Any

from kvshare.api import kvpolicy, names
from kvshare.deviceplugin.broker.books import Books
from kvshare.deviceplugin.broker.overrides import PodPolicies, PolicyState
from kvshare.deviceplugin.cluster.pod_policies import pod_policy
from tests.deviceplugin.broker.test_books import GPU, hello

GIB = 2**30


def pod(annotation: str | None, *, units: int = 4, gpus: int = 1) -> dict[str, Any]:
    annotations = {} if annotation is None else {names.ANNOTATION_KV_POLICY: annotation}
    requests = {names.RESOURCE_GPU: str(gpus), names.RESOURCE_GPU_MEMORY: str(units)}
    return {
        "metadata": {"name": "qwen-0", "uid": "uid-a", "annotations": annotations},
        "spec": {"containers": [{"name": "engine", "resources": {"requests": requests}}]},
    }


def books_with(*pods: str) -> tuple[Books, list[int]]:
    """Books with one pool per pod uid (static 2 GiB, min 1 GiB, priority 100)."""
    books = Books([GPU], headroom=GIB)
    ids = []
    for index, uid in enumerate(pods):
        admission = books.admit(hello(f"p{index}", pod_uid=uid), 10 + index, 0.0)
        assert admission.record is not None
        ids.append(admission.record.id)
    return books, ids


def test_the_annotation_is_read_with_the_gpu_memory_its_pod_requested() -> None:
    uid, policy = pod_policy(pod('{"min":"1Gi","max":"8Gi","priority":300}', units=8, gpus=2))
    assert uid == "uid-a" and policy is not None
    assert (policy.kv_min, policy.kv_max, policy.priority) == (GIB, 8 * GIB, 300)
    assert policy.revision == kvpolicy.revision(GIB, 8 * GIB, 300)
    assert policy.per_gpu_bytes == 4 * GIB
    assert pod_policy(pod(None)) == ("uid-a", None)
    _, broken = pod_policy(pod('{"min":"1Gi","priority":"high"}'))
    assert broken is not None and "is not valid" in broken.error and "priority" in broken.error


def test_a_policy_applies_to_its_pods_pools_only_now_and_to_those_opened_later() -> None:
    books, (mine, other) = books_with("uid-a", "uid-b")
    table = PodPolicies()
    for record in books.pools():
        table.admitted(books, record, 0.0)
    _, policy = pod_policy(pod('{"min":"2Gi","max":"6Gi","priority":500}'))
    assert table.set("uid-a", policy) and not table.set("uid-a", policy)
    table.apply_changed(books, 1.0)
    record = books.pool(mine)
    assert record is not None and (record.kv_min, record.kv_max, record.priority) == (
        2 * GIB, 6 * GIB, 500,
    )  # fmt: skip
    untouched = books.pool(other)
    assert untouched is not None and (untouched.kv_max, untouched.priority) == (None, 100)
    states = table.states()
    assert policy is not None and states[mine].policy == policy.revision
    assert states[other].policy == kvpolicy.revision(GIB, None, 100)
    # The pod's engine restarts: its new pool runs the annotated policy from the start.
    later = books.admit(hello("p0", pod_uid="uid-a"), 30, 2.0).record
    assert later is not None
    table.admitted(books, later, 2.0)
    assert (later.kv_min, later.kv_max, later.priority) == (2 * GIB, 6 * GIB, 500)
    books.check()


def test_what_the_annotation_may_not_do_changes_nothing_and_says_why() -> None:
    books, (mine,) = books_with("uid-a")
    table = PodPolicies()
    record = books.pool(mine)
    assert record is not None
    table.admitted(books, record, 0.0)
    declared = table.states()[mine].policy
    cases = [
        # A minimum beyond what the pod's 4 GiB request covers after its 2 GiB static.
        (pod('{"min":"3Gi","priority":100}'), "exceed the 4Gi per GPU"),
        # One the GPU cannot guarantee (it is within the request of a pod that asks 16).
        (pod('{"min":"14Gi","priority":100}', units=16), "cannot guarantee"),
        (pod("not json"), "is not valid: not JSON"),
    ]
    for index, (body, why) in enumerate(cases):
        _, policy = pod_policy(body)
        assert policy is not None
        table.set("uid-a", policy)
        table.apply_changed(books, 1.0 + index)
        state = table.states()[mine]
        assert state.policy == declared and why in state.message, state
        assert state.refused == policy.revision
        assert (record.kv_min, record.kv_max, record.priority) == (GIB, None, 100)
    # Asked again for the policy it runs, the pool forgets the refusal.
    _, same = pod_policy(pod('{"min":"1Gi","priority":100}'))
    table.set("uid-a", same)
    table.apply_changed(books, 9.0)
    assert table.states()[mine] == PolicyState(declared)
    books.check()
