"""The chart renders, lints and validates with the real helm for every configuration users
pick, and what it renders holds the properties the chart promises (least privilege on the
node, GPU nodes only, monitoring only where the Prometheus Operator exists, ...).

Objects of Kubernetes' own APIs are validated with kubernetes-validate (strict: unknown
fields are errors) against Kubernetes 1.30 to 1.34; kvshare's and kopf's custom resources
against their CRDs' schemas. Prometheus Operator and cert-manager objects have no schema
offline: their rules are checked by promtool (test_alerts.py), their shape here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from kvshare.api import env as env_module
from kvshare.api import names
from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY, POLICIES
from kvshare.deviceplugin.cluster import node_config
from kvshare.deviceplugin.cluster.node_config import NodeConfigFile, load_config_file, select
from tests.chart.helm import (
    CERT_MANAGER,
    CHART,
    PROMETHEUS_OPERATOR,
    Rendered,
    helm,
    notes,
    set_args,
    template,
)
from tests.k8s_schema import admit

KUBERNETES_VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34")

#: name -> (values, API groups the cluster serves). The matrix every check runs over.
MATRIX: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "defaults": ({}, ()),
    "monitoring-with-prometheus-operator": ({"monitoring.enabled": True}, PROMETHEUS_OPERATOR),
    "monitoring-without-prometheus-operator": ({"monitoring.enabled": True}, ()),
    "webhook-helm-certificate": ({"webhook.enabled": True}, ()),
    "webhook-cert-manager": (
        {"webhook.enabled": True, "webhook.certificate.source": "cert-manager"},
        CERT_MANAGER,
    ),
    "no-cdi": ({"cdi.enabled": False}, ()),
    "kv-priorities": (
        {"kvPriority.default": 50, "kvPriority.namespaces": {"team-a": 500, "default": 200}},
        (),
    ),
    "no-admission-policies": (
        {"kvPriority.admissionPolicy": False, "nodeAgent.admissionPolicy": False},
        (),
    ),
    "custom-scheduling": (
        {
            # Helm merges maps with the defaults; null removes the default GPU label.
            "nodeAgent.nodeSelector": {"gpu-pool": "inference", "nvidia.com/gpu.present": None},
            "nodeAgent.tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
            "nodeAgent.affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "gpu-type", "operator": "In", "values": ["h100"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "operator.nodeSelector": {"role": "system"},
        },
        (),
    ),
    "two-operator-replicas": ({"operator.replicas": 2}, ()),
    "per-node-configs": (
        {
            "nodeAgent.configs": {
                "h100-dense": {"slotsPerGpu": 16, "headroom": "1Gi"},
                "lab": {"fakeGpus": "2x16Gi"},
            }
        },
        (),
    ),
    "team-quotas": (
        {
            "quotas": [
                {"namespace": "team-a", "gpuMemory": 160, "gpuSlots": 8},
                {"namespace": "team-b", "gpuMemory": 48, "hard": {"requests.cpu": "64"}},
            ]
        },
        (),
    ),
    "fake-gpus": ({"nodeAgent.fakeGpus": "2x80Gi", "nodeAgent.runtimeClassName": ""}, ()),
    "everything": (
        {
            "monitoring.enabled": True,
            "webhook.enabled": True,
            "cdi.enabled": True,
            "operator.replicas": 2,
            "monitoring.labels": {"release": "kube-prometheus"},
            "dashboard.annotations": {"grafana_folder": "kvshare"},
            "image.digest": "sha256:" + "0" * 64,
        },
        PROMETHEUS_OPERATOR + CERT_MANAGER,
    ),
}
_CASES = [pytest.param(values, apis, id=name) for name, (values, apis) in MATRIX.items()]


def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> CRD of every CRD the chart ships."""
    found = {}
    for path in sorted((CHART / "crds").glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                found[key] = crd
    return found


#: Kinds whose schema is not available offline (see the module docstring).
_NO_SCHEMA_OFFLINE = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Issuer"),
    ("cert-manager.io/v1", "Certificate"),
}


@pytest.mark.parametrize(("values", "apis"), _CASES)
def test_chart_lints_clean(values: dict[str, Any], apis: tuple[str, ...]) -> None:
    done = helm("lint", "--strict", str(CHART), *set_args(values))
    # --strict turns warnings into failures; the only INFO is the missing icon.
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("values", "apis"), _CASES)
def test_every_rendered_object_is_valid_for_kubernetes_1_30_to_1_34(
    values: dict[str, Any], apis: tuple[str, ...]
) -> None:
    rendered = template(values, apis)
    crds = crd_schemas()
    for obj in rendered.objects:
        key = (obj["apiVersion"], obj["kind"])
        if key in crds:
            assert admit(crds[key], obj) == [], obj["metadata"]["name"]
            continue
        if key in _NO_SCHEMA_OFFLINE:
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {exc}")


