"""The broker's checks fail closed: what cannot be told is a refusal, and running out of
file descriptors pauses accepting instead of spinning."""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from kvshare.deviceplugin.broker import peers
from kvshare.deviceplugin.broker.connections import auth
from kvshare.deviceplugin.broker.connections.gate import BrokerLimits, ConnectionGate
from kvshare.deviceplugin.broker.connections.listeners import Listeners
from kvshare.deviceplugin.broker.identity import Refusal
from kvshare.deviceplugin.broker.verification import Verifier


def test_an_admin_peer_whose_mount_namespace_cannot_be_told_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    me = peers.Peer(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
    assert auth.admin_problem(me) is None
    monkeypatch.setattr(peers, "same_mount_namespace", lambda pid: None)
    problem = auth.admin_problem(me)
    assert problem is not None and "cannot tell where process" in problem
    assert auth.admin_problem(peers.Peer(pid=0, uid=0, gid=0)) is not None


def test_a_cgroup_without_a_pod_or_with_two_tells_no_pod() -> None:
    uid = "0f8fad5b-d9cb-469f-a165-70867728950e"
    other = "1f8fad5b-d9cb-469f-a165-70867728950e"
    assert peers.pod_uid_in_cgroup(f"0::/kubepods/besteffort/pod{uid}/c1").uid == uid
    systemd = f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-x.scope"
    assert peers.pod_uid_in_cgroup(systemd).uid == uid
    assert peers.pod_uid_in_cgroup("0::/user.slice/session-1.scope").uid is None
    assert peers.pod_uid_in_cgroup(f"0::/pod{uid}").uid is None  # not under kubepods
    both = f"1:pids:/kubepods/pod{uid}\n2:cpu:/kubepods/pod{other}"
    assert "2 different pods" in peers.pod_uid_in_cgroup(both).problem


def test_under_kubernetes_a_process_in_no_pod_is_refused_and_without_it_is_its_own_tenant() -> None:
    me = peers.Peer(pid=os.getpid(), uid=0, gid=0)
    refusal = Verifier(verify=True).tenant(me, None)
    assert isinstance(refusal, Refusal) and refusal.reason == "no-pod"
    assert Verifier(verify=False).tenant(me, None).key == f"process {os.getpid()}"  # type: ignore[union-attr]


class _ExhaustedListener:
    """A listening socket whose accept fails as a process out of descriptors sees it."""

    def __init__(self) -> None:
        self.calls = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def fileno(self) -> int:
        return self._sock.fileno()

    def accept(self) -> Any:
        self.calls += 1
        raise OSError(errno.EMFILE, "Too many open files")

    def close(self) -> None:
        self._sock.close()


def test_out_of_descriptors_the_listeners_pause_and_say_so_once_per_interval(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    selector = selectors.DefaultSelector()
    gate = ConnectionGate(BrokerLimits(accept_backoff_s=60.0))
    listeners = Listeners(selector, gate, Verifier(verify=False), lambda pid, r: None)
    listeners.listen(tmp_path / "b.sock", 0o600, "pool")
    exhausted = _ExhaustedListener()
    with caplog.at_level(logging.ERROR):
        for _ in range(1000):  # what a level-triggered loop would do without the pause
            listeners.accept(exhausted, "pool")  # type: ignore[arg-type]
    # The listening socket left the selector: the loop is not woken for it again.
    assert not selector.get_map()
    assert gate.paused(time.monotonic())
    lines = [r for r in caplog.records if "out of file descriptors" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    listeners.resume(float("inf"))  # after the back-off it listens again
    assert len(selector.get_map()) == 1
    listeners.close()
    exhausted.close()
