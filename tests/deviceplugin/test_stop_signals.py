"""The node agent's wait for SIGTERM/SIGINT, in a process of its own (signals are
process-wide, and pytest's own handlers must stay as they are)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from .conftest import ROOT

_TRIALS = 20_000

# One SIGTERM per trial, sent from another thread within 50 us of the main thread going
# back into its wait. A signal that lands after the interpreter's last look at its pending
# signals and before the wait's system call runs no handler until the main thread wakes for
# some other reason: a wait that a handler must end then never ends. The sender counts such
# a miss after 0.5 s and sends again, so that the run itself finishes.
_ONE_SIGNAL_AT_A_TIME = textwrap.dedent(
    f"""
    import os, random, signal, threading, time
    from kvshare.deviceplugin.stop_signals import StopSignals

    signals = StopSignals()
    woke = threading.Event()
    missed = 0

    def send():
        global missed
        for _ in range({_TRIALS}):
            time.sleep(random.random() * 50e-6)
            os.kill(os.getpid(), signal.SIGTERM)
            while not woke.wait(0.5):
                missed += 1
                os.kill(os.getpid(), signal.SIGTERM)
            woke.clear()

    sender = threading.Thread(target=send)
    sender.start()
    for _ in range({_TRIALS}):
        assert signals.wait() == signal.SIGTERM
        woke.set()
    sender.join()
    print("missed", missed)
    """
)

_EARLY_SIGNAL = textwrap.dedent(
    """
    import os, signal
    from kvshare.deviceplugin.stop_signals import StopSignals

    signals = StopSignals()
    os.kill(os.getpid(), signal.SIGINT)
    print(signal.Signals(signals.wait()).name)
    """
)


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_signal_landing_just_as_the_main_thread_starts_waiting_still_ends_the_wait() -> None:
    assert _run(_ONE_SIGNAL_AT_A_TIME) == "missed 0"


def test_a_signal_that_arrived_before_the_wait_ends_it_at_once() -> None:
    assert _run(_EARLY_SIGNAL) == "SIGINT"
