"""The ``ModelServer`` custom resource: one model served by vLLM or SGLang on shared GPUs.

A ModelServer describes *what* to serve and *how much GPU memory* each worker needs:
a static part (weights, activations, CUDA context) that never moves, and an elastic KV
cache with a guaranteed ``min``, a ``max`` cap and a reclaim ``priority``. The operator
places its replicas onto GPUs (see :mod:`kvshare.api.placement`) and reports back in
:class:`ModelServerStatus`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, StringConstraints, model_validator

from kvshare.api import reserved
from kvshare.api.engines import is_supported, supported_labels
from kvshare.api.kube import (
    DNS_SUBDOMAIN_PATTERN,
    ByteQuantity,
    CelRule,
    Condition,
    EnvVar,
    KubeModel,
    LocalObjectReference,
    ResourceRequirements,
    Toleration,
    WorkerMemory,
    cel_rules,
)
from kvshare.api.names import GPU_MEMORY_UNIT_BYTES, GROUP, LABEL_MANAGED_BY
from kvshare.api.quantity import format_bytes

__all__ = [
    "ENGINE_COMMAND_LINES",
    "ENGINE_MANAGED_FLAGS",
    "Engine",
    "EngineCommandLine",
    "EngineVersionError",
    "KVCacheSpec",
    "KVUsage",
    "ModelServerSpec",
    "ModelServerStatus",
    "Phase",
    "ReplicaPlacement",
    "image_tag_version",
]

Engine = Literal["vllm", "sglang"]
Phase = Literal["Pending", "Unschedulable", "Starting", "Ready", "Degraded"]
DType = Literal["bfloat16", "float16", "float32", "fp8"]


@dataclass(frozen=True)
class EngineCommandLine:
    """How one engine is started, and which of its flags kvshare owns.

    The operator builds the engine's command line from this table, and the CRD refuses
    engine arguments that name any of :meth:`managed_flags`: the ones kvshare sets itself
    (model, host, port, tensor parallelism) and the ones the kvshare runtime *replaces*
    (the static GPU-memory fraction and KV-cache sizing, which come from the lease).
    """

    program: tuple[str, ...]
    """The command that starts the server (the image's entrypoint is replaced)."""
    model: str | None
    """Flag naming the model, or ``None`` when the model is the first positional argument."""
    host: str
    port: str
    tensor_parallel_size: str
    aliases: tuple[str, ...]
    """Other spellings of the flags above, refused in engineArgs as well."""
    replaced: tuple[str, ...]
    """Memory-sizing flags the kvshare runtime replaces; never passed to the engine."""

    def managed_flags(self) -> tuple[str, ...]:
        """Every flag users may not pass in engineArgs."""
        own = (self.model,) if self.model else ()
        return (
            *own,
            self.port,
            self.host,
            self.tensor_parallel_size,
            *self.aliases,
            *self.replaced,
        )

    def argv(
        self, *, model: str, port: int, tensor_parallel_size: int, extra: Sequence[str] = ()
    ) -> list[str]:
        """The full command line: program, kvshare's flags, then ``extra`` unchanged."""
        head = [self.model, model] if self.model else [model]
        return [
            *self.program,
            *head,
            self.host,
            "0.0.0.0",
            self.port,
            str(port),
            self.tensor_parallel_size,
            str(tensor_parallel_size),
            *extra,
        ]


#: The command line of each engine: the one source for the operator and the CRD rules.
ENGINE_COMMAND_LINES: dict[str, EngineCommandLine] = {
    "vllm": EngineCommandLine(
        program=("vllm", "serve"),
        model=None,
        host="--host",
        port="--port",
        tensor_parallel_size="--tensor-parallel-size",
        aliases=("--model", "-tp"),
        replaced=(
            "--gpu-memory-utilization",
            "--kv-cache-memory-bytes",
            "--num-gpu-blocks-override",
            "--enable-extensible-kv-cache",
            "--no-enable-extensible-kv-cache",
        ),
    ),
    "sglang": EngineCommandLine(
        program=("python3", "-m", "sglang.launch_server"),
        model="--model-path",
        host="--host",
        port="--port",
        tensor_parallel_size="--tp-size",
        aliases=("--model", "--tp"),
        replaced=("--mem-fraction-static", "--max-total-tokens"),
    ),
}

#: Engine command-line flags kvshare manages; users may not pass them in engineArgs.
ENGINE_MANAGED_FLAGS: dict[str, tuple[str, ...]] = {
    engine: command.managed_flags() for engine, command in ENGINE_COMMAND_LINES.items()
}

_VERSION_IN_TAG = re.compile(r"^v?([0-9]+\.[0-9]+(?:\.[0-9]+)?(?:\.post[0-9]+)?)(?:[-+_].*)?$")


class EngineVersionError(ValueError):
    """The engine version is unknown or not supported; the message says what to do."""


def image_tag_version(image: str) -> str | None:
    """The version in an image tag (``vllm/vllm-openai:v0.33.0`` -> ``0.33.0``), if any."""
    reference = image.split("@", 1)[0]
    name, _, tag = reference.rpartition(":")
    if not name or "/" in tag:  # no tag; the colon belonged to a registry port
        return None
    match = _VERSION_IN_TAG.match(tag)
    return match.group(1) if match else None


_ALL_MANAGED_FLAGS = tuple(sorted({f for flags in ENGINE_MANAGED_FLAGS.values() for f in flags}))

_BYTES_PER_PARAMETER: dict[str, float] = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "fp8": 1,
}
_PARAMETER_SCALE = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
_PARAMETERS_PATTERN = r"^[0-9]+(\.[0-9]+)?[KMBT]$"
#: Activations, CUDA context and allocator slack on top of the weights, per worker.
_STATIC_OVERHEAD_BYTES = 2 * 2**30
_STATIC_OVERHEAD_FACTOR = 1.1


