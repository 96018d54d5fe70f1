"""The real ``helm`` binary, run on the chart: render, lint, and parse what it prints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvshare"
HELM = ROOT / ".tools" / "bin" / "helm"
RELEASE = "kvshare"
NAMESPACE = "kvshare"
#: API groups a cluster with the Prometheus Operator serves (for --api-versions).
PROMETHEUS_OPERATOR = ("monitoring.coreos.com/v1",)
CERT_MANAGER = ("cert-manager.io/v1",)


def helm_binary() -> Path:
    """The helm binary, unpacked by ``make tools`` (or here, the same way, when missing)."""
    if not HELM.exists():
        subprocess.run(
            [sys.executable, str(ROOT / "tools" / "fetch_helm.py"), "--dest", str(HELM),
             "--cache", str(ROOT / ".tools" / "cache")],
            check=True,
        )  # fmt: skip
    return HELM


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    """Run helm with ``args``; the caller checks the result."""
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, check=False, cwd=ROOT
    )


@dataclass(frozen=True)
class Rendered:
    """The objects ``helm template`` printed, and the NOTES it would show."""

    objects: list[dict[str, Any]]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name_suffix: str = "") -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if o["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"expected one {kind} *{name_suffix}, found {len(found)}"
        return found[0]

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self.objects}


def set_args(values: dict[str, Any]) -> list[str]:
    """``--set-json`` arguments for a dict of dotted keys."""
    args = []
    for key, value in values.items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    return args


def template(
    values: dict[str, Any] | None = None,
    api_versions: tuple[str, ...] = (),
    kube_version: str = "1.32.0",
    show_only: str | None = None,
) -> Rendered:
    """``helm template`` of the chart (CRDs included); fails the test on any error."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--include-crds",
            "--kube-version", kube_version, *set_args(values or {})]  # fmt: skip
    for api in api_versions:
        args += ["--api-versions", api]
    if show_only:
        args += ["--show-only", show_only]
    done = helm(*args)
    assert done.returncode == 0, done.stderr
    return Rendered([o for o in yaml.safe_load_all(done.stdout) if o])


def notes(
    values: dict[str, Any] | None = None, api_versions: tuple[str, ...] = (), *, workdir: Path
) -> str:
    """NOTES.txt as ``helm install`` prints it, rendered by the real helm offline.

    ``helm template`` never renders NOTES.txt and ``helm install --dry-run`` needs a cluster,
    so a copy of the chart in ``workdir`` wraps the unchanged NOTES.txt in a named template
    and renders it into a ConfigMap.
    """
    chart = workdir / "kvshare"
    shutil.copytree(CHART, chart)
    source = (chart / "templates" / "NOTES.txt").read_text(encoding="utf-8")
    (chart / "templates" / "NOTES.txt").unlink()
    (chart / "templates" / "_notes.tpl").write_text(
        '{{- define "test.notes" -}}\n' + source + "{{- end }}\n", encoding="utf-8"
    )
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ include "test.notes" . | quote }}\n',
        encoding="utf-8",
    )
    args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE,
            "--show-only", "templates/notes.yaml", *set_args(values or {})]  # fmt: skip
    for api in api_versions:
        args += ["--api-versions", api]
    done = helm(*args)
    assert done.returncode == 0, done.stderr
    return str(yaml.safe_load(done.stdout)["data"]["notes"])
