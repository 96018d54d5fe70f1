"""The chart's ValidatingAdmissionPolicies, as helm renders them, evaluated with
``cel-python`` the way the API server evaluates them (variables in order, then each
validation; a false validation refuses with its message):

- ``kv-priority``: a ModelServer asking for a KV priority above its namespace's ceiling
  (the chart's ``kvPriority``, read from the ConfigMap it renders) is refused, naming
  both; an update that leaves the priority as it was is not;
- ``own-node``: a node agent's ServiceAccount writes only the KVShareNode of the node its
  token is bound to; without that binding it writes none; other users are not matched.
"""

from __future__ import annotations

from typing import Any

import celpy
import pytest

from tests.chart.helm import NAMESPACE, Rendered, template

_ENV = celpy.Environment()


def _cel(expression: str, activation: dict[str, Any]) -> Any:
    program = _ENV.program(_ENV.compile(expression))
    result = program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()})
    if isinstance(result, celpy.CELEvalError):
        raise AssertionError(f"{expression!r} failed to evaluate: {result}")
    return result


def admit(policy: dict[str, Any], **context: Any) -> str | None:
    """What the API server answers: None (admitted, or not matched) or the refusal."""
    spec = policy["spec"]
    activation = {"object": None, "oldObject": None, "params": None, **context}
    for condition in spec.get("matchConditions", []):
        if not _cel(condition["expression"], activation):
            return None
    variables: dict[str, Any] = {}
    for variable in spec.get("variables", []):
        activation["variables"] = variables
        variables[variable["name"]] = _cel(variable["expression"], activation)
    activation["variables"] = variables
    for validation in spec["validations"]:
        if not _cel(validation["expression"], activation):
            return str(_cel(validation["messageExpression"], activation))
    return None


def policy(rendered: Rendered, suffix: str) -> dict[str, Any]:
    return rendered.one("ValidatingAdmissionPolicy", suffix)


# --- KV priorities -------------------------------------------------------------------------

CEILINGS = {"kvPriority.default": 100, "kvPriority.namespaces": {"team-a": 500, "default": 300}}


def modelserver(namespace: str, priority: int) -> dict[str, Any]:
    return {"metadata": {"name": "qwen", "namespace": namespace},
            "spec": {"kvCache": {"priority": priority}}}  # fmt: skip


def request(namespace: str, operation: str = "CREATE", **user: Any) -> dict[str, Any]:
    return {"namespace": namespace, "operation": operation, "name": "qwen",
            "userInfo": {"username": "alice", "extra": {}, **user}}  # fmt: skip


@pytest.fixture(scope="module")
def priorities() -> tuple[dict[str, Any], dict[str, Any]]:
    rendered = template(CEILINGS)
    configmap = rendered.one("ConfigMap", "-kv-priority")
    binding = rendered.one("ValidatingAdmissionPolicyBinding", "-kv-priority")
    assert binding["spec"]["paramRef"] == {
        "name": configmap["metadata"]["name"], "namespace": NAMESPACE,
        "parameterNotFoundAction": "Deny",
    }  # fmt: skip
    assert binding["spec"]["validationActions"] == ["Deny"]
    return policy(rendered, "-kv-priority"), configmap


@pytest.mark.parametrize(
    ("namespace", "priority", "refused"),
    [
        ("llm", 1000, "kvCache.priority 1000 is above 100, the most namespace llm may use"),
        ("llm", 101, "kvCache.priority 101 is above 100"),
        ("llm", 100, None),
        ("llm", 0, None),
        ("team-a", 500, None),
        ("team-a", 501, "kvCache.priority 501 is above 500, the most namespace team-a may use"),
        ("default", 300, None),  # a namespace named "default" has its own key
        ("default", 301, "kvCache.priority 301 is above 300"),
    ],
)
def test_a_modelserver_above_its_namespaces_ceiling_is_refused(
    priorities: tuple[dict[str, Any], dict[str, Any]],
    namespace: str,
    priority: int,
    refused: str | None,
) -> None:
    vap, configmap = priorities
    answer = admit(vap, object=modelserver(namespace, priority), request=request(namespace),
                   params=configmap)  # fmt: skip
    if refused is None:
        assert answer is None
    else:
        assert answer is not None and answer.startswith(refused), answer
        assert "ask a cluster administrator (chart value kvPriority)" in answer