# A Kubernetes object name (RFC 1123 subdomain).
_Name = Annotated[
    str, StringConstraints(max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]


def _cel_quantity(expr: str) -> str:
    return f"quantity(string({expr}))"


#: A container image reference (the distribution project's grammar, as Docker reads it):
#: an optional registry (a host with a dot or a port, or localhost), a lowercase path,
#: then a tag and/or a digest. ASCII only, so control characters and look-alike letters
#: are refused; written without backslashes: the same text is a CEL string and a pattern.
_HOST_PART = "([a-zA-Z0-9]|[a-zA-Z0-9][-a-zA-Z0-9]*[a-zA-Z0-9])"
_PATH_PART = "[a-z0-9]+(([._]|__|[-]+)[a-z0-9]+)*"
IMAGE_REFERENCE = (
    f"^(({_HOST_PART}([.]{_HOST_PART})+(:[0-9]+)?|{_HOST_PART}:[0-9]+|localhost)/)?"
    f"{_PATH_PART}(/{_PATH_PART})*"
    "(:[a-zA-Z0-9_][a-zA-Z0-9_.-]{0,127})?"
    "(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
_IMAGE = re.compile(IMAGE_REFERENCE)
_NOT_AN_IMAGE_WORDS = (
    "must be a container image reference such as vllm/vllm-openai:v0.33.0 or "
    "registry.example.com:5000/team/vllm@sha256:<digest>: ASCII letters and digits, a "
    "lowercase repository path, no spaces or control characters"
)
_NOT_AN_IMAGE = f"'{_NOT_AN_IMAGE_WORDS}'"


def _image_reference(image: str) -> str:
    if not _IMAGE.fullmatch(image):
        raise ValueError(_NOT_AN_IMAGE_WORDS)
    return image


# Label and annotation keys: an optional DNS-subdomain prefix and "/", then a name of at
# most 63 characters (Kubernetes "qualified names"). Label values: at most 63 characters.
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(DNS_SUBDOMAIN_PATTERN)
_LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
#: Keys under kvshare's own prefix are the operator's: it sets them on every pod it makes
#: and reads the pods' identity and placement back from them.
_RESERVED_PREFIX = f"{GROUP}/"
#: Label keys podLabels may not set besides that prefix: the operator selects its pods by it.
_RESERVED_LABELS = (LABEL_MANAGED_BY,)
#: Most entries in podLabels and podAnnotations; with values of at most 4096 characters,
#: podAnnotations stays within the API server's 256 KiB limit on a pod's annotations.
_MAX_POD_METADATA = 64
_MAX_ANNOTATION_VALUE = 4096


def _reserved_keys(reserved: tuple[str, ...]) -> str:
    return " or ".join((f"keys under {_RESERVED_PREFIX}", *reserved))


def _key_problem(key: str) -> str | None:
    """Why ``key`` is not a valid label or annotation key, or ``None``."""
    prefix, slash, name = key.rpartition("/")
    if slash and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix)):
        return f"its prefix {prefix!r} must be a DNS subdomain of at most 253 characters"
    if not (len(name) <= 63 and _QUALIFIED_NAME.match(name)):
        return (
            f"its name {name!r} must be 1-63 letters, digits, '-', '_' or '.', starting and "
            "ending with a letter or digit"
        )
    return None