def test_chart_crds_are_exactly_what_kvshare_crds_prints() -> None:
    from kvshare.api.crds import crds_yaml

    shipped = (CHART / "crds" / "kvshare.io.yaml").read_text(encoding="utf-8")
    assert shipped == crds_yaml(), "the chart's CRDs are stale: run `make crds`"


def test_chart_version_follows_kvshare_version() -> None:
    from kvshare import __version__

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert chart["version"] == chart["appVersion"] == __version__


def _pod_spec(rendered: Rendered, kind: str) -> dict[str, Any]:
    return dict(rendered.one(kind)["spec"]["template"]["spec"])


def test_operator_runs_non_root_read_only_with_requests() -> None:
    spec = _pod_spec(template(), "Deployment")
    assert spec["securityContext"]["runAsNonRoot"] is True
    (container,) = spec["containers"]
    assert container["args"][0] == "operator"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert set(container["resources"]["requests"]) == {"cpu", "memory"}


def test_two_operator_replicas_get_peering_and_a_disruption_budget() -> None:
    single, double = template(), template({"operator.replicas": 2})
    assert single.of_kind("PodDisruptionBudget") == []
    assert double.one("Deployment")["spec"]["replicas"] == 2
    assert double.one("PodDisruptionBudget")["spec"]["minAvailable"] == 1
    peering = double.one("ClusterKopfPeering")["metadata"]["name"]
    args = _pod_spec(double, "Deployment")["containers"][0]["args"]
    assert f"--peering={peering}" in args


def test_quotas_bound_each_team_namespaces_gpu_memory_and_slots() -> None:
    rendered = template(
        {
            "quotas": [
                {"namespace": "team-a", "gpuMemory": 160, "gpuSlots": 8},
                {"namespace": "team-b", "gpuMemory": 48, "hard": {"requests.cpu": "64"}},
            ]
        }
    )
    quotas = {
        q["metadata"]["namespace"]: q["spec"]["hard"] for q in rendered.of_kind("ResourceQuota")
    }
    assert quotas == {
        "team-a": {
            f"requests.{names.RESOURCE_GPU_MEMORY}": "160",
            f"requests.{names.RESOURCE_GPU}": "8",
        },
        "team-b": {f"requests.{names.RESOURCE_GPU_MEMORY}": "48", "requests.cpu": "64"},
    }
    assert template().of_kind("ResourceQuota") == []


def test_node_agent_mounts_only_the_device_plugin_folder_its_own_and_the_pods() -> None:
    spec = _pod_spec(template(), "DaemonSet")
    host_paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    pod_resources = str(Path(names.POD_RESOURCES_SOCKET).parent)
    assert host_paths == {names.DEVICE_PLUGIN_DIR, names.RUN_DIR, names.ADMIN_DIR, pod_resources}
    (container,) = spec["containers"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert {names.DEVICE_PLUGIN_DIR, names.RUN_DIR, names.ADMIN_DIR} <= set(mounts)
    assert mounts[pod_resources]["readOnly"] is True
    # The admin socket and restart file are in the agent's own directory, apart from the
    # one Allocate mounts into pods (RUN_DIR).
    assert f"--admin-dir={names.ADMIN_DIR}" in container["args"]
    assert not Path(names.ADMIN_DIR).is_relative_to(names.RUN_DIR)
    assert f"--pod-resources-socket={names.POD_RESOURCES_SOCKET}" in container["args"]
    context = container["securityContext"]
    assert not context.get("privileged", False)
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True
    assert not spec.get("hostNetwork", False)
    assert container["ports"][0]["containerPort"] == names.METRICS_PORT


def test_node_agent_runs_on_gpu_nodes_only_and_scheduling_is_configurable() -> None:
    default = _pod_spec(template(), "DaemonSet")
    assert default["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in default[
        "tolerations"
    ]
    values, _ = MATRIX["custom-scheduling"]
    custom = _pod_spec(template(values), "DaemonSet")
    assert custom["nodeSelector"] == {"gpu-pool": "inference"}
    assert custom["tolerations"] == values["nodeAgent.tolerations"]
    assert custom["affinity"] == values["nodeAgent.affinity"]
    assert _pod_spec(template(values), "Deployment")["nodeSelector"] == {"role": "system"}


def node_configs(rendered: Rendered, tmp_path: Path) -> NodeConfigFile:
    """The node agents' configuration file as rendered, read by the agent's own loader
    from where the DaemonSet mounts it and its --config flag names it."""
    spec = _pod_spec(rendered, "DaemonSet")
    (container,) = spec["containers"]
    (flag,) = [a for a in container["args"] if a.startswith("--config=")]
    path = Path(flag.removeprefix("--config="))
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(path.parent)]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    configmap = rendered.one("ConfigMap", volume["configMap"]["name"])
    file = tmp_path / path.name
    file.write_text(configmap["data"][path.name], encoding="utf-8")
    return load_config_file(file)


