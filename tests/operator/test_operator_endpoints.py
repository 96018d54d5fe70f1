"""What the operator process serves and how it starts: /healthz and /metrics, the
runtime-injection webhook over TLS, and a clear refusal without a cluster."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import jsonpatch
import pytest

from kvshare.api import env, names
from kvshare.operator.metrics import registry
from kvshare.operator.render import RUNTIME_INIT_CONTAINER
from tests.operator.harness import Cluster, StartOperator, eventually, metric, wait_for


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def self_signed(folder: Path) -> Path:
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-keyout", str(folder / names.WEBHOOK_KEY_FILE),
            "-out", str(folder / names.WEBHOOK_CERT_FILE),
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return folder


def review(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()),
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "namespace": "lab",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def user_pod(labelled: bool) -> dict[str, Any]:
    labels = {names.LABEL_INJECT: "true"} if labelled else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "notebook", "namespace": "lab", "labels": labels},
        "spec": {
            "containers": [
                {"name": "jupyter", "image": "jupyter/base",
                 "resources": {"limits": {names.RESOURCE_GPU: "1"}}}
            ]
        },
    }  # fmt: skip


def test_the_registry_has_the_operator_metrics() -> None:
    names_ = {metric.name for metric in registry().collect()}
    assert {
        "kvshare_operator_reconcile_seconds",
        "kvshare_operator_placements",
        "kvshare_operator_reconcile_errors",
        "kvshare_modelservers",
        "kvshare_modelserver_status_phase",
        "kvshare_modelserver_replicas",
        "kvshare_modelserver_ready_replicas",
        "kvshare_modelserver_kv_used_bytes",
        "kvshare_modelserver_kv_pressure_ratio",
    } <= names_


@pytest.mark.asyncio
async def test_healthz_answers_and_metrics_are_prometheus_text(
    cluster: Cluster, start_operator: StartOperator
) -> None:
    process = start_operator()
    port = await wait_for(process.metrics_port, "the metrics port")

    async def healthy() -> bool:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/healthz") as response,
        ):
            return response.status == 200

    await eventually(healthy, "/healthz to answer 200")
    phases = await metric(process, "kvshare_modelservers")
    assert set(phases) == {'{phase="Pending"}', '{phase="Unschedulable"}', '{phase="Starting"}',
                           '{phase="Ready"}', '{phase="Degraded"}'}  # fmt: skip
    assert "_bucket" in json.dumps(
        list(await metric(process, "kvshare_operator_reconcile_seconds"))
    )


@pytest.mark.asyncio
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_the_webhook_injects_the_runtime_into_labelled_pods_over_tls(
    cluster: Cluster, start_operator: StartOperator, tmp_path: Path
) -> None:
    certs = self_signed(tmp_path)
    port = free_port()
    start_operator("operator-a", "--webhook-cert-dir", str(certs), "--webhook-port", str(port))
    context = ssl.create_default_context(cafile=str(certs / names.WEBHOOK_CERT_FILE))
    url = f"https://localhost:{port}{names.WEBHOOK_INJECT_PATH}"
    answers: dict[bool, dict[str, Any]] = {}

    async def answered() -> bool:
        try:
            async with aiohttp.ClientSession() as session:
                for labelled in (True, False):
                    async with session.post(url, json=review(user_pod(labelled)), ssl=context) as r:
                        answers[labelled] = (await r.json())["response"]
        except aiohttp.ClientError:
            return False
        return True

    await eventually(answered, "the webhook to answer")
    injected = answers[True]
    assert injected["allowed"] is True
    assert injected["patchType"] == "JSONPatch"
    patched = jsonpatch.apply_patch(user_pod(True), json.loads(base64.b64decode(injected["patch"])))
    assert patched["spec"]["initContainers"][0]["name"] == RUNTIME_INIT_CONTAINER
    assert patched["spec"]["initContainers"][0]["image"] == "registry.example/kvshare:test"
    variables = {e["name"]: e.get("value") for e in patched["spec"]["containers"][0]["env"]}
    assert variables[env.ENABLE.name] == "1"
    assert variables["PYTHONPATH"] == names.RUNTIME_MOUNT_DIR
    assert answers[False]["allowed"] is True
    assert "patch" not in answers[False]


def run_cli(*args: str, home: Path, **extra_env: str) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": os.environ.get("PATH", "/usr/bin"), "HOME": str(home), **extra_env}
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "operator", *args],
        capture_output=True, text=True, env=environment, timeout=60, check=False,
    )  # fmt: skip


def test_without_a_cluster_the_operator_exits_saying_how_to_configure_one(tmp_path: Path) -> None:
    done = run_cli("--image", "registry.example/kvshare:1", home=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("kvshare operator: no Kubernetes API server to connect to")
    assert "--kubeconfig" in done.stderr and "KUBECONFIG" in done.stderr
    done = run_cli("--image", "x", "--kubeconfig", str(tmp_path / "missing"), home=tmp_path)
    assert done.returncode == 2
    assert f"kubeconfig {tmp_path / 'missing'} could not be loaded" in done.stderr


def test_without_an_image_the_operator_exits_saying_which_setting(tmp_path: Path) -> None:
    done = run_cli(home=tmp_path)
    assert done.returncode == 2
    assert "pass --image or set KVSHARE_IMAGE" in done.stderr
    assert (
        run_cli(home=tmp_path, KVSHARE_IMAGE="registry.example/kvshare:1").stderr.count(
            "no Kubernetes API server"
        )
        == 1
    )
