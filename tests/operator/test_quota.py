"""Reading the API server's quota refusals, and telling when a quota has room again."""

from __future__ import annotations

from kvshare.operator.quota import QuotaView, quota_refusal

# As k8s.io/apiserver's resourcequota admission writes it (resources sorted, comma-joined).
MESSAGE = (
    'pods "qwen-2" is forbidden: exceeded quota: team-a, requested: '
    "requests.kvshare.io/gpu=1,requests.kvshare.io/gpu-memory=22, used: "
    "requests.kvshare.io/gpu=3,requests.kvshare.io/gpu-memory=44, limited: "
    "requests.kvshare.io/gpu=4,requests.kvshare.io/gpu-memory=48"
)


def quota(hard: dict[str, str], used: dict[str, str]) -> QuotaView:
    return QuotaView.from_body(
        {
            "metadata": {"name": "team-a", "namespace": "llm"},
            "spec": {"hard": hard},
            "status": {"hard": hard, "used": used},
        }
    )


def test_a_quota_refusal_names_the_quota_what_was_asked_and_what_is_left() -> None:
    refusal = quota_refusal("qwen-2", 403, MESSAGE)
    assert refusal is not None
    assert refusal.quota == "team-a"
    assert refusal.requested == {
        "requests.kvshare.io/gpu": "1",
        "requests.kvshare.io/gpu-memory": "22",
    }
    assert refusal.left("requests.kvshare.io/gpu-memory") == "4"
    assert refusal.describe().startswith(
        "pod qwen-2 exceeds ResourceQuota team-a (requests.kvshare.io/gpu: asks 1, 1 left of "
        "4; requests.kvshare.io/gpu-memory: asks 22, 4 left of 48)"
    )


def test_what_is_left_keeps_the_quotas_unit() -> None:
    refusal = quota_refusal(
        "a-0",
        403,
        'pods "a-0" is forbidden: exceeded quota: mem, requested: requests.memory=40Gi, '
        "used: requests.memory=48Gi, limited: requests.memory=64Gi",
    )
    assert refusal is not None and refusal.left("requests.memory") == "16Gi"


def test_other_refusals_are_not_quota_refusals() -> None:
    assert quota_refusal("qwen-2", 422, MESSAGE) is None
    forbidden = 'pods "qwen-2" is forbidden: violates PodSecurity "restricted:latest"'
    assert quota_refusal("qwen-2", 403, forbidden) is None


def test_a_quota_has_room_when_freed_raised_or_no_longer_limiting() -> None:
    refusal = quota_refusal("qwen-2", 403, MESSAGE)
    assert refusal is not None
    full = {"requests.kvshare.io/gpu": "3", "requests.kvshare.io/gpu-memory": "44"}
    limits = {"requests.kvshare.io/gpu": "4", "requests.kvshare.io/gpu-memory": "48"}
    assert not quota(limits, full).has_room(refusal)
    freed = {"requests.kvshare.io/gpu": "2", "requests.kvshare.io/gpu-memory": "22"}
    assert quota(limits, freed).has_room(refusal)
    raised = {**limits, "requests.kvshare.io/gpu-memory": "72"}
    assert quota(raised, full).has_room(refusal)
    # Freed memory but no free slot: still no room.
    slots_full = {"requests.kvshare.io/gpu": "4", "requests.kvshare.io/gpu-memory": "0"}
    assert not quota(limits, slots_full).has_room(refusal)
    assert quota({"pods": "10"}, {"pods": "3"}).has_room(refusal)