def test_cdi_is_the_default_and_fake_gpus_reach_the_node_agent(tmp_path: Path) -> None:
    args = _pod_spec(template(), "DaemonSet")["containers"][0]["args"]
    assert "--cdi-kind=nvidia.com/gpu" in args  # no variable can widen a pod's GPUs
    assert node_configs(template(), tmp_path).default.fake_gpus == ""
    plain = _pod_spec(template({"cdi.enabled": False}), "DaemonSet")["containers"][0]["args"]
    assert not any(a.startswith("--cdi") for a in plain)
    fake = template({"nodeAgent.fakeGpus": "2x80Gi"})
    assert node_configs(fake, tmp_path).default.fake_gpus == "2x80Gi"
    container = _pod_spec(fake, "DaemonSet")["containers"][0]
    # Declared GPUs need no NVIDIA runtime access.
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in container["env"]}


def test_the_broker_policy_value_reaches_the_node_agent() -> None:
    args = _pod_spec(template(), "DaemonSet")["containers"][0]["args"]
    assert f"--broker-policy={DEFAULT_POLICY}" in args
    fair = _pod_spec(template({"nodeAgent.brokerPolicy": "fair-share"}), "DaemonSet")
    assert "--broker-policy=fair-share" in fair["containers"][0]["args"]


def test_each_node_runs_the_configuration_its_label_names(tmp_path: Path) -> None:
    values, _ = MATRIX["per-node-configs"]
    rendered = template(values)
    configs = node_configs(rendered, tmp_path)
    args = _pod_spec(rendered, "DaemonSet")["containers"][0]["args"]
    label = "kvshare.io/node-config"
    assert f"--config-label={label}" in args

    default = select(configs, {"kubernetes.io/hostname": "gpu-1"}, label)
    assert (default.name, default.settings.slots_per_gpu, default.settings.headroom) == (
        "default",
        8,
        512 * 2**20,
    )
    dense = select(configs, {label: "h100-dense"}, label)
    assert dense.name == "h100-dense"
    assert (dense.settings.slots_per_gpu, dense.settings.headroom) == (16, 2**30)
    assert dense.settings.reclaim_deadline_seconds == 10  # from the defaults
    lab = select(configs, {label: "lab"}, label).settings
    assert (lab.fake_gpus, lab.slots_per_gpu) == ("2x16Gi", 8)
    typo = select(configs, {label: "h100-dense2"}, label)
    assert typo.name == "default" and "names no configuration" in typo.problem


def test_a_changed_configuration_restarts_the_node_agents() -> None:
    def checksum(values: dict[str, Any]) -> str:
        spec = template(values).one("DaemonSet")["spec"]["template"]
        return str(spec["metadata"]["annotations"]["checksum/node-config"])

    values, _ = MATRIX["per-node-configs"]
    assert checksum({}) != checksum(values)
    assert checksum(values) == checksum(values)
    assert checksum({"nodeAgent.slotsPerGpu": 4}) != checksum({})


def test_rbac_has_no_wildcards_and_binds_each_service_account() -> None:
    rendered = template()
    for role in rendered.of_kind("ClusterRole"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], (role["metadata"]["name"], rule)
    accounts = {a["metadata"]["name"] for a in rendered.of_kind("ServiceAccount")}
    bound = {b["subjects"][0]["name"] for b in rendered.of_kind("ClusterRoleBinding")}
    assert accounts == bound
    for kind in ("Deployment", "DaemonSet"):
        assert _pod_spec(rendered, kind)["serviceAccountName"] in accounts


def test_monitoring_objects_exist_only_where_the_prometheus_operator_api_does() -> None:
    monitoring = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    assert not monitoring & template().kinds()
    assert not monitoring & template({"monitoring.enabled": True}).kinds()
    with_api = template({"monitoring.enabled": True}, PROMETHEUS_OPERATOR)
    assert monitoring <= with_api.kinds()
    no_alerts = template(
        {"monitoring.enabled": True, "monitoring.alerts.enabled": False}, PROMETHEUS_OPERATOR
    )
    assert "PrometheusRule" not in no_alerts.kinds()


