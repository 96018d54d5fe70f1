"""How the broker is set up: where it listens and how it lends (:class:`BrokerConfig`),
and the error that stops it from starting."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvshare.deviceplugin.broker.connections.gate import BrokerLimits
from kvshare.deviceplugin.broker.policy import DEFAULT_POLICY

__all__ = ["BrokerConfig", "BrokerError"]


class BrokerError(RuntimeError):
    """The broker cannot start; the message says what to change."""


@dataclass(frozen=True)
class BrokerConfig:
    """Where the broker listens and how it lends."""

    socket_path: Path
    admin_path: Path | None = None
    state_path: Path | None = None
    headroom: int = 512 * 2**20
    reclaim_deadline_s: float = 10.0
    policy: str = DEFAULT_POLICY
    """The broker policy's name (:data:`kvshare.deviceplugin.broker.policy.POLICIES`)."""
    turn_hold_s: float = 600.0
    orphan_grace_s: float = 0.5
    orphan_wait_s: float = 10.0
    recovery_s: float = 10.0
    limits: BrokerLimits = field(default_factory=BrokerLimits)
    verify: bool = False
    """Under Kubernetes: bind every connection to a pod and check its first message
    against what the pod was given (:meth:`Broker.set_pod_directory`); fail closed."""
