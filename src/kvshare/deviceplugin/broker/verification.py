"""What the broker checks before a connection's first message reaches the books: which
pod the peer runs in (its tenant), and, under Kubernetes, that its hello or start-up turn
request fits that pod (:mod:`.identity`).

Under Kubernetes (``verify``) every check fails closed: a process whose pod cannot be
told is refused at once, and a hello whose pod the node agent does not know yet waits
(``identity_wait_s``) for the pod watch and the kubelet to tell, then is refused. Without
Kubernetes (``--no-kube``, the demo) nothing can be verified and the broker keeps its
earlier rules: a process is its own tenant, and a hello naming a pod UID is refused only
when the process's cgroup is another pod's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvshare.api.wire import Hello, TurnRequest
from kvshare.deviceplugin.broker import peers
from kvshare.deviceplugin.broker.identity import (
    PodDirectory,
    Refusal,
    check_hello,
    check_pod_uid,
    check_turn,
)
from kvshare.deviceplugin.broker.records import PoolRecord

__all__ = ["WAIT", "Tenant", "Verifier"]


@dataclass(frozen=True)
class Tenant:
    """Who a connection belongs to: ``key`` counts its limits; ``pod_uid`` is the pod its
    process runs in ("" when it runs in none, which only ``--no-kube`` accepts)."""

    key: str
    pod_uid: str = ""


class _Wait:
    """The pod is not known yet: ask again."""


#: The verdict on a message whose pod the directory does not know yet.
WAIT = _Wait()

Verdict = Hello | TurnRequest | Refusal | _Wait


class Verifier:
    """Binds connections to pods and checks their first messages (see the module doc)."""

    def __init__(self, verify: bool) -> None:
        self.verify = verify
        self.directory: PodDirectory | None = None

    def tenant(self, peer: peers.Peer, pidfd: int | None) -> Tenant | Refusal:
        """The tenant of a connection from ``peer`` (whose process ``pidfd`` is, when the
        kernel gave one), or why it is refused at once."""
        if peer.pid <= 0:
            return Refusal(
                "no-pod",
                "identity: the broker cannot see your process (another pid namespace): "
                "run the node agent with hostPID",
            )
        pod = peers.pod_of(peer.pid, pidfd)
        if pod.uid is not None:
            return Tenant(f"pod {pod.uid}", pod.uid)
        if self.verify:
            return Refusal(
                "no-pod",
                f"identity: cannot tell which pod process {peer.pid} runs in ({pod.problem}); "
                "this broker serves only the pods of its node",
            )
        return Tenant(f"process {peer.pid}")

    def check(
        self, tenant: Tenant, pid: int, message: Hello | TurnRequest, pools: Iterable[PoolRecord]
    ) -> Verdict:
        """``message`` as the books take it, why it is refused, or :data:`WAIT`.
        ``pools``: every pool of the books."""
        if not self.verify:
            return self._unverified(tenant, pid, message)
        refusal = check_pod_uid(message.pod_uid, tenant.pod_uid, pid)
        if refusal is not None:
            return refusal
        grant = self.directory.grant(tenant.pod_uid) if self.directory is not None else None
        if grant is None:
            return WAIT
        if isinstance(message, Hello):
            mine = [p for p in pools if p.hello.pod_uid == grant.uid]
            return check_hello(message, grant, pid, mine)
        return check_turn(message, grant)

    def unknown(self, tenant: Tenant) -> Refusal:
        """The refusal of a message whose pod stayed unknown."""
        why = (
            self.directory.unknown(tenant.pod_uid)
            if self.directory is not None
            else "the node agent has no pod directory (no Kubernetes API or kubelet)"
        )
        return Refusal("unknown-pod", f"identity: pod {tenant.pod_uid} is not known: {why}")

    @staticmethod
    def _unverified(tenant: Tenant, pid: int, message: Hello | TurnRequest) -> Verdict:
        declared = message.pod_uid
        if declared and tenant.pod_uid and declared != tenant.pod_uid:
            return Refusal("pod-uid", f"peer: process {pid} does not run in pod {declared}")
        return message