def test_monitors_set_the_job_names_the_dashboard_and_alerts_select() -> None:
    rendered = template({"monitoring.enabled": True}, PROMETHEUS_OPERATOR)
    pod_monitor = rendered.one("PodMonitor")["spec"]["podMetricsEndpoints"][0]
    service_monitor = rendered.one("ServiceMonitor")["spec"]["endpoints"][0]
    assert {"targetLabel": "job", "replacement": "kvshare-node-agent"} in pod_monitor["relabelings"]
    assert {"targetLabel": "job", "replacement": "kvshare-operator"} in service_monitor[
        "relabelings"
    ]


def test_monitors_keep_the_namespace_and_pod_labels_of_kvshares_own_series() -> None:
    """Per-ModelServer and per-pool series name the model server's namespace (and pod);
    the target's labels of the same name (kvshare's own pod) must not displace them."""
    rendered = template({"monitoring.enabled": True}, PROMETHEUS_OPERATOR)
    assert rendered.one("PodMonitor")["spec"]["podMetricsEndpoints"][0]["honorLabels"] is True
    assert rendered.one("ServiceMonitor")["spec"]["endpoints"][0]["honorLabels"] is True


def test_dashboard_configmap_carries_the_dashboard_and_the_sidecar_label() -> None:
    rendered = template({"dashboard.labels": {"grafana": "dashboards"}})
    config_map = rendered.one("ConfigMap", "-dashboard")
    assert config_map["metadata"]["labels"]["grafana"] == "dashboards"
    shipped = json.loads((CHART / "dashboards" / "kvshare.json").read_text(encoding="utf-8"))
    assert json.loads(config_map["data"]["kvshare.json"]) == shipped
    without = template({"dashboard.enabled": False}).of_kind("ConfigMap")
    assert not [c for c in without if c["metadata"]["name"].endswith("-dashboard")]


def test_webhook_with_helm_certificate_trusts_the_ca_it_serves_with() -> None:
    import base64
    import ssl
    import tempfile

    rendered = template({"webhook.enabled": True})
    secret = rendered.one("Secret", "-webhook-tls")
    config = rendered.one("MutatingWebhookConfiguration")
    (hook,) = config["webhooks"]
    assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    assert hook["objectSelector"] == {"matchLabels": {names.LABEL_INJECT: "true"}}
    # The served certificate verifies against that CA for the Service's DNS name.
    with tempfile.TemporaryDirectory() as tmp:
        ca = Path(tmp) / "ca.crt"
        ca.write_bytes(base64.b64decode(secret["data"]["ca.crt"]))
        context = ssl.create_default_context(cafile=str(ca))
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert, key = Path(tmp) / "tls.crt", Path(tmp) / "tls.key"
        cert.write_bytes(base64.b64decode(secret["data"]["tls.crt"]))
        key.write_bytes(base64.b64decode(secret["data"]["tls.key"]))
        server.load_cert_chain(str(cert), str(key))
        _handshake(server, context, f"{config['webhooks'][0]['clientConfig']['service']['name']}"
                   ".kvshare.svc")  # fmt: skip
    mounts = _pod_spec(rendered, "Deployment")["containers"][0]["volumeMounts"]
    assert any(m["name"] == "webhook-certificate" for m in mounts)


def _handshake(server: Any, client: Any, hostname: str) -> None:
    """A real TLS handshake over a socket pair, verifying ``hostname``."""
    import socket
    import threading

    left, right = socket.socketpair()
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            with server.wrap_socket(left, server_side=True) as tls:
                tls.recv(1)
        except (OSError, ValueError) as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    with client.wrap_socket(right, server_hostname=hostname) as tls:
        tls.sendall(b"x")
    thread.join(timeout=30)
    assert errors == []


def test_webhook_with_cert_manager_needs_its_api_and_lets_it_inject_the_ca() -> None:
    values = {"webhook.enabled": True, "webhook.certificate.source": "cert-manager"}
    rendered = template(values, CERT_MANAGER)
    config = rendered.one("MutatingWebhookConfiguration")
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].startswith(
        "kvshare/"
    )
    assert "caBundle" not in config["webhooks"][0]["clientConfig"]
    assert rendered.one("Certificate")["spec"]["secretName"].endswith("-webhook-tls")
    done = helm("template", "kvshare", str(CHART), *set_args(values))
    assert done.returncode != 0
    assert "does not serve the cert-manager.io/v1 API" in done.stderr


