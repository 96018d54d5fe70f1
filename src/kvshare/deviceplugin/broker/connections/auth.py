"""Who may send admin requests: decided from the peer's credentials as the kernel gives
them (:mod:`kvshare.deviceplugin.broker.peers`), never from what the peer says about
itself. Every check fails closed: what cannot be told is a refusal.

The admin socket lives in a directory no pod mounts; this is the second wall, for a
process that reaches it anyway (a pod with the host's filesystem): it must be root or the
agent's own user *and* share the agent's mount namespace (``kubectl exec`` into the
agent's container does; a pod's container does not).
"""

from __future__ import annotations

import os

from kvshare.deviceplugin.broker import peers

__all__ = ["admin_problem"]


def admin_problem(peer: peers.Peer) -> str | None:
    """Why ``peer`` may not send admin requests (None: it may)."""
    if peer.uid not in (0, os.geteuid()):
        return f"admin requests need uid 0 or {os.geteuid()}, not {peer.uid}"
    if peer.pid <= 0:
        return "admin requests need a process the node agent can see (hostPID)"
    same = peers.same_mount_namespace(peer.pid)
    if same is None:
        return (
            f"admin requests are only taken from the node agent's own container: cannot "
            f"tell where process {peer.pid} runs"
        )
    if not same:
        return "admin requests are only taken from the node agent's own container"
    return None
