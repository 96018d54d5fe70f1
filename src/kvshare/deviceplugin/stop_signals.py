"""Waiting in the main thread for SIGTERM or SIGINT.

Python runs a signal's handler in the main thread, between two bytecodes. A handler that
sets a ``threading.Event`` the main thread waits on has a gap: a signal that lands after
the interpreter's last look at its pending signals and before the wait's own system call
runs no handler, and the wait (a lock, which signals do not interrupt once it sleeps)
never ends. A kubelet's SIGTERM that lands as the agent starts waiting then hangs it until
SIGKILL (seen: about one stop in ten on a loaded two-core machine). Here the handlers do
nothing in Python: the interpreter's C handler writes each signal's number to a wakeup
socket, which :meth:`StopSignals.wait` reads, so no signal falls into that gap.
"""

from __future__ import annotations

import signal
import socket

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _noted(signum: int, frame: object) -> None:
    """The wakeup socket already holds the signal's number; nothing else to do."""
    del signum, frame


class StopSignals:
    """SIGTERM and SIGINT, caught from construction on (call it in the main thread,
    before starting anything that a signal should stop)."""

    def __init__(self) -> None:
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            signal.signal(signum, _noted)

    def wait(self) -> int:
        """Block until a stop signal has arrived (at any time since construction); its
        number. Other signals with a Python handler also reach the socket and are skipped."""
        signum = self.wait_for(None)
        assert signum is not None  # no timeout
        return signum

    def wait_for(self, timeout: float | None) -> int | None:
        """:meth:`wait`, for at most ``timeout`` seconds: None when no stop signal came."""
        self._reader.settimeout(timeout)
        try:
            while True:
                signum = self._reader.recv(1)[0]
                if signum in STOP_SIGNALS:
                    return signum
        except TimeoutError:
            return None
        finally:
            self._reader.settimeout(None)
