"""The supervisor of a real server's process tree: nothing of the tree outlives it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvshare.demo.serving import supervisor
from tests.polling import wait_until

#: A command that leaves an orphan behind: a child in a session of its own, then exits.
LEAVES_AN_ORPHAN = (
    "import subprocess, sys, time; "
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
    "start_new_session=True); print(p.pid, flush=True); time.sleep({wait})"
)


def start(wait: float, pidfile: Path) -> subprocess.Popen[bytes]:
    with pidfile.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, supervisor.__file__, "--grace", "2", "--",
             sys.executable, "-c", LEAVES_AN_ORPHAN.format(wait=wait)],
            stdout=out,
        )  # fmt: skip


def orphan_of(pidfile: Path) -> int:
    def written() -> str:
        return pidfile.read_text().strip() if pidfile.exists() else ""

    return int(wait_until(written, 30, "the orphan's pid"))


def test_what_a_command_leaves_behind_ends_with_it(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    process = start(0.5, pidfile)
    orphan = orphan_of(pidfile)
    assert process.wait(timeout=30) == 0  # the command's own status
    assert not supervisor.alive(orphan), "the orphan outlived the supervisor"


def test_sigterm_stops_the_command_and_ends_the_tree(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    process = start(300, pidfile)
    orphan = orphan_of(pidfile)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert not supervisor.alive(orphan)


def test_the_tree_ends_when_the_process_that_started_it_dies(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time; "
         f"subprocess.Popen([sys.executable, {supervisor.__file__!r}, '--grace', '2', '--', "
         f"sys.executable, '-c', {LEAVES_AN_ORPHAN.format(wait=300)!r}], "
         f"stdout=open({str(pidfile)!r}, 'wb')); time.sleep(300)"],
    )  # fmt: skip
    orphan = orphan_of(pidfile)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.monotonic() + 30
    while supervisor.alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not supervisor.alive(orphan), "the tree outlived the process that started it"


def test_a_lowered_tree_in_a_session_of_its_own_is_niced_against_other_sessions_too() -> None:
    # Where the kernel groups processes by session, a server started in a session of its
    # own under `nice -n 10` still took a whole session's share of the cores from the node
    # agent and the tests beside it: its session's group must be niced as well.
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    tree = subprocess.Popen(
        [sys.executable, supervisor.__file__, "--", *sleeper], start_new_session=True
    )
    try:
        child = wait_until(lambda: supervisor.descendants(tree.pid), 30, "the command")[0]
        supervisor.lower_priority(tree.pid, 7)
        assert os.getpriority(os.PRIO_PROCESS, tree.pid) == 7
        assert os.getpriority(os.PRIO_PROCESS, child) == 7
        group = Path(f"/proc/{tree.pid}/autogroup")
        if group.exists():
            assert group.read_text().split()[-1] == "7"
    finally:
        # Niced in a scheduling group of its own, the tree may not get the CPU to stop
        # within the wait on a loaded machine; stopping is not what this test checks.
        os.killpg(tree.pid, signal.SIGKILL)
        tree.wait(30)


def test_lowering_a_tree_in_the_callers_session_leaves_the_sessions_group_alone() -> None:
    # Servers run in their caller's session (a session of their own kept them from sharing
    # the cores fairly): niceing such a tree must not renice the caller's whole session.
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    own_group = Path("/proc/self/autogroup")
    before = own_group.read_text() if own_group.exists() else None
    tree = subprocess.Popen([sys.executable, supervisor.__file__, "--", *sleeper], process_group=0)
    try:
        child = wait_until(lambda: supervisor.descendants(tree.pid), 30, "the command")[0]
        supervisor.lower_priority(tree.pid, 7)
        assert os.getpriority(os.PRIO_PROCESS, child) == 7
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0
        if before is not None:
            assert own_group.read_text() == before
    finally:
        tree.terminate()
        tree.wait(30)


def test_cpu_is_summed_by_depth_below_a_process(tmp_path: Path) -> None:
    # A process with a child that sleeps, below it a grandchild that burns a third of a
    # second of CPU and then sleeps: what the serving benchmarks read to tell vLLM's API,
    # engine-core and worker processes apart.
    done = tmp_path / "burnt"
    burn = (
        "import time, pathlib; end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        f"pathlib.Path({str(done)!r}).touch(); time.sleep(60)"
    )
    child = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {burn!r}]); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    )
    process = subprocess.Popen([sys.executable, "-c", parent])
    try:
        wait_until(done.exists, what="the grandchild's burn")
        depths = supervisor.cpu_by_depth(process.pid)
        assert depths[2] >= 0.3
        assert depths[1] < depths[2]
        assert set(depths) == {1, 2}
    finally:
        for pid in supervisor.descendants(process.pid):
            os.kill(pid, signal.SIGKILL)
        process.kill()
        process.wait()
