"""The demo's trace in the twin, measured as the demo measures its real servers.

``bench/twin_check.py`` runs the ``elastic-vllm`` benchmark's real ``vllm serve``
worlds and the twin's on the same trace. This module is the twin's side:

- :func:`trace_workload`: a demo trace (:mod:`kvshare.demo.trace`) as a twin workload
  on the CPU device of its fake GPU (:mod:`kvshare.twin.cpu`), one tiny model per
  trace model;
- :func:`check_options`: the twin's settings that match the demo's real servers
  (clients' patience, kvCache.min of a real server, the pools' per-layer pages) and
  record every request's fate;
- :func:`client_view`: a twin run counted with the demo's meanings
  (:mod:`kvshare.demo.real_server`): *served* when its last token came within the
  trace's duration; *abandoned* without a first token within the patience; *queueing
  delay* the time to the first token, the patience for an abandoned request, and the
  time waited so far for one still waiting when the trace ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvshare.demo import trace as trace_mod
from kvshare.demo.options import VLLM_MIN_SHARE
from kvshare.demo.stats import percentile
from kvshare.twin.cpu import DEFAULT_CALIBRATION, TINY_ARCHITECTURE, cpu_device_name
from kvshare.twin.workload import ModelSpec, TwinRequest, Workload
from kvshare.twin.worlds import TwinOptions, WorldResult

__all__ = ["ClientView", "check_options", "client_view", "trace_workload"]


def trace_workload(
    trace: trace_mod.Trace, *, cores: int = 2, calibration: str = DEFAULT_CALIBRATION
) -> Workload:
    """``trace`` on the CPU device of its fake GPU with ``cores`` cores, its step cost
    from ``calibration`` (:data:`~kvshare.twin.cpu.CALIBRATIONS`)."""
    config = trace.config
    models = tuple(
        ModelSpec(f"model-{m}", TINY_ARCHITECTURE, block_tokens=config.block_tokens)
        for m in range(config.models)
    )
    requests = tuple(
        TwinRequest(
            r.arrival_s, f"model-{r.model}", r.prompt_tokens, r.output_tokens, r.prefix_tokens
        )
        for r in trace.requests
    )
    return Workload(
        name=f"demo-trace-seed{config.seed}",
        gpu=cpu_device_name(config.gpu_memory_bytes, cores, calibration),
        models=models,
        requests=requests,
        duration_s=config.duration_s,
        seed=config.seed,
        source=f"kvshare.demo.trace seed {config.seed}, {config.duration_s:g} s",
    )


def check_options(trace: trace_mod.Trace, sharing: str = "time-slicing") -> TwinOptions:
    """The twin's settings for the demo's real servers: the trace's patience, every
    elastic pool's kvCache.min at :data:`~kvshare.demo.options.VLLM_MIN_SHARE` of a share,
    today's per-layer pages, and every request followed to its end."""
    return TwinOptions(
        sharing=sharing,
        page_layout="per-layer",
        patience_s=trace.config.patience_s,
        kv_min_share=VLLM_MIN_SHARE,
        judge_early=False,
    )


@dataclass(frozen=True)
class ClientView:
    """A world as the demo's clients saw it (see the module doc)."""

    served: int
    abandoned: int
    ttft_p50_s: float
    ttft_p99_s: float


def client_view(result: WorldResult, duration_s: float, patience_s: float) -> ClientView:
    """``result`` counted as the demo counts its servers, over a trace of ``duration_s``
    whose clients wait ``patience_s`` for a first token. The run must have judged every
    request (:func:`check_options`)."""
    if result.verdict.requests != len(result.records):
        raise ValueError(
            f"{result.world}: {len(result.records)} of {result.verdict.requests} requests "
            "judged; a check needs every request's fate (judge_early=False)"
        )
    served = abandoned = 0
    waits = []
    for record in result.records:
        waited = patience_s if record.ttft_s is None else record.ttft_s
        waits.append(min(waited, max(0.0, duration_s - record.arrival_s)))
        abandoned += record.ttft_s is None
        served += record.last_token_s is not None and record.last_token_s <= duration_s + 1e-9
    return ClientView(
        served=served,
        abandoned=abandoned,
        ttft_p50_s=percentile(waits, 50) if waits else math.nan,
        ttft_p99_s=percentile(waits, 99) if waits else math.nan,
    )
