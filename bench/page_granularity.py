"""Benchmark ``page-granularity``: what the size of a pool's page costs, with real processes.

The suite's first trace of every family (``kvshare.demo.suite``) runs as ``elastic-suite``
runs it — a real node agent, real model-server processes with real pools on the host
backend, a static world beside an elastic one (policy ``entitlement``) — twice: with the
demo's per-layer pages (8 blocks in each of 64 buffers, as vLLM's layer-outer layouts are
paged: a page comes back only when all its blocks are free) and block-outer (one buffer of
whole blocks of every layer, a page per block, as vLLM's ``BLNHC`` is paged). Per trace
and layout: ``gain`` share ``(elastic - static) / (shared - static)`` and ``worst`` model
against ``min(static, shared)``; for each layout their median and least. Simulated time gives
the same comparison on 30 traces (``python -m kvshare.demo.elastic_sim --page-blocks 1``),
and the twin on a GPU's geometry (``capacity``).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from elastic_suite import CANDIDATE, first_of_each_family, run_trace
from harness import Result

#: Pages compared: label -> block-outer (one block per page) or the demo's per-layer pages.
PAGES = {"per-layer": False, "block-outer": True}


def run(quick: bool) -> Result:
    traces = first_of_each_family()
    fields: dict[str, float | int | str] = {}
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-pages-") as out:
        for made in traces:
            for label, block_outer in PAGES.items():
                run_trace(
                    f"{made.name}.{label}",
                    made.trace,
                    Path(out),
                    0.0,
                    fields,
                    policies=(CANDIDATE,),
                    block_outer=block_outer,
                )
    return summarise([made.name for made in traces], fields)


def summarise(traces: list[str], fields: dict[str, float | int | str]) -> Result:
    """The result of runs whose per-trace figures are in ``fields``: a table per trace,
    and each layout's median and least gain share and least worst-model ratio."""

    def figure(trace: str, label: str, what: str) -> float:
        return float(fields[f"{trace}.{label}.{what}"])

    summary: dict[str, float | int | str] = {}
    for label in PAGES:
        gains = [figure(t, label, f"gain.{CANDIDATE}") for t in traces]
        summary[f"gain_median.{label}"] = round(statistics.median(gains), 3)
        summary[f"gain_min.{label}"] = round(min(gains), 3)
        summary[f"worst_min.{label}"] = round(
            min(figure(t, label, f"worst.{CANDIDATE}") for t in traces), 3
        )
    rows = [
        "| trace | static | shared bound | served, per-layer / block-outer | gain share, "
        "per-layer / block-outer | worst model, per-layer / block-outer |",
        "|---|---|---|---|---|---|",
    ]
    for trace in traces:
        pair = {
            what: " / ".join(f"{figure(trace, label, what):g}" for label in PAGES)
            for what in (f"elastic.{CANDIDATE}", f"gain.{CANDIDATE}", f"worst.{CANDIDATE}")
        }
        rows.append(
            f"| {trace} | {fields[f'{trace}.per-layer.static']} | "
            f"{fields[f'{trace}.per-layer.shared']} | {pair[f'elastic.{CANDIDATE}']} | "
            f"{pair[f'gain.{CANDIDATE}']} | {pair[f'worst.{CANDIDATE}']} |"
        )
    return Result(
        name="page-granularity",
        fields={**summary, **fields},
        targets=[],
        tables="\n".join(rows),
        detail_prefixes=tuple(f"{trace}." for trace in traces),
        notes=(
            f"{len(traces)} traces ({', '.join(traces)}), real processes, one run each, policy "
            f"{CANDIDATE}, kvCache.min 0, each with the demo's per-layer pages (8 blocks in "
            "each of 64 buffers) and block-outer (one block of all layers per page). The "
            "numbers move with the machine's load; python -m kvshare.demo.elastic_sim "
            "--seeds 6 [--page-blocks 1] gives the steadier comparison, on 30 traces in "
            "simulated time."
        ),
    )
