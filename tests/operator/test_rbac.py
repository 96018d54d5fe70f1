"""The list of API calls the chart's RBAC is generated from.

Every test that runs the operator checks, when it ends, that each request the operator
sent to the emulated API server is in this list (see ``conftest.py``); these tests pin
its shape for the chart.
"""

from __future__ import annotations

from kvshare.api import names
from kvshare.operator.rbac import API_CALLS, NAMESPACED_PEERING_CALLS, rbac_rules

VERBS = {"get", "list", "watch", "create", "update", "patch", "delete"}


def test_each_resource_is_listed_once_with_kubernetes_verbs_and_a_reason() -> None:
    keys = [(c.group, c.resource) for c in (*API_CALLS, *NAMESPACED_PEERING_CALLS)]
    assert len(keys) == len(set(keys))
    for call in (*API_CALLS, *NAMESPACED_PEERING_CALLS):
        assert set(call.verbs) <= VERBS and call.verbs
        assert call.why


def test_rules_are_clusterrole_rules() -> None:
    rules = rbac_rules()
    assert rules[0] == {
        "apiGroups": [names.GROUP],
        "resources": [names.MODELSERVER_PLURAL],
        "verbs": ["list", "watch"],
    }
    assert {
        "apiGroups": [""],
        "resources": ["pods"],
        "verbs": ["list", "watch", "create", "delete", "patch"],
    } in rules
    # Least privilege: nothing writes ModelServer specs, KVShareNodes or Nodes.
    writes = {"create", "update", "patch", "delete"}
    for rule in rules:
        if rule["resources"][0] in (names.MODELSERVER_PLURAL, names.KVSHARENODE_PLURAL, "nodes"):
            assert not writes & set(rule["verbs"])
