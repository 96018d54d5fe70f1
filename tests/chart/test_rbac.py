"""The chart grants each program exactly the API calls it makes, and nothing more.

The programs list their calls as data (``kvshare.operator.rbac``,
``kvshare.deviceplugin.cluster.publisher``) and their own tests check every request the running
program sends against that list (against kmock over HTTP). Here: the chart's rule files are
what ``make rbac`` generates from those lists, and the ClusterRoles helm renders hold exactly
those rules.
"""

from __future__ import annotations

import sys

import pytest
import yaml

from tests.chart.helm import CHART, ROOT, template

sys.path.insert(0, str(ROOT / "tools"))
import chart_rbac

CASES = [pytest.param(file, id=file) for file in chart_rbac.SOURCES]


@pytest.mark.parametrize("file", CASES)
def test_chart_rule_file_is_generated_from_the_programs_api_calls(file: str) -> None:
    shipped = (CHART / "rbac" / file).read_text(encoding="utf-8")
    assert shipped == chart_rbac.render(file), f"charts/kvshare/rbac/{file} is stale: make rbac"


@pytest.mark.parametrize("file", CASES)
def test_rendered_clusterrole_holds_exactly_the_programs_rules(file: str) -> None:
    rules = chart_rbac.rules(file)
    suffix = "-" + file.removesuffix(".yaml")
    role = template().one("ClusterRole", suffix)
    assert role["rules"] == rules


def test_rule_files_parse_as_clusterrole_rules() -> None:
    for file in chart_rbac.SOURCES:
        rules = yaml.safe_load((CHART / "rbac" / file).read_text(encoding="utf-8"))
        assert rules and all(set(r) == {"apiGroups", "resources", "verbs"} for r in rules)
