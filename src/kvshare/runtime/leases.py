"""Choose a pool's lease source from the environment: :func:`lease_from_env`."""

from __future__ import annotations

from collections.abc import Mapping

from kvshare.api import env
from kvshare.runtime.broker_client import (
    BrokerLease,
    PoolIdentity,
    PoolPolicy,
    broker_present,
)
from kvshare.runtime.lease import LeaseSource, StaticLease

__all__ = ["LeaseConfigError", "gpu_for_rank", "lease_from_env"]


class LeaseConfigError(RuntimeError):
    """Neither a broker nor a fixed limit is configured; the message says what to set."""


def gpu_for_rank(rank: int, environ: Mapping[str, str] | None = None) -> str:
    """The UUID of this worker's GPU: entry ``rank`` of ``KVSHARE_GPU_UUIDS``."""
    uuids = [u.strip() for u in (env.GPU_UUIDS.read(environ) or "").split(",") if u.strip()]
    if not uuids:
        raise LeaseConfigError(
            "KVSHARE_GPU_UUIDS is not set: the kvshare device plugin sets it for containers "
            "that request kvshare.io/gpu; outside Kubernetes set it to the GPU's UUID"
        )
    if not 0 <= rank < len(uuids):
        raise LeaseConfigError(
            f"rank {rank} has no GPU: KVSHARE_GPU_UUIDS lists {len(uuids)} ({','.join(uuids)})"
        )
    return uuids[rank]


def lease_from_env(
    gpu: str | None = None,
    *,
    rank: int = 0,
    tp_size: int = 1,
    engine: str = "",
    environ: Mapping[str, str] | None = None,
) -> LeaseSource:
    """The lease source for a pool in this process.

    - A :class:`~kvshare.runtime.broker_client.BrokerLease` when the node agent's broker
      socket (``KVSHARE_BROKER_SOCKET``) exists; its GPU is ``gpu`` or this rank's entry
      of ``KVSHARE_GPU_UUIDS``, its policy and identity come from ``KVSHARE_*``.
    - A :class:`~kvshare.runtime.lease.StaticLease` of ``KVSHARE_KV_LIMIT`` bytes otherwise.
    - :class:`LeaseConfigError` when neither is available.
    """
    socket_path = env.BROKER_SOCKET.require(environ)
    if broker_present(socket_path):
        return BrokerLease(
            gpu or gpu_for_rank(rank, environ),
            policy=PoolPolicy.from_env(environ),
            identity=PoolIdentity.from_env(environ, rank=rank, tp_size=tp_size, engine=engine),
            socket_path=socket_path,
            chunk_bytes=env.LEASE_CHUNK.read(environ),
        )
    limit = env.KV_LIMIT.read(environ)
    if limit is not None:
        return StaticLease(limit)
    raise LeaseConfigError(
        f"no kvshare broker at {socket_path} and KVSHARE_KV_LIMIT is not set: run under the "
        "kvshare node agent, or set KVSHARE_KV_LIMIT (e.g. 8Gi) for a fixed KV cache"
    )
