"""``kvshare demo``: static partitions against elastic KV caches, on this machine.

Starts the node agent with a fake GPU (host memory) and, for each model, one simulated
model server per world (static partitions and elastic), runs the same bursty trace in
both at once, shows them live, and ends with a per-model summary and a plot. With
``--engine vllm`` the model servers are real ``vllm serve`` processes (``make engines``),
one world after the other.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvshare.api import names
from kvshare.api.quantity import QuantityError, format_bytes, parse_bytes
from kvshare.demo.capacity import DEFAULT_DURATION_S, DEFAULT_FAMILY
from kvshare.demo.options import DEFAULT_SPEED, ENGINES
from kvshare.demo.trace import TraceConfig
from kvshare.twin.families import FAMILIES

if TYPE_CHECKING:
    from kvshare.demo.options import DemoOptions

#: The trace's defaults, under the names of the options that override them.
_DEFAULTS = {
    "duration": TraceConfig.duration_s,
    "models": TraceConfig.models,
    "gpu_memory": TraceConfig.gpu_memory_bytes,
    "patience": TraceConfig.patience_s,
    "cycles": TraceConfig.cycles,
}
#: ``--engine vllm``: three real servers on a GPU of 48 MiB of KV cache (the tiny model's
#: blocks are small), 30 s bursts in real time.
_VLLM_DEFAULTS = {**_DEFAULTS, "duration": 90.0, "models": 3, "gpu_memory": 48 * 2**20}


def _gpu_memory(raw: str) -> int:
    try:
        return parse_bytes(raw, field="--gpu-memory")
    except QuantityError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="sim",
        help="sim: simulated model servers (fast, the default); vllm: real vLLM servers "
        "(vLLM's CPU build and a tiny model, set up by `make engines`; about 5 minutes)",
    )
    parser.add_argument(
        "--duration",
        type=float,
        help=f"seconds of trace to run in both worlds (default {_DEFAULTS['duration']:g})",
    )
    parser.add_argument(
        "--models",
        type=int,
        help=f"number of models sharing the GPU, at least 3 (default {_DEFAULTS['models']})",
    )
    parser.add_argument(
        "--gpu-memory",
        type=_gpu_memory,
        metavar="QUANTITY",
        help="KV memory of the fake GPU, e.g. 8Gi "
        f"(default {format_bytes(int(_DEFAULTS['gpu_memory']))})",
    )
    parser.add_argument(
        "--patience",
        type=float,
        metavar="SECONDS",
        help="how long a client waits for its first token before it gives up "
        f"(default {_DEFAULTS['patience']:g})",
    )
    parser.add_argument(
        "--cycles",
        type=int,
        help=f"how many times each model's busy window comes round (default {_DEFAULTS['cycles']})",
    )
    parser.add_argument(
        "--speed",
        type=float,
        help="trace seconds per wall-clock second: kvshare's own delays count this many "
        f"times over (default {DEFAULT_SPEED:g}; 1 runs the trace in real time, as real "
        "engines always do)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated trace")
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="run this trace file (written as trace.json by an earlier run) instead of "
        "generating one; it fixes duration, models and GPU memory",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("out/demo"),
        metavar="DIR",
        help="where the plot, results.json, trace.json and logs go (default out/demo)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=names.METRICS_PORT,
        help=f"port of the node agent's metrics (default {names.METRICS_PORT}; "
        "a free one when taken)",
    )
    parser.add_argument(
        "--broker-policy",
        action="append",
        metavar="NAME",
        help="the node agent's broker policy (default its own); given more than once, one "
        "elastic run per policy, side by side on the same trace",
    )
    parser.add_argument(
        "--kv-min-share",
        type=float,
        metavar="FRACTION",
        help="every elastic model's kvCache.min, as a fraction of an equal share (default 0; "
        "0.25 with --engine vllm)",
    )
    parser.add_argument(
        "--capacity",
        default=DEFAULT_FAMILY,
        metavar="FAMILY",
        help="the GPU twin's workload family whose capacity at the latency SLO is reported "
        f"per world (default {DEFAULT_FAMILY}; one of {', '.join(FAMILIES)}; none: skip)",
    )
    parser.add_argument(
        "--capacity-duration",
        type=float,
        default=DEFAULT_DURATION_S,
        metavar="SECONDS",
        help=f"simulated seconds of that workload (default {DEFAULT_DURATION_S:g})",
    )
    parser.add_argument(
        "--plain", action="store_true", help="print progress lines instead of the live view"
    )


def _options(args: argparse.Namespace) -> DemoOptions:
    from kvshare.demo.options import DemoOptions
    from kvshare.deviceplugin.broker.policy import policy_named

    given = {k: getattr(args, k) for k in _DEFAULTS if getattr(args, k) is not None}
    if args.trace is not None and given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"{flags} cannot be combined with --trace: the trace file fixes them")
    values = {**(_VLLM_DEFAULTS if args.engine == "vllm" else _DEFAULTS), **given}
    speed = args.speed if args.speed is not None else DEFAULT_SPEED
    if args.engine == "vllm":
        if args.speed not in (None, 1.0):
            raise ValueError("--engine vllm runs the trace in real time: leave out --speed")
        speed = 1.0
    if int(values["models"]) < 3:
        raise ValueError(f"--models must be at least 3, got {values['models']}")
    if not float(values["duration"]) > 0:
        raise ValueError(f"--duration must be > 0, got {values['duration']}")
    if not float(values["patience"]) > 0:
        raise ValueError(f"--patience must be > 0, got {values['patience']}")
    if not speed > 0:
        raise ValueError(f"--speed must be > 0, got {speed}")
    if int(values["cycles"]) < 1:
        raise ValueError(f"--cycles must be at least 1, got {values['cycles']}")
    if args.kv_min_share is not None and not 0 <= args.kv_min_share <= 1:
        raise ValueError(f"--kv-min-share must be within 0-1, got {args.kv_min_share}")
    policies = tuple(args.broker_policy or (None,))
    for name in policies:
        if name is not None:
            policy_named(name)  # ValueError names the known ones
    if len(set(policies)) < len(policies):
        raise ValueError("--broker-policy names each policy once")
    family = None if args.capacity == "none" else args.capacity
    if family is not None and family not in FAMILIES:
        raise ValueError(f"--capacity must be none or one of {', '.join(FAMILIES)}, not {family!r}")
    if not 0 < args.capacity_duration <= 3600:
        raise ValueError(f"--capacity-duration must be in (0, 3600], got {args.capacity_duration}")
    return DemoOptions(
        duration_s=float(values["duration"]),
        models=int(values["models"]),
        gpu_memory_bytes=int(values["gpu_memory"]),
        patience_s=float(values["patience"]),
        cycles=int(values["cycles"]),
        seed=args.seed,
        speed=speed,
        engine=args.engine,
        trace_file=args.trace,
        output=args.output,
        metrics_port=args.metrics_port,
        live=not args.plain,
        policies=policies,
        kv_min_share=args.kv_min_share,
        capacity_family=family,
        capacity_duration_s=args.capacity_duration,
    )


def run(args: argparse.Namespace) -> int:
    from kvshare.demo.orchestrator import DemoError, run_demo
    from kvshare.demo.trace import TraceError

    try:
        outcome = run_demo(_options(args), sys.stdout)
    except (ValueError, TraceError, DemoError) as exc:
        print(f"kvshare demo: {exc}", file=sys.stderr)
        return 1
    return 0 if outcome.ok else 1
