"""The README's install section is commands that work with this chart: its `helm install`
renders, the objects its `kubectl` lines name are the ones the chart creates, and the
example it applies exists."""

from __future__ import annotations

import re
import shlex

from tests.chart.helm import CHART, NAMESPACE, RELEASE, ROOT, helm, template

README = (ROOT / "README.md").read_text(encoding="utf-8")
SECTION = README.split("## Install on a cluster", 1)[1].split("\n## ", 1)[0]


def commands() -> list[list[str]]:
    found = []
    for block in re.findall(r"```sh\n(.*?)```", SECTION, flags=re.S):
        for raw in block.replace("\\\n", " ").splitlines():
            line = raw.split("  #", 1)[0].strip()
            if line:
                found.append(shlex.split(line))
    return found


def test_readme_helm_install_renders_with_its_flags() -> None:
    (install,) = [c for c in commands() if c[:2] == ["helm", "install"]]
    release, chart = install[2], install[3]
    assert (release, (ROOT / chart).resolve()) == (RELEASE, CHART)
    assert install[install.index("--namespace") + 1] == NAMESPACE
    flags = [a for a in install[4:] if a not in {"--create-namespace"}]
    done = helm("template", release, str(CHART), *flags,
                "--api-versions", "monitoring.coreos.com/v1")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "kind: PrometheusRule" in done.stdout
    assert "release: kube-prometheus-stack" in done.stdout


def test_readme_kubectl_lines_name_objects_the_chart_creates() -> None:
    rendered = template()
    existing = {(o["kind"].lower(), o["metadata"]["name"]) for o in rendered.objects}
    checked = 0
    for command in commands():
        for word in command:
            match = re.fullmatch(r"(deployment|daemonset)/([a-z0-9-]+)", word)
            if match:
                assert (match.group(1), match.group(2)) in existing, word
                checked += 1
    assert checked == 2
    assert f"ConfigMap `{RELEASE}-dashboard`" in SECTION
    assert rendered.one("ConfigMap", "-dashboard")["metadata"]["name"] == f"{RELEASE}-dashboard"


def test_readme_applies_an_example_that_exists() -> None:
    applied = [c[c.index("-f") + 1] for c in commands() if c[:2] == ["kubectl", "apply"]]
    assert applied
    for path in applied:
        assert (ROOT / path).is_file(), path
