# syntax=docker/dockerfile:1.7
# One image for all of kvshare: `kvshare operator` (the chart's Deployment), `kvshare node`
# (the chart's DaemonSet), and the runtime bundle at /opt/kvshare/runtime that the operator's
# init container copies into model-server pods.
#
#   docker build -t ghcr.io/kvshare/kvshare:0.1.0 .
#
# Base pinned to an exact release; set PYTHON_IMAGE to a digest to pin it byte for byte.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/dev.lock requirements/dev.lock
COPY src/ src/
COPY tools/runtime_bundle.py tools/runtime_bundle.py
# The kubelet device plugin API stubs are generated from the .proto, never committed: with
# grpcio-tools in a throwaway virtualenv, before the package is built.
RUN python -m venv /tmp/protoc \
    && /tmp/protoc/bin/pip install --no-cache-dir --disable-pip-version-check \
        --constraint requirements/dev.lock grpcio-tools \
    && PYTHONPATH=src /tmp/protoc/bin/python -m kvshare.deviceplugin.kubelet.protogen \
    && rm -rf /tmp/protoc
# The node agent and the operator with their dependencies, at the versions the tests ran
# (the lock constrains them), in a virtualenv the final stage copies whole.
RUN python -m venv /opt/kvshare/venv \
    && /opt/kvshare/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        --constraint requirements/dev.lock ".[node,operator]"
# The runtime for injection: the kvshare modules it needs (stdlib-only apart from torch,
# numpy and cuda-python) and cuda-python's driver bindings for CPython 3.10 to 3.13.
RUN python tools/runtime_bundle.py --out /opt/kvshare/runtime --wheelhouse /tmp/wheels \
        --python-versions 3.10,3.11,3.12,3.13

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="kvshare" \
      org.opencontainers.image.description="Elastic GPU memory sharing for LLM model servers on Kubernetes: operator, node agent and injected runtime" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/kvshare/kvshare" \
      org.opencontainers.image.url="https://github.com/kvshare/kvshare" \
      org.opencontainers.image.documentation="https://github.com/kvshare/kvshare#readme" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="kvshare"
COPY --from=build /opt/kvshare/venv /opt/kvshare/venv
COPY --from=build /opt/kvshare/runtime /opt/kvshare/runtime
ENV PATH="/opt/kvshare/venv/bin:${PATH}" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Non-root by default (the operator runs as is); the chart runs the node agent as uid 0
# only because the kubelet's device-plugin folder belongs to root.
USER 65532:65532
ENTRYPOINT ["kvshare"]
CMD ["--help"]
