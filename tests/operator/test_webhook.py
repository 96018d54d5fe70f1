"""The webhook injects the runtime into user pods with the same function as replica pods."""

from __future__ import annotations

from kvshare.api import names
from kvshare.operator.render import RUNTIME_INIT_CONTAINER, RuntimeImage, inject_runtime
from kvshare.operator.webhook import injection_for

RUNTIME = RuntimeImage("registry.example/kvshare:1.0")


def user_pod() -> dict[str, object]:
    return {
        "metadata": {"labels": {names.LABEL_INJECT: "true"}},
        "spec": {
            "containers": [
                {
                    "name": "server",
                    "resources": {
                        "limits": {names.RESOURCE_GPU: "1", names.RESOURCE_GPU_MEMORY: "24"}
                    },
                },
                {"name": "proxy"},
            ]
        },
    }


def test_containers_on_kvshare_gpus_get_the_runtime() -> None:
    pod = user_pod()
    injection = injection_for(pod, RUNTIME)
    assert injection.warnings == ()
    assert injection.spec == {
        k: v
        for k, v in inject_runtime(pod, RUNTIME, ["server"])["spec"].items()
        if k in ("initContainers", "containers", "volumes")
    }
    assert injection.spec["initContainers"][0]["name"] == RUNTIME_INIT_CONTAINER  # type: ignore[index]
    server, proxy = injection.spec["containers"]  # type: ignore[misc]
    assert any(e["name"] == "KVSHARE_ENABLE" for e in server["env"])
    assert proxy == {"name": "proxy"}


def test_a_pod_without_kvshare_gpus_gets_a_warning_and_nothing_else() -> None:
    pod = {"spec": {"containers": [{"name": "web"}]}}
    injection = injection_for(pod, RUNTIME)
    assert injection.spec == {}
    assert injection.warnings and "no container requests kvshare.io/gpu" in injection.warnings[0]


def test_a_pod_without_a_gpu_memory_request_is_warned_the_agent_will_refuse_its_pools() -> None:
    pod = user_pod()
    del pod["spec"]["containers"][0]["resources"]["limits"][names.RESOURCE_GPU_MEMORY]
    injection = injection_for(pod, RUNTIME)
    assert injection.spec  # injected all the same
    assert (
        injection.warnings
        and "no container requests kvshare.io/gpu-memory" in (injection.warnings[0])
    )


def test_an_injected_pod_is_left_as_it_is() -> None:
    injected = inject_runtime(user_pod(), RUNTIME, ["server"])
    assert injection_for(injected, RUNTIME).spec == {}
