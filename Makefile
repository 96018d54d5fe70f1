# kvshare developer entry points. `make demo` and `make test` set everything up themselves:
# a virtualenv in .venv with pinned dependencies (requirements/dev.lock), generated code,
# and the tools the tests use. Nothing needs to be installed by hand.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
LOCK   := requirements/dev.lock
# Each install set is recorded by a stamp, so a target installs only what it needs.
DEV_STAMP  := $(VENV)/.dev-installed
DEMO_STAMP := $(VENV)/.demo-installed
PROTOC_STAMP := $(VENV)/.protoc-installed
# The kubelet API stubs (device plugin, PodResources), generated from the .protos (never
# committed).
PROTO_DIR   := src/kvshare/deviceplugin/kubelet/v1beta1
PODRES_DIR  := src/kvshare/deviceplugin/kubelet/podresources/v1
PROTO_STUBS := $(PROTO_DIR)/api_pb2.py $(PODRES_DIR)/api_pb2.py
# Tools the chart tests run, unpacked once into a git-ignored folder (cached wheels too).
TOOLS := .tools
HELM  := $(TOOLS)/bin/helm
CHART := charts/kvshare

.PHONY: help venv proto engines test lint format bench demo gpu-check docs clean tools prometheus crds rbac dashboard runtime-bundle

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -e 's/:.*## /\t/'

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

$(DEV_STAMP): pyproject.toml $(LOCK) | $(PY)
	$(PIP) -c $(LOCK) -e '.[dev]'
	touch $@

$(DEMO_STAMP): pyproject.toml $(LOCK) | $(PY)
	$(PIP) -c $(LOCK) -e '.[runtime,node,demo]'
	touch $@

venv: $(DEV_STAMP)  ## create .venv with everything needed to develop

# Only grpcio-tools is needed to generate the stubs (so `make demo` installs no dev tools).
$(PROTOC_STAMP): $(LOCK) | $(PY)
	$(PIP) -c $(LOCK) grpcio-tools
	touch $@

$(PROTO_STUBS) &: $(PROTO_DIR)/api.proto $(PODRES_DIR)/api.proto src/kvshare/deviceplugin/kubelet/protogen.py $(PROTOC_STAMP)
	PYTHONPATH=src $(PY) -m kvshare.deviceplugin.kubelet.protogen

proto: $(PROTO_STUBS)  ## generate the kubelet API stubs (device plugin, PodResources) from the .protos

$(HELM): tools/fetch_helm.py | $(PY)
	$(PY) tools/fetch_helm.py --dest $@ --cache $(TOOLS)/cache

prometheus:  ## Prometheus + promtool from Debian's package (apt-get, as root; idempotent)
	@bash tools/install-prometheus.sh

tools: $(HELM) prometheus  ## the binaries the chart tests run: helm, prometheus, promtool

engines: $(DEV_STAMP)  ## install the pinned vLLM/SGLang test and serving environments into .engines/
	$(PY) -m tools.engine_env build
	$(PY) tools/serving_env.py build

test: $(DEV_STAMP) $(PROTO_STUBS) tools engines  ## run the test suite
	$(PY) -m pytest

lint: $(DEV_STAMP) $(PROTO_STUBS)  ## ruff (lint + format check) and mypy
	$(VENV)/bin/ruff check src tests bench tools
	$(VENV)/bin/ruff format --check src tests bench tools
	$(VENV)/bin/mypy

format: $(DEV_STAMP)  ## apply ruff's fixes and formatting
	$(VENV)/bin/ruff check --fix src tests bench tools
	$(VENV)/bin/ruff format src tests bench tools

bench: $(DEV_STAMP) $(PROTO_STUBS) engines  ## run every benchmark and rewrite BENCHMARKS.md
	$(PY) bench/run.py --all --write BENCHMARKS.md

demo: $(DEMO_STAMP) $(PROTO_STUBS)  ## static partitions vs elastic KV caches here (no GPU, no cluster)
	$(VENV)/bin/kvshare demo

# The GPU check runs with the GPU machine's own Python and its CUDA build of PyTorch (the
# dev venv pins a CPU build); kvshare itself comes from src/. `make gpu-check --dry-run`
# (or -n) runs every check without a GPU, in the dev venv, on the host backend: make's own
# dry run would only print the command, so the recipe is marked to run (+) and told.
GPU_PYTHON ?= python3
GPU_CHECK_DRY := $(findstring n,$(firstword -$(MAKEFLAGS)))
GPU_CHECK_ARGS ?=
gpu-check:  ## on an NVIDIA GPU machine with PyTorch (--dry-run: without one)
	+PYTHONPATH=src $(if $(GPU_CHECK_DRY),$(PY) bench/gpu_check.py --dry-run,$(GPU_PYTHON) \
		bench/gpu_check.py --write BENCHMARKS.md) $(GPU_CHECK_ARGS)

docs: $(DEV_STAMP)  ## regenerate the generated tables in docs/
	$(PY) tools/update_docs.py

crds: $(DEV_STAMP)  ## write the chart's CRDs from kvshare.api (the one source)
	$(VENV)/bin/kvshare crds > $(CHART)/crds/kvshare.io.yaml

rbac: $(DEV_STAMP)  ## write the chart's RBAC rules from the programs' lists of API calls
	$(PY) tools/chart_rbac.py

dashboard: $(DEV_STAMP)  ## write the chart's Grafana dashboard from tools/dashboard.py
	$(PY) tools/dashboard.py > $(CHART)/dashboards/kvshare.json

runtime-bundle: $(DEV_STAMP)  ## build the injected runtime into out/runtime (as the image does)
	$(PY) tools/runtime_bundle.py --out out/runtime --wheelhouse $(TOOLS)/wheels \
		--python-versions $(shell $(PY) -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')

clean:  ## remove the virtualenv and caches
	rm -rf $(VENV) $(TOOLS) .engines out .pytest_cache .mypy_cache .ruff_cache .hypothesis
