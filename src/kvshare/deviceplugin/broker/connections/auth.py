"""Who may talk to the broker: which processes may open a pool, and which may send admin
requests. Decided from the peer's credentials as the kernel gives them
(:mod:`kvshare.deviceplugin.broker.peers`), never from what the peer says about itself."""

from __future__ import annotations

import os

from kvshare.api.wire import Hello
from kvshare.deviceplugin.broker import peers
from kvshare.deviceplugin.broker.books import PoolRecord

__all__ = ["MAX_POOLS_PER_PROCESS", "admin_problem", "peer_problem", "too_many_pools"]

#: Pools one process may hold at once. An engine process holds one per GPU it drives;
#: the limit keeps one misbehaving process from filling the books (and every listing).
MAX_POOLS_PER_PROCESS = 64


def peer_problem(peer: peers.Peer, hello: Hello) -> str | None:
    """Why ``peer`` may not open the pool ``hello`` declares (None: it may): the broker
    must see the process, and a process naming a pod must run in that pod."""
    if peer.pid <= 0:
        return (
            "peer: the broker cannot see your process (another pid namespace): run the "
            "node agent with hostPID"
        )
    if hello.pod_uid and peers.in_pod(peer.pid, hello.pod_uid) is False:
        return f"peer: process {peer.pid} does not run in pod {hello.pod_uid}"
    return None


def too_many_pools(peer: peers.Peer, hello: Hello, mine: list[PoolRecord]) -> str | None:
    """Why ``peer``, which holds the pools ``mine``, may not open another (None: it may)."""
    if len(mine) < MAX_POOLS_PER_PROCESS or any(
        p.hello.pod == hello.pod and p.hello.rank == hello.rank for p in mine
    ):  # a pool reconnecting replaces its own record
        return None
    return (
        f"peer: process {peer.pid} already holds {len(mine)} pools, the most one process "
        "may hold; close some (each engine process needs one per GPU)"
    )


def admin_problem(peer: peers.Peer) -> str | None:
    """Why ``peer`` may not send admin requests (None: it may): only root or the node
    agent's own user, from the node agent's own container."""
    if peer.uid not in (0, os.geteuid()):
        return f"admin requests need uid 0 or {os.geteuid()}, not {peer.uid}"
    if peers.same_mount_namespace(peer.pid) is False:
        return "admin requests are only taken from the node agent's own container"
    return None