def _pod_metadata_problems(
    field: str, items: dict[str, str], reserved: tuple[str, ...]
) -> list[str]:
    """Problems with the keys of podLabels or podAnnotations (``field``)."""
    problems = []
    for key in items:
        problem = _key_problem(key)
        if problem is not None:
            problems.append(f"{field} key {key!r} is not valid: {problem}")
        elif key.startswith(_RESERVED_PREFIX) or key in reserved:
            problems.append(
                f"{field} may not set {key}: kvshare sets {_reserved_keys(reserved)} on its "
                "pods and finds the pods by them; use another key"
            )
    return problems


def _reserved_keys_rule(field: str, reserved: tuple[str, ...]) -> CelRule:
    """The CEL rule refusing reserved keys in podLabels or podAnnotations (``field``)."""
    allowed = f"!k.startsWith('{_RESERVED_PREFIX}')" + "".join(f" && k != '{r}'" for r in reserved)
    return CelRule(
        rule=f"self.all(k, {allowed})",
        message_expression=(
            f"'{field} may not set {_reserved_keys(reserved)}: kvshare sets them on its "
            "pods and finds the pods by them; use other keys'"
        ),
        reason="FieldValueForbidden",
    )


class KVCacheSpec(KubeModel):
    """How much KV-cache memory each worker is guaranteed, may grow to, and gives back."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": cel_rules(
            CelRule(
                rule=(  # a malformed size is its own field's finding
                    "!has(self.max) || !isQuantity(string(self.min)) || "
                    "!isQuantity(string(self.max)) || "
                    f"{_cel_quantity('self.min')}.compareTo({_cel_quantity('self.max')}) <= 0"
                ),
                message_expression=(
                    "'kvCache.min (' + string(self.min) + ') exceeds kvCache.max ('"
                    " + string(self.max) + ')'"
                ),
                field_path=".min",
            )
        )
    }

    min: WorkerMemory = 0
    """KV-cache bytes per worker guaranteed at admission; the replica is only placed where
    static memory plus this fits on every one of its GPUs. Unset: nothing guaranteed (the
    cache grows on demand from what the GPU can lend)."""
    max: WorkerMemory | None = None
    """Cap on KV-cache bytes per worker; unset means as much as the GPU can lend."""
    priority: int = Field(default=100, ge=0, le=1000)
    """Under contention, workers with lower priority give memory back first (0-1000)."""

    @model_validator(mode="after")
    def _min_within_max(self) -> KVCacheSpec:
        if self.max is not None and self.min > self.max:
            raise ValueError(
                f"kvCache.min ({format_bytes(self.min)}) exceeds kvCache.max "
                f"({format_bytes(self.max)})"
            )
        return self


class ModelServerSpec(KubeModel):
    """What to serve, with which engine, and how much GPU memory each worker needs."""

    model_config = KubeModel.model_config | {
        "json_schema_extra": cel_rules(
            CelRule(
                rule="has(self.staticMemory) || has(self.modelParameters)",
                message_expression=(
                    "'set staticMemory (GPU memory per worker for weights and activations, "
                    "e.g. 18Gi) or modelParameters (e.g. 8B) so kvshare can place the model'"
                ),
                reason="FieldValueRequired",
            ),
            CelRule(
                rule="!self.colocateWith.exists(n, n in self.avoidColocationWith)",
                message_expression=(
                    "'a ModelServer cannot be both in colocateWith and avoidColocationWith'"
                ),
                field_path=".colocateWith",
            ),
        )
    }

    engine: Engine
    """Serving engine: vllm or sglang."""
    engine_version: str | None = Field(
        default=None, pattern=r"^[0-9]+\.[0-9]+(\.[0-9]+)?([.+-][0-9A-Za-z.]+)?$", max_length=64
    )
    """Engine version inside the image (e.g. 0.33.0); when unset, read from the image tag."""
    image: Annotated[str, AfterValidator(_image_reference)] = Field(
        min_length=1,
        max_length=1024,
        json_schema_extra=cel_rules(
            CelRule(rule=f"self.matches('{IMAGE_REFERENCE}')", message_expression=_NOT_AN_IMAGE)
        ),
    )
    """Container image of the engine (e.g. vllm/vllm-openai:v0.33.0)."""
    model: str = Field(min_length=1, max_length=1024)
    """Model to serve: a Hugging Face id or a path inside the image."""
    engine_args: list[Annotated[str, StringConstraints(max_length=512)]] = Field(
        default=[],
        max_length=128,
        json_schema_extra=cel_rules(reserved.engine_args_rule(_ALL_MANAGED_FLAGS)),
    )
    """Extra engine command-line arguments, passed through unchanged; not the flags kvshare
    sets or that size memory (nor their abbreviations)."""
    env: list[EnvVar] = Field(
        default=[], max_length=128, json_schema_extra=cel_rules(reserved.env_rule())
    )
    """Extra environment variables for the engine container (e.g. HF_TOKEN from a Secret);
    not those that choose GPUs (NVIDIA_*, CUDA_VISIBLE_DEVICES, ...) or configure kvshare."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """Number of replicas, each a pod with tensorParallelSize GPUs."""
    tensor_parallel_size: Literal[1, 2, 4, 8] = 1
    """GPUs per replica, all on one node; each GPU runs one worker."""
    static_memory: WorkerMemory | None = None
    """GPU memory per worker outside the KV cache (weights, activations, CUDA context)."""
    model_parameters: str | None = Field(default=None, pattern=_PARAMETERS_PATTERN, max_length=16)
    """Parameter count (e.g. 8B, 0.5B); estimates staticMemory when that is unset."""
    dtype: DType = "bfloat16"
    """Weight data type, used with modelParameters to estimate staticMemory."""
    kv_cache: KVCacheSpec = Field(default=KVCacheSpec(), json_schema_extra={"default": {}})
    """Elastic KV-cache policy per worker; unset: min 0, no max, priority 100."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Port the engine serves HTTP on."""
    resources: ResourceRequirements = Field(default=ResourceRequirements())
    """CPU and host memory for the engine container (GPU resources are set by kvshare)."""
    node_selector: dict[str, str] = Field(default={}, max_length=64)
    """Only nodes with all of these labels are considered."""
    tolerations: list[Toleration] = Field(default=[], max_length=64)
    """Taints this ModelServer tolerates."""
    colocate_with: list[_Name] = Field(default=[], max_length=32)
    """ModelServers (same namespace) whose GPUs this one prefers to share."""
    avoid_colocation_with: list[_Name] = Field(default=[], max_length=32)
    """ModelServers (same namespace) this one never shares a GPU with."""
    placement_policy: Literal["Binpack", "Spread"] = "Binpack"
    """Binpack fills the fullest GPUs that fit first; Spread the emptiest."""
    image_pull_secrets: list[LocalObjectReference] = Field(default=[], max_length=16)
    """Secrets (in the ModelServer's namespace) with the credentials to pull the engine
    image, and the kvshare image of the runtime's init container, from private registries."""
    service_account_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN
    )
    """ServiceAccount the model-server pods run as (e.g. one bound to a cloud identity that
    may read the model from object storage); unset means the namespace's default."""
    pod_labels: dict[
        str, Annotated[str, StringConstraints(max_length=63, pattern=_LABEL_VALUE_PATTERN)]
    ] = Field(
        default={},
        max_length=_MAX_POD_METADATA,
        json_schema_extra=cel_rules(_reserved_keys_rule("podLabels", _RESERVED_LABELS)),
    )
    """Extra labels on the model-server pods (e.g. a team or cost-allocation label). Keys
    under kvshare.io/ and app.kubernetes.io/managed-by are kvshare's own."""
    pod_annotations: dict[
        str, Annotated[str, StringConstraints(max_length=_MAX_ANNOTATION_VALUE)]
    ] = Field(
        default={},
        max_length=_MAX_POD_METADATA,
        json_schema_extra=cel_rules(_reserved_keys_rule("podAnnotations", ())),
    )
    """Extra annotations on the model-server pods (e.g. a service mesh's or a metrics
    scraper's settings). Keys under kvshare.io/ are kvshare's own."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ModelServerSpec:
        problems = []
        if self.static_memory is None and self.model_parameters is None:
            problems.append(
                "set staticMemory (GPU memory per worker for weights and activations, e.g. "
                "18Gi) or modelParameters (e.g. 8B) so kvshare can place the model"
            )
        managed = reserved.managed_args(self.engine_args, _ALL_MANAGED_FLAGS)
        if managed:
            problems.append(
                f"engineArgs may not set flags kvshare manages ({', '.join(managed)}): they "
                f"set or abbreviate one of {', '.join(_ALL_MANAGED_FLAGS)}; use the "
                "ModelServer fields instead"
            )
        problems += reserved.env_problems(item.name for item in self.env)
        both = sorted(set(self.colocate_with) & set(self.avoid_colocation_with))
        if both:
            problems.append(
                f"{', '.join(both)} cannot be both in colocateWith and avoidColocationWith"
            )
        problems += _pod_metadata_problems("podLabels", self.pod_labels, _RESERVED_LABELS)
        problems += _pod_metadata_problems("podAnnotations", self.pod_annotations, ())
        for resource in (*self.resources.requests, *self.resources.limits):
            if resource.startswith((f"{GROUP}/", "nvidia.com/")):
                problems.append(
                    f"resources may not name {resource}: kvshare requests GPU resources itself"
                )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def static_bytes_per_worker(self) -> int:
        """GPU memory one worker needs outside its KV cache: explicit, or estimated."""
        if self.static_memory is not None:
            return self.static_memory
        assert self.model_parameters is not None  # guaranteed by _cross_field_rules
        parameters = float(self.model_parameters[:-1]) * _PARAMETER_SCALE[self.model_parameters[-1]]
        weights = parameters * _BYTES_PER_PARAMETER[self.dtype] / self.tensor_parallel_size
        estimate = int(weights * _STATIC_OVERHEAD_FACTOR) + _STATIC_OVERHEAD_BYTES
        # Round up to whole MiB so the estimate prints as a clean quantity.
        return -(-estimate // 2**20) * 2**20

    def engine_version_resolved(self) -> str:
        """The engine version: ``engineVersion``, else the image tag's, if supported.

        Raises :class:`EngineVersionError` saying what to set when the version is unknown
        or not one kvshare's runtime hooks support.
        """
        version = self.engine_version or image_tag_version(self.image)
        supported = supported_labels(self.engine)
        if version is None:
            raise EngineVersionError(
                f"cannot tell the {self.engine} version from image {self.image}: set "
                f"spec.engineVersion (supported: {supported})"
            )
        if not is_supported(self.engine, version):
            raise EngineVersionError(
                f"{self.engine} {version} is not supported by this kvshare version "
                f"(supported: {supported}); use a supported image, or set "
                "spec.engineVersion if the image tag does not name the engine version"
            )
        return version

    def gpu_memory_units_per_replica(self) -> int:
        """Units of ``kvshare.io/gpu-memory`` (GiB, rounded up) one replica requests."""
        per_worker = self.static_bytes_per_worker() + self.kv_cache.min
        return self.tensor_parallel_size * -(-per_worker // GPU_MEMORY_UNIT_BYTES)


class ReplicaPlacement(KubeModel):
    """Where one replica runs."""

    replica: int = Field(ge=0)
    """Replica index."""
    pod: str = Field(max_length=253)
    """Pod name."""
    node: str = Field(max_length=253)
    """Node the pod is pinned to."""
    gpus: list[str] = Field(default=[], max_length=8)
    """UUIDs of the replica's GPUs, in rank order."""
    kv_policy: Literal["Applied", "Pending", "Refused"] | None = None
    """Whether the replica runs the current kvCache (changed in place, without a restart):
    Applied, Pending, or Refused by its node (the replica is then replaced); unset until
    its pools are reported."""
    kv_policy_message: str | None = Field(default=None, max_length=512)
    """Why the replica does not run the current kvCache yet."""


