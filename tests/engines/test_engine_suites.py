"""Each supported engine line passes its suite against the real engine package.

The suites start with the session, side by side in subprocesses (see
:mod:`tests.engines.line_suites`); a failure shows the suite's own pytest report.
"""

from __future__ import annotations

import pytest

from kvshare.api.engines import SUPPORTED, SupportedLine
from tests.engines.line_suites import SUITE_TIMEOUT_S, Suite

#: Lines of a failed suite's output shown in the failure.
REPORT_LINES = 120


@pytest.mark.engines
@pytest.mark.timeout(SUITE_TIMEOUT_S + 60)  # each waits for its suite, up to the suite's own
@pytest.mark.parametrize("line", SUPPORTED, ids=lambda line: line.environment)
def test_engine_line_passes_its_suite_on_the_real_engine(
    line: SupportedLine, suites: dict[str, Suite]
) -> None:
    suite = suites[line.environment]
    if suite.process is None:
        pytest.skip(f"{line.environment} is not installed: run `make engines`")
    code, output = suite.wait()
    report = "\n".join(output.splitlines()[-REPORT_LINES:])
    assert code == 0, f"{line.environment} suite failed (exit {code}):\n{report}"
    assert " passed" in output, f"{line.environment} suite ran no test:\n{report}"
