"""A tensor-parallel group's start-up turns are its pod's: a rank from another pod can
neither join the group (naming its pod UID is refused, naming its own makes a group of its
own) nor break it by leaving; and a turn asks for no more than the pod requested."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.deviceplugin.trust.harness import GIB, GpuNode, Pod
from tests.polling import wait_until

pytestmark = pytest.mark.usefixtures("cgroups")


def turn(pod: Pod, rank: int, gpu: str, **fields: Any) -> dict[str, Any]:
    body = {"type": "turn-request", "seq": 1, "gpu": gpu, "static": 0, "kv_min": 0,
            "pod_uid": pod.uid, "rank": rank, "group": "engine-0", "group_size": 2}  # fmt: skip
    return {**body, **fields}


def ask(
    pod: Pod, body: dict[str, Any], wait: float, replies: int = 0
) -> tuple[subprocess.Popen[str], Any]:
    """Ask for a turn on a connection held open; what came within ``wait`` seconds (or
    the first ``replies``)."""
    socket = str(pod.node.agent.broker_socket)
    return pod.hold("frames", socket, json.dumps([body]), "--wait", str(wait),
                    "--replies", str(replies), "--hold")  # fmt: skip


def holders(node: GpuNode) -> list[str]:
    return [g.turn_holder for g in node.agent.view().gpus]


def test_a_rank_of_another_pod_can_neither_join_nor_break_a_group(node: GpuNode) -> None:
    engine = node.pod("tp-engine", gpus=2, memory_gib=8)
    intruder = node.pod("intruder")
    held = []
    try:
        rank0, answer = ask(engine, turn(engine, 0, engine.gpus[0]), 1.0)
        held.append(rank0)
        assert answer["replies"] == []  # it waits for its peer
        # Naming the engine's pod: refused, and counted.
        before = node.refusals("pod-uid")
        spoof = intruder.frames(turn(engine, 1, intruder.gpus[0]))
        assert spoof["replies"][0]["type"] == "refused", spoof
        assert f"names pod {engine.uid}" in spoof["replies"][0]["reason"]
        assert node.refusals("pod-uid") == before + 1
        # Naming its own pod: a group of its own, which waits for its own peer...
        process, answer = ask(intruder, turn(intruder, 1, intruder.gpus[0]), 1.0)
        assert answer["replies"] == []
        # ... and leaving breaks nothing of the engine's group.
        intruder.release(process)
        wait_until(lambda: node.agent.view().gpus[0].turn_waiting + node.agent.view().gpus[1]
                   .turn_waiting == 1, what="the intruder to leave")  # fmt: skip
        rank1, answer = ask(engine, turn(engine, 1, engine.gpus[1]), 20.0, replies=1)
        held.append(rank1)
        assert [r["type"] for r in answer["replies"]] == ["turn-granted"], answer
        assert all(h.startswith("pid ") for h in holders(node))  # both ranks hold theirs
    finally:
        for process in held:
            engine.release(process)


def test_a_turn_bigger_than_the_pods_request_is_refused(node: GpuNode) -> None:
    pod = node.pod("big-start", memory_gib=2)
    before = node.refusals("memory")
    answer = pod.frames(turn(pod, 0, pod.gpus[0], static=2 * GIB, kv_min=GIB, group="",
                             group_size=1))  # fmt: skip
    assert answer["replies"][0]["type"] == "refused", answer
    assert answer["replies"][0]["reason"].startswith("allocation: static + kv min 3.0Gi")
    assert node.refusals("memory") == before + 1
