"""A stand-in for NVIDIA's ``pynvml`` (nvidia-ml-py) where no GPU is: only the NVML calls
the node agent's inventory makes, answered from a JSON file the test writes and may
rewrite at any time (its path in ``KVSHARE_TEST_FAKE_NVML``)::

    {"gpus": [{"uuid": "GPU-...", "name": "NVIDIA H100", "total": 85899345920}],
     "processes": {"GPU-...": {"1234": 21474836480}}}

Put this folder first on ``PYTHONPATH`` of a ``kvshare node`` process: its real
``NvmlInventory``, audit and lease enforcement then run against these figures.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

nvmlEventTypeXidCriticalError = 8  # noqa: N816 - NVML's names


class NVMLError(Exception):
    """An NVML call failed."""


class NVMLError_Timeout(NVMLError):  # noqa: N801, N818
    """No event arrived in time."""


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int | None  # noqa: N815


def _state() -> dict[str, Any]:
    with open(os.environ["KVSHARE_TEST_FAKE_NVML"], encoding="utf-8") as file:
        return dict(json.load(file))


def nvmlInit() -> None:  # noqa: N802
    _state()


def nvmlShutdown() -> None:  # noqa: N802
    pass


def nvmlDeviceGetCount() -> int:  # noqa: N802
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:  # noqa: N802
    return index


def nvmlDeviceGetUUID(handle: int) -> str:  # noqa: N802
    return str(_state()["gpus"][handle]["uuid"])


def nvmlDeviceGetName(handle: int) -> str:  # noqa: N802
    return str(_state()["gpus"][handle]["name"])


def nvmlDeviceGetMemoryInfo(handle: int) -> _Memory:  # noqa: N802
    total = int(_state()["gpus"][handle]["total"])
    return _Memory(total=total, free=total, used=0)


def nvmlDeviceGetComputeRunningProcesses(handle: int) -> list[_Process]:  # noqa: N802
    state = _state()
    held = state.get("processes", {}).get(state["gpus"][handle]["uuid"], {})
    return [_Process(pid=int(pid), usedGpuMemory=int(used)) for pid, used in held.items()]


def nvmlEventSetCreate() -> object:  # noqa: N802
    return object()


def nvmlDeviceRegisterEvents(handle: int, kinds: int, events: object) -> None:  # noqa: N802
    del handle, kinds, events


def nvmlEventSetWait_v2(events: object, timeout_ms: int) -> object:  # noqa: N802
    raise NVMLError_Timeout("no event")


def nvmlEventSetFree(events: object) -> None:  # noqa: N802
    del events
