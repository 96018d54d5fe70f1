"""Run kvshare's benchmarks: ``python bench/run.py NAME [--quick] [--json]``.

``--all`` runs every benchmark; ``--write FILE`` rewrites the report (``make bench``
writes BENCHMARKS.md). With ``--json`` the last line printed is one JSON object per run.
Exit status 1 when a measured value misses its target.
"""

from __future__ import annotations

import os
import sys

# `python bench/run.py` puts bench/ first on sys.path, where bench/operator.py would shadow
# Python's own `operator` module. Benchmarks are loaded by path; bench/ goes last.
if sys.path and os.path.realpath(sys.path[0]) == os.path.dirname(os.path.realpath(__file__)):
    sys.path.pop(0)

import argparse
import importlib.util
import json
import traceback
from pathlib import Path
from types import ModuleType

sys.path.append(str(Path(__file__).resolve().parent))

from harness import Result, machine, today
from report import write_report

BENCH_DIR = Path(__file__).resolve().parent
#: Every benchmark, in report order. Each is ``bench/<name>.py`` with ``run(quick)``.
BENCHMARKS = (
    "placement",
    "vmm",
    "blocks",
    "sglang_alloc",
    "broker",
    "deviceplugin",
    "operator",
    "elastic",
    "elastic-suite",
    "elastic-sim",
    "page-granularity",
    "capacity",
    "fuzz",
    "vllm-overhead",
    "elastic-vllm",
    "twin-check",
    "cpu-sharing",
    "agent-faults",
)


def _path(name: str) -> Path:
    """``bench/<name>.py``, dashes written as underscores."""
    return BENCH_DIR / f"{name.replace('-', '_')}.py"


def available() -> list[str]:
    return [name for name in BENCHMARKS if _path(name).exists()]


def load(name: str) -> ModuleType:
    path = _path(name)
    if name not in BENCHMARKS or not path.exists():
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(available())}")
    spec = importlib.util.spec_from_file_location(f"kvshare_bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def run_one(module: ModuleType, name: str, *, quick: bool) -> Result:
    """Run one benchmark; an exception becomes a crashed result, so the others still run
    and the report says what failed."""
    try:
        result: Result = module.run(quick=quick)
    except Exception as exc:
        traceback.print_exc()
        result = Result(name, {"error": f"{type(exc).__name__}: {exc}"}, crashed=True)
    print_table(result)
    return result


def print_table(result: Result) -> None:
    print(f"\n{result.name}")
    width = max(len(k) for k in result.fields)
    for key, value in result.fields.items():
        target = result.verdict(key)
        verdict = ""
        if target is not None:
            verdict = f"  (target {target[0]}: {'met' if target[1] else 'MISSED'})"
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown}{verdict}")
    if result.notes:
        print(f"  note: {result.notes}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help=f"benchmarks to run: {', '.join(BENCHMARKS)}")
    parser.add_argument("--all", action="store_true", help="run every benchmark")
    parser.add_argument("--quick", action="store_true", help="smaller sizes, same fields")
    parser.add_argument("--json", action="store_true", help="print a JSON object last")
    parser.add_argument(
        "--write",
        metavar="FILE",
        help="rewrite this report with the results (without --all, only the tables of the "
        "benchmarks named)",
    )
    args = parser.parse_args(argv)
    names = available() if args.all else args.names
    if not names:
        parser.error("name a benchmark or pass --all")
    missing = [name for name in BENCHMARKS if name not in available()] if args.all else []
    if missing:
        print(f"not present in this checkout, skipped: {', '.join(missing)}")
    results = [run_one(load(name), name, quick=args.quick) for name in names]
    crashed = [r.name for r in results if r.crashed]
    print(f"\nran: {', '.join(r.name for r in results)}")
    if crashed:
        print(f"failed with an error: {', '.join(crashed)}")
    if args.write:
        named = "--all" if args.all else " ".join(names)
        command = f"python bench/run.py {named}" + (" --quick" if args.quick else "")
        write_report(
            Path(args.write),
            results,
            machine=machine(),
            date=today(),
            command=command,
            missing=missing,
            keep_others=not args.all,
            order=BENCHMARKS,
        )
        print(f"\nwrote {args.write}")
    if args.json:
        payloads = [
            {"name": r.name, **r.fields, "targets_met": not r.failed_targets()} for r in results
        ]
        print(json.dumps(payloads[0] if len(payloads) == 1 else payloads))
    return 1 if crashed or any(r.failed_targets() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