def test_webhook_objects_only_when_enabled() -> None:
    kinds = template().kinds()
    assert "MutatingWebhookConfiguration" not in kinds
    assert "Secret" not in kinds


def test_helm_test_pod_checks_both_metrics_endpoints() -> None:
    rendered = template()
    (pod,) = [p for p in rendered.of_kind("Pod") if "test" in p["metadata"]["name"]]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    command = pod["spec"]["containers"][0]["command"]
    targets = command[4:]
    assert targets == [
        f"kvshare-operator-metrics.kvshare.svc:{8080}",
        f"kvshare-node-agent-metrics.kvshare.svc:{names.METRICS_PORT}",
    ]
    services = {s["metadata"]["name"] for s in rendered.of_kind("Service")}
    assert {t.split(".")[0] for t in targets} <= services


def test_notes_tell_the_next_steps(tmp_path: Path) -> None:
    text = notes(workdir=tmp_path / "a")
    assert "kubectl apply -f examples/qwen-7b-vllm.yaml" in text
    assert "helm test kvshare -n kvshare" in text
    assert "kubectl get kvsharenodes" in text


def test_notes_warn_when_monitoring_is_asked_for_without_the_prometheus_operator(
    tmp_path: Path,
) -> None:
    without = notes({"monitoring.enabled": True}, workdir=tmp_path / "a")
    assert "does not serve monitoring.coreos.com/v1" in without
    with_api = notes({"monitoring.enabled": True}, PROMETHEUS_OPERATOR, workdir=tmp_path / "b")
    assert "does not serve" not in with_api
    assert 'job="kvshare-node-agent"' in with_api


@pytest.mark.parametrize(("values", "apis"), _CASES)
def test_programs_accept_every_flag_the_chart_passes(
    values: dict[str, Any], apis: tuple[str, ...]
) -> None:
    """The kvshare command line parses the containers' args exactly as the image runs them
    (ENTRYPOINT kvshare), for every configuration of the matrix."""
    from kvshare.cli import SUBCOMMANDS, build_parser

    rendered = template(values, apis)
    for kind in ("Deployment", "DaemonSet"):
        container = _pod_spec(rendered, kind)["containers"][0]
        assert container["args"][0] in SUBCOMMANDS
        # Kubernetes expands $(VAR) from the container's env; any value will do here.
        names_set = {e["name"] for e in container["env"]}
        args = []
        for arg in container["args"]:
            for name in re.findall(r"\$\((\w+)\)", arg):
                assert name in names_set, f"{kind}: $({name}) is not in the container's env"
            args.append(re.sub(r"\$\((\w+)\)", "value", arg))
        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{kind}: kvshare refuses {args}")


def test_chart_defaults_agree_with_the_names_the_programs_use() -> None:
    """Ports, the peering object, the webhook's path and its certificate files are the
    programs' own defaults (kvshare.api.names), not a second copy that could drift."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    assert defaults["operator"]["metricsPort"] == names.OPERATOR_METRICS_PORT
    assert defaults["operator"]["peeringName"] == names.PEERING_NAME
    assert defaults["nodeAgent"]["metricsPort"] == names.METRICS_PORT
    assert defaults["nodeAgent"]["devicePluginDir"] == names.DEVICE_PLUGIN_DIR
    assert defaults["nodeAgent"]["configLabel"] == node_config.DEFAULT_LABEL
    assert defaults["nodeAgent"]["brokerPolicy"] == DEFAULT_POLICY
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    policy = schema["properties"]["nodeAgent"]["properties"]["brokerPolicy"]
    assert sorted(policy["enum"]) == sorted(POLICIES)
    assert defaults["webhook"]["port"] == names.WEBHOOK_PORT
    rendered = template({"webhook.enabled": True})
    (hook,) = rendered.one("MutatingWebhookConfiguration")["webhooks"]
    assert hook["clientConfig"]["service"]["path"] == names.WEBHOOK_INJECT_PATH
    secret = rendered.one("Secret", "-webhook-tls")
    assert {names.WEBHOOK_CERT_FILE, names.WEBHOOK_KEY_FILE} <= set(secret["data"])
    container = _pod_spec(rendered, "Deployment")["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "webhook-certificate"]
    assert f"--webhook-cert-dir={mount['mountPath']}" in container["args"]
    env = {e["name"] for e in container["env"]}
    assert env_module.IMAGE.name in env
