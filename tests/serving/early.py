"""The serving tests' servers, started when the session begins rather than when the first
serving test asks for them.

Starting the plain-vLLM reference, the node agent and the co-located servers A and B, and
serving the reference's tokens, takes a minute or two of CPU; the tests collected before
the serving ones mostly wait on sockets and processes. So the session starts them at
once, in a thread (a server starts at the session's priority and drops to
``conftest.SERVER_NICENESS`` once it answers), and the fixtures take them from here.
Nothing about the servers changes: they start the same way, together, as the start-up
test checks.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path

from kvshare.demo.serving.vllm_server import VllmServer
from tests.serving.conftest import REFERENCE_KV_BYTES, options
from tests.serving.world import Colocated, finish_colocated, launch_colocated


class ServingWorld:
    """The reference server and the co-located world, started now; a thread waits for
    them to answer and serves the reference's tokens."""

    def __init__(self) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="kvs-serving-"))
        """Logs of every server, and the vLLM cache they share."""
        self._sockets = Path(tempfile.mkdtemp(prefix="kvs", dir="/tmp"))  # short socket paths
        self.native = VllmServer(
            "native",
            options(self.run_dir, kvshare=False, cpu=1, kv_cache_bytes=REFERENCE_KV_BYTES),
            self.run_dir / "native.log",
        )
        self.native.start()
        self._launched = launch_colocated(self.run_dir, self._sockets)
        self._colocated: Colocated | None = None
        self._failed: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._start_colocated, daemon=True)
        self._thread.start()

    def _start_colocated(self) -> None:
        try:
            colocated = finish_colocated(self._launched, self.native.wait_ready())
        except BaseException as error:  # handed to the test that asks for the world
            self._failed = error
            return
        with self._lock:
            if self._closed:
                colocated.close()
            else:
                self._colocated = colocated

    def colocated(self) -> Colocated:
        """The co-located world once it answers; what stopped it from starting, raised."""
        self._thread.join()
        if self._failed is not None:
            raise RuntimeError("the co-located servers did not start") from self._failed
        if self._colocated is None:
            raise RuntimeError("the co-located servers were stopped")
        return self._colocated

    def stop_colocated(self) -> None:
        """Stop the agent and servers A and B (the reference keeps running)."""
        with self._lock:
            self._closed = True
            colocated, self._colocated = self._colocated, None
        if colocated is not None:
            colocated.close()
        else:
            self._launched.stop()  # still starting, or failed to

    def close(self, keep_logs: bool) -> None:
        """Stop everything; the run folder (the servers' logs) stays if ``keep_logs``."""
        self.stop_colocated()
        self.native.stop()
        shutil.rmtree(self._sockets, ignore_errors=True)
        if not keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)