class KVUsage(KubeModel):
    """KV-cache memory across all workers of a ModelServer, as the node agents report it."""

    min: ByteQuantity = 0
    """Sum of guaranteed minimums."""
    lease: ByteQuantity = 0
    """Sum of leases the brokers currently grant."""
    mapped: ByteQuantity = 0
    """Sum of physically mapped KV bytes."""
    used: ByteQuantity = 0
    """Sum of KV bytes holding live blocks."""
    demand: ByteQuantity = 0
    """Sum of what the workers need: the KV bytes each asks for or holds in live blocks,
    whichever is more (above lease: the brokers cannot give them all they ask)."""

    def pressure(self) -> float:
        """KV demand over KV lease: near 1 the caches are full, above 1 the workers wait
        for memory the brokers cannot lend them (the signal to scale out on)."""
        if not self.lease:
            return 1.0 if self.demand else 0.0
        return self.demand / self.lease


class ModelServerStatus(KubeModel):
    """What the operator observed and decided, in Kubernetes condition conventions."""

    phase: Phase = "Pending"
    """Pending, Unschedulable, Starting, Ready or Degraded."""
    observed_generation: int | None = Field(default=None, ge=0)
    """The .metadata.generation this status reflects."""
    replicas: int = Field(default=0, ge=0)
    """Replicas that exist (pods created)."""
    ready_replicas: int = Field(default=0, ge=0)
    """Replicas whose engine answers its health check."""
    ready: str = "0/0"
    """Ready over desired replicas, for `kubectl get ms`."""
    conditions: list[Condition] = Field(default=[], max_length=16)
    """Placed, Ready, Progressing, Degraded and ResolvedRefs, with reasons."""
    placements: list[ReplicaPlacement] = Field(default=[], max_length=1024)
    """Node and GPUs of each replica."""
    kv: KVUsage = Field(default=KVUsage())
    """KV-cache memory in use, aggregated from KVShareNodes."""
    endpoint: str | None = None
    """URL of the ModelServer's Service."""
    selector: str | None = Field(default=None, max_length=1024)
    """Label selector of the replica pods (the scale subresource's, for autoscalers)."""
