"""Per-node settings: named configurations, one chosen per node by a label.

Node pools differ (an H100 pool shares each GPU among more pods than an L4 pool, a test
pool runs fake GPUs), so ``kvshare node --config FILE`` reads several named
configurations and takes the one its Node's label (``--config-label``, default
``kvshare.io/node-config``) names, as NVIDIA's device plugin does with its config map.
The chart writes the file from its values (``nodeAgent.configs``)::

    default: {slotsPerGpu: 8, headroom: 512Mi, reclaimDeadlineSeconds: 10, fakeGpus: ""}
    configs:
      h100-dense: {slotsPerGpu: 16, headroom: 1Gi}

A named configuration sets only what differs; the rest comes from ``default``. A node
without the label runs ``default``; a label naming no configuration runs ``default`` too,
and says so (a log line and the KVShareNode's ``NodeConfigApplied`` condition): a typo
in a label must not stop the broker that the node's model servers lease from. The file
is read once, at start: a changed label or file applies when the agent restarts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import Field, StringConstraints

from kvshare.api import names
from kvshare.api.kube import ByteQuantity, KubeModel, SpecError, validate

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_LABEL",
    "NodeConfigError",
    "NodeConfigFile",
    "NodeSettings",
    "SelectedConfig",
    "load_config_file",
    "select",
]

#: The Node label whose value names the node's configuration.
DEFAULT_LABEL = f"{names.GROUP}/node-config"
#: The name of the configuration nodes without the label run.
DEFAULT_CONFIG = "default"
#: Most bytes read from a configuration file (it is a chart-written ConfigMap).
_MAX_FILE_BYTES = 1 << 20


class NodeConfigError(ValueError):
    """The configuration file cannot be used; the message names the file and the field."""


class NodeSettings(KubeModel):
    """What may differ between node pools; unset fields come from the default."""

    slots_per_gpu: int | None = Field(default=None, ge=1, le=256)
    """kvshare.io/gpu slots each GPU advertises."""
    headroom: ByteQuantity | None = None
    """GPU memory the broker never lends, per GPU."""
    reclaim_deadline_seconds: float | None = Field(default=None, gt=0, le=3600)
    """Time a pool has to give reclaimed memory back."""
    fake_gpus: str | None = Field(
        default=None,
        max_length=256,
        pattern=r"^([0-9]+x[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti)?(,[0-9]+x[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti)?)*)?$",
    )
    """Declared GPUs backed by host memory (e.g. 2x80Gi); empty: NVML."""

    def over(self, base: NodeSettings) -> NodeSettings:
        """These settings, with what they leave unset taken from ``base``."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


#: A configuration's name: a label value.
_Name = Annotated[
    str, StringConstraints(max_length=63, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
]


class NodeConfigFile(KubeModel):
    """The file: the default configuration and the named ones."""

    default: NodeSettings = Field(default=NodeSettings())
    """What every node runs unless its label names another configuration."""
    configs: dict[_Name, NodeSettings] = Field(default={}, max_length=256)
    """Named configurations (names are label values), each over the default."""


@dataclass(frozen=True)
class SelectedConfig:
    """The configuration a node runs, and why."""

    name: str
    settings: NodeSettings
    problem: str = ""
    """Set when the label names a configuration the file does not have."""


def load_config_file(path: Path) -> NodeConfigFile:
    """Read and validate the configuration file; :class:`NodeConfigError` says what is wrong."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise NodeConfigError(f"cannot read node configuration {path}: {exc}") from None
    if len(raw) > _MAX_FILE_BYTES:
        raise NodeConfigError(f"node configuration {path} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        document = yaml.safe_load(raw) or {}
    except yaml.YAMLError as exc:
        raise NodeConfigError(f"node configuration {path} is not YAML: {exc}") from None
    try:
        parsed = validate(NodeConfigFile, document, kind=f"node configuration {path}")
    except SpecError as exc:
        raise NodeConfigError(str(exc)) from None
    return parsed


def select(
    config: NodeConfigFile, labels: dict[str, str] | None, label: str = DEFAULT_LABEL
) -> SelectedConfig:
    """The configuration for a node with ``labels`` (``None``: the Node is unknown)."""
    wanted = (labels or {}).get(label, "")
    if not wanted or wanted == DEFAULT_CONFIG:
        return SelectedConfig(DEFAULT_CONFIG, config.default)
    chosen = config.configs.get(wanted)
    if chosen is None:
        known = ", ".join(sorted(config.configs)) or "none"
        return SelectedConfig(
            DEFAULT_CONFIG,
            config.default,
            f"label {label}={wanted} names no configuration (known: {known}); running "
            f"{DEFAULT_CONFIG!r}: fix the label or add the configuration to the chart's "
            "nodeAgent.configs",
        )
    return SelectedConfig(wanted, chosen.over(config.default))
