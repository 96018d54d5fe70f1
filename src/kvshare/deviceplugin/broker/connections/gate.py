"""The broker's limits on what one pod, and all of them together, may hold open.

A pod is a tenant: its processes may fork, so every limit counts per pod (the pod a
connecting process runs in, from its cgroup), never per process. Without Kubernetes
(``--no-kube``, the demo) a process in no pod's cgroup is its own tenant, as before.

- connections: at most ``max_connections_per_pod`` per pod, and ``max_connections`` in
  all, never more than the agent's file descriptors allow with room to spare for the
  metrics endpoint, the kubelet and pidfds (:func:`fd_budget`); a connection over a
  limit is told so and closed at once. The admin socket's connections (:data:`ADMIN`)
  are not counted in all: no flood of pods keeps the node's operators out;
- pools: at most ``max_pools_per_pod`` per pod (a pool re-declaring replaces its own);
- the first message: a connection that has not said what it is for within
  ``hello_deadline_s`` is closed (idle connections cost a file descriptor each);
- out of file descriptors all the same: the listening sockets are not polled for
  ``accept_backoff_s`` (the kernel keeps the waiting connections in its backlog), instead
  of a busy loop over a socket that cannot be accepted.

Touched by the broker's loop thread only.
"""

from __future__ import annotations

import resource
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvshare.api.wire import Hello
from kvshare.deviceplugin.broker.records import PoolRecord

__all__ = ["ADMIN", "BrokerLimits", "ConnectionGate", "fd_budget"]

#: The tenant of the admin socket's connections.
ADMIN = "admin"

#: File descriptors kept for everything but the broker's connections: the metrics
#: endpoint and its scrapers, the device plugin's gRPC servers, the state file, logs.
_FD_RESERVE = 64


@dataclass(frozen=True)
class BrokerLimits:
    """What one pod and the node may hold open (see the module doc)."""

    max_connections: int = 4096
    max_connections_per_pod: int = 128
    max_pools_per_pod: int = 64
    hello_deadline_s: float = 10.0
    identity_wait_s: float = 3.0
    """How long a hello waits for its pod to be known to the node agent."""
    accept_backoff_s: float = 1.0


def fd_budget() -> int:
    """Connections the broker may hold with the file descriptors this process may open:
    each may hold its socket and its pool's pidfd, and a reserve stays for the rest."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max((soft - _FD_RESERVE) // 2, 8)


class ConnectionGate:
    """Counts connections and pools per tenant, and the deadlines of first messages."""

    def __init__(self, limits: BrokerLimits) -> None:
        self.limits = limits
        self.max_connections = min(limits.max_connections, fd_budget())
        self._connections: dict[str, int] = defaultdict(int)
        self._total = 0
        self._pools: dict[str, set[int]] = defaultdict(set)
        self._pool_tenant: dict[int, str] = {}
        self._deadlines: deque[tuple[float, int]] = deque()
        self._paused_until = 0.0

    # --- connections --------------------------------------------------------------------

    def refusal(self, tenant: str) -> str | None:
        """Why ``tenant`` may not open another connection now (None: it may)."""
        if tenant != ADMIN and self._total >= self.max_connections:
            return (
                f"limit: the node agent serves at most {self.max_connections} connections; "
                "try again later"
            )
        if self._connections[tenant] >= self.limits.max_connections_per_pod:
            return (
                f"limit: {tenant} holds {self._connections[tenant]} connections, the most one "
                "pod may hold; close some"
            )
        return None

    def opened(self, conn_id: int, tenant: str, now: float) -> None:
        """A connection of ``tenant`` was accepted; its first message is due in time."""
        self._connections[tenant] += 1
        self._total += tenant != ADMIN
        self._deadlines.append((now + self.limits.hello_deadline_s, conn_id))

    def closed(self, tenant: str) -> None:
        """A connection of ``tenant`` closed."""
        left = self._connections[tenant] - 1
        if left > 0:
            self._connections[tenant] = left
        else:
            self._connections.pop(tenant, None)
        self._total -= tenant != ADMIN

    def overdue(self, now: float) -> list[int]:
        """Connections whose first message was due by ``now`` (the caller skips those
        that have said what they are for, or closed)."""
        due = []
        while self._deadlines and self._deadlines[0][0] <= now:
            due.append(self._deadlines.popleft()[1])
        return due

    @property
    def total(self) -> int:
        """Connections open (the admin socket's apart)."""
        return self._total

    # --- pools --------------------------------------------------------------------------

    def pool_refusal(
        self, tenant: str, pid: int, hello: Hello, pools: Iterable[PoolRecord]
    ) -> str | None:
        """Why ``tenant`` may not open the pool ``hello`` declares (None: it may).
        ``pools`` are all pools; a pool re-declaring (same process, pod and rank) takes
        its own record back and is always let through."""
        mine = [p for p in pools if p.id in self._pools.get(tenant, ())]
        if len(mine) < self.limits.max_pools_per_pod or (
            hello.resume
            and any(
                p.pid == pid and p.hello.pod == hello.pod and p.hello.rank == hello.rank
                for p in mine
            )
        ):
            return None
        return (
            f"limit: {tenant} already holds {len(mine)} pools, the most one pod may hold "
            "(each engine process needs one per GPU); close some"
        )

    def pool_added(self, tenant: str, pool_id: int) -> None:
        """Pool ``pool_id`` belongs to ``tenant``."""
        self._pools[tenant].add(pool_id)
        self._pool_tenant[pool_id] = tenant

    def pool_removed(self, pool_id: int) -> None:
        """Pool ``pool_id`` left."""
        tenant = self._pool_tenant.pop(pool_id, None)
        if tenant is not None:
            self._pools[tenant].discard(pool_id)
            if not self._pools[tenant]:
                del self._pools[tenant]

    def tenant_of_pool(self, pool_id: int) -> str | None:
        """The tenant pool ``pool_id`` belongs to."""
        return self._pool_tenant.get(pool_id)

    # --- out of file descriptors --------------------------------------------------------

    def pause_accepting(self, now: float) -> None:
        """Accepting failed for want of file descriptors: stop for a while."""
        self._paused_until = now + self.limits.accept_backoff_s

    def paused(self, now: float) -> bool:
        """Whether accepting is paused at ``now``."""
        return now < self._paused_until