def test_raising_it_on_update_is_refused_leaving_it_is_not(
    priorities: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    vap, configmap = priorities
    old = modelserver("llm", 900)  # admitted under an older, higher ceiling
    kept = admit(vap, object=modelserver("llm", 900), oldObject=old,
                 request=request("llm", "UPDATE"), params=configmap)  # fmt: skip
    assert kept is None  # scaling or editing other fields is not blocked; the operator caps
    raised = admit(vap, object=modelserver("llm", 950), oldObject=old,
                   request=request("llm", "UPDATE"), params=configmap)  # fmt: skip
    assert raised is not None and raised.startswith("kvCache.priority 950 is above 100")


def test_the_ceilings_reach_the_operator_and_the_node_agents_too() -> None:
    rendered = template(CEILINGS)
    for kind in ("Deployment", "DaemonSet"):
        (container,) = rendered.one(kind)["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert "--kv-priority-default=100" in args, kind
        assert {"--kv-priority=team-a=500", "--kv-priority=default=300"} <= set(args), kind


def test_the_policy_can_be_left_out_but_the_ceilings_stay() -> None:
    rendered = template({**CEILINGS, "kvPriority.admissionPolicy": False})
    assert not [p for p in rendered.of_kind("ValidatingAdmissionPolicy")
                if p["metadata"]["name"].endswith("-kv-priority")]  # fmt: skip
    assert rendered.one("ConfigMap", "-kv-priority")["data"]["default"] == "100"


# --- each node agent writes only its own KVShareNode ----------------------------------------

NODE_NAME_KEY = "authentication.kubernetes.io/node-name"


@pytest.fixture(scope="module")
def own_node() -> tuple[dict[str, Any], str]:
    rendered = template()
    account = rendered.one("ServiceAccount", "-node-agent")["metadata"]["name"]
    binding = rendered.one("ValidatingAdmissionPolicyBinding", "-own-node")
    assert binding["spec"]["validationActions"] == ["Deny"]
    return policy(rendered, "-own-node"), f"system:serviceaccount:{NAMESPACE}:{account}"


def kvsharenode(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"nodeName": name}}


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE"])
def test_a_node_agent_writes_its_own_nodes_kvsharenode(
    own_node: tuple[dict[str, Any], str], operation: str
) -> None:
    vap, agent = own_node
    token = {"username": agent, "extra": {NODE_NAME_KEY: ["gpu-7"]}}
    own = admit(vap, object=kvsharenode("gpu-7"), oldObject=kvsharenode("gpu-7"),
                request={"operation": operation, "name": "gpu-7", "userInfo": token})  # fmt: skip
    assert own is None


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_a_node_agent_may_not_write_another_nodes_kvsharenode(
    own_node: tuple[dict[str, Any], str], operation: str
) -> None:
    vap, agent = own_node
    token = {"username": agent, "extra": {NODE_NAME_KEY: ["gpu-7"]}}
    target = kvsharenode("gpu-8")
    answer = admit(
        vap,
        object=None if operation == "DELETE" else target,
        oldObject=target,
        request={"operation": operation, "name": "gpu-8", "userInfo": token},
    )
    assert answer == "the node agent of node gpu-7 may write only KVShareNode gpu-7, not gpu-8"


def test_a_token_not_bound_to_a_node_writes_no_kvsharenode(
    own_node: tuple[dict[str, Any], str],
) -> None:
    vap, agent = own_node
    unbound = {"username": agent, "extra": {}}
    create = {"operation": "CREATE", "name": "gpu-7", "userInfo": unbound}
    answer = admit(vap, object=kvsharenode("gpu-7"), request=create)
    assert answer == "the node agent may write KVShareNodes only with a token bound to its node"


def test_other_users_are_not_matched(own_node: tuple[dict[str, Any], str]) -> None:
    vap, _ = own_node
    admin = {"username": "kubernetes-admin", "extra": {}}
    update = {"operation": "UPDATE", "name": "gpu-8", "userInfo": admin}
    assert admit(vap, object=kvsharenode("gpu-8"), request=update) is None
