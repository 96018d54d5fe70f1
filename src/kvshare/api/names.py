"""Names that cross process and cluster boundaries: API group, kinds, resources, labels.

Every string that two kvshare programs (or kvshare and Kubernetes) must agree on is
defined here once. Environment variables live in :mod:`kvshare.api.env`.
"""

from __future__ import annotations

from typing import Final

#: API group and version of the kvshare custom resources.
GROUP: Final = "kvshare.io"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"

# --- custom resources --------------------------------------------------------------
MODELSERVER_KIND: Final = "ModelServer"
MODELSERVER_PLURAL: Final = "modelservers"
MODELSERVER_SINGULAR: Final = "modelserver"
MODELSERVER_SHORT_NAMES: Final = ("ms",)

KVSHARENODE_KIND: Final = "KVShareNode"
KVSHARENODE_PLURAL: Final = "kvsharenodes"
KVSHARENODE_SINGULAR: Final = "kvsharenode"
KVSHARENODE_SHORT_NAMES: Final = ("ksn",)

#: The category `kubectl get kvshare` lists.
CATEGORY: Final = "kvshare"

# --- extended resources advertised by the device plugin ---------------------------
#: GPU slots: each GPU advertises N slot ids; a replica with TP size k takes k slots.
RESOURCE_GPU: Final = f"{GROUP}/gpu"
#: GPU memory in GiB units per node, for the scheduler and ResourceQuota.
RESOURCE_GPU_MEMORY: Final = f"{GROUP}/gpu-memory"
#: Bytes in one unit of :data:`RESOURCE_GPU_MEMORY`.
GPU_MEMORY_UNIT_BYTES: Final = 2**30
#: Most GPU memory one worker's static part or KV cache may ask for (1 TiB): no GPU has
#: more (the largest today have 288 GB); a bigger size is a typo, refused at apply.
MAX_WORKER_MEMORY_BYTES: Final = 2**40

# --- labels (selectable) ----------------------------------------------------------
LABEL_MODELSERVER: Final = f"{GROUP}/modelserver"
LABEL_REPLICA: Final = f"{GROUP}/replica"
LABEL_TEMPLATE_HASH: Final = f"{GROUP}/template-hash"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
MANAGED_BY: Final = "kvshare-operator"
#: Pods labelled ``kvshare.io/inject: "true"`` get the runtime from the admission webhook.
LABEL_INJECT: Final = f"{GROUP}/inject"

# --- annotations (not selectable) ------------------------------------------------
#: UUIDs of the GPUs a replica was planned onto, comma-separated, in rank order.
ANNOTATION_GPUS: Final = f"{GROUP}/gpus"
#: The node a replica was planned onto (also set as spec.nodeName).
ANNOTATION_NODE: Final = f"{GROUP}/node"
#: The KV-cache policy (kvCache min, max, priority) a pod's pools run under, changed in
#: place by the operator; the node agent applies it to the pod's pools (kvpolicy.py).
ANNOTATION_KV_POLICY: Final = f"{GROUP}/kv-policy"

# --- node agent ------------------------------------------------------------------
#: Directory the node agent shares with model-server pods (broker socket).
RUN_DIR: Final = "/run/kvshare"
BROKER_SOCKET_NAME: Final = "broker.sock"
#: The node agent's own directory: its admin socket and restart file. No pod mounts it
#: (the agent refuses one inside :data:`RUN_DIR`); mode 0700, owned by the agent.
ADMIN_DIR: Final = "/var/lib/kvshare"
ADMIN_SOCKET_NAME: Final = "admin.sock"
STATE_FILE_NAME: Final = "broker.state"
#: The kubelet's PodResources API (``v1.PodResourcesLister``): which devices each
#: container got, by device id.
POD_RESOURCES_SOCKET: Final = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: Where the kubelet and device plugins keep their sockets.
DEVICE_PLUGIN_DIR: Final = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET_NAME: Final = "kubelet.sock"
#: Port of the node agent's Prometheus endpoint.
METRICS_PORT: Final = 9400

# --- operator ----------------------------------------------------------------------
#: Name of the ClusterKopfPeering (or KopfPeering) object operator replicas elect through.
PEERING_NAME: Final = "kvshare"
#: Port of the operator's Prometheus endpoint (/metrics) and health probe (/healthz).
OPERATOR_METRICS_PORT: Final = 8080
#: Port the operator serves its admission webhook on, when enabled.
WEBHOOK_PORT: Final = 9443
#: URL path of the runtime-injection webhook (``https://<service>/inject``).
WEBHOOK_INJECT_PATH: Final = "/inject"
#: Files of the webhook's serving certificate inside ``--webhook-cert-dir``.
WEBHOOK_CERT_FILE: Final = "tls.crt"
WEBHOOK_KEY_FILE: Final = "tls.key"

# --- injected runtime -----------------------------------------------------------
#: Where the image keeps the runtime bundle and where pods mount the copy of it.
RUNTIME_BUNDLE_DIR: Final = "/opt/kvshare/runtime"
RUNTIME_MOUNT_DIR: Final = "/kvshare/runtime"
