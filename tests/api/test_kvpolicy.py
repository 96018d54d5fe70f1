"""The KV-policy annotation: what the operator writes reads back the same, and what a
careless or hostile hand writes is refused with the reason, never half read."""

from __future__ import annotations

import json

import pytest

from kvshare.api import kvpolicy
from kvshare.api.kube import validate
from kvshare.api.modelserver import KVCacheSpec

GIB = 2**30


def spec(**fields: object) -> KVCacheSpec:
    return validate(KVCacheSpec, {"min": "4Gi", "max": "40Gi", "priority": 200, **fields})


def test_an_encoded_policy_decodes_to_the_same_policy() -> None:
    policy = spec()
    text = kvpolicy.encode(policy)
    assert text == '{"max":"40Gi","min":"4Gi","priority":200}'
    assert kvpolicy.decode(text) == policy
    uncapped = validate(KVCacheSpec, {"min": "1Gi"})
    assert kvpolicy.decode(kvpolicy.encode(uncapped)) == uncapped


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "not JSON"),
        ("min=4Gi", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"min": "4Gi", "max": "1Gi"}', "exceeds kvCache.max"),
        ('{"min": "4Gi", "priority": 5000}', "priority"),
        ('{"min": "lots"}', "min"),
        ('{"min": "4Gi", "owner": "me"}', "owner"),
        ('{"min": "2Ti"}', "more than 1Ti"),
        ("[" * 100_000, "longer than"),
        (json.dumps({"min": "4Gi", "pad": "x" * 2000}), "longer than"),
    ],
    ids=lambda v: str(v)[:24],
)
def test_a_bad_annotation_is_refused_saying_why(text: str, why: str) -> None:
    with pytest.raises(kvpolicy.PolicyError, match=why):
        kvpolicy.decode(text)


def test_revisions_name_policies_the_same_on_both_sides() -> None:
    policy = spec()
    assert kvpolicy.revision(4 * GIB, 40 * GIB, 200) == kvpolicy.revision(
        policy.min, policy.max, policy.priority
    )
    assert kvpolicy.revision(4 * GIB, None, 200) != kvpolicy.revision(4 * GIB, 40 * GIB, 200)
    assert kvpolicy.revision(4 * GIB, 40 * GIB, 201) != kvpolicy.revision(4 * GIB, 40 * GIB, 200)
    assert kvpolicy.describe(policy) == "min 4Gi, max 40Gi, priority 200"
