"""The node agent's own directory: its admin socket and the broker's restart file.

Pods must never reach either: the admin socket changes other tenants' leases, and the
restart file lists every pool's pod and pid. So the directory is not the one ``Allocate``
mounts into pods (nor inside it), it belongs to the agent's user, and only that user may
enter it (0700; the socket is 0600, the file 0600). What is found there that the agent
cannot make so (another owner, a symbolic link) stops the agent with a clear error
instead of serving from it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["PrivateDirError", "prepare"]


class PrivateDirError(ValueError):
    """The admin directory cannot be made private; the message says what to change."""


def prepare(directory: Path, shared: Path) -> None:
    """Create ``directory`` (0700, the agent's) or make it so; ``shared`` is the directory
    pods get mounted, which it must be neither equal to nor inside of (nor contain)."""
    private, pods = directory.resolve(), shared.resolve()
    if private == pods or pods in private.parents or private in pods.parents:
        raise PrivateDirError(
            f"the admin directory {directory} overlaps {shared}, the directory pods mount: "
            "choose another (--admin-dir, default /var/lib/kvshare)"
        )
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(directory)
    except OSError as exc:
        raise PrivateDirError(f"cannot create the admin directory {directory}: {exc}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise PrivateDirError(f"{directory} is not a directory (a link or a file): remove it")
    if info.st_uid != os.geteuid():
        raise PrivateDirError(
            f"{directory} belongs to uid {info.st_uid}, not the node agent's ({os.geteuid()}): "
            "it must be the agent's own"
        )
    if stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(directory, 0o700)
