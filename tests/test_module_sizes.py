"""No module of ``src/kvshare`` is past 600 lines: a module that grows past that holds
more than one job (see docs/development.md). Generated stubs are not modules written
here and are left out."""

from __future__ import annotations

from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
MOST_LINES = 600


def test_no_module_is_over_600_lines() -> None:
    long = {
        str(path.relative_to(SRC)): lines
        for path in SRC.rglob("*.py")
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
        and (lines := len(path.read_text(encoding="utf-8").splitlines())) > MOST_LINES
    }
    assert long == {}, f"split these along their jobs: {long}"
