"""A workload as two files a user brings: a CSV of requests and a YAML of models and SLO.

The format is documented in ``docs/workloads.md``. In short, the YAML::

    name: my-fleet                 # optional; default: the YAML file's stem
    gpu: h200_sxm                  # optional; one of KNOWN_GPUS
    duration_s: 300                # optional; default: the last arrival
    seed: 0                        # optional; fixes the copies load scaling adds
    source: what this is           # optional free text, kept for reports
    requests: my-fleet.csv         # optional; default: the YAML's stem + .csv, beside it
    slo: {ttft_p99_s: 2.0, tpot_p99_ms: 100, min_attainment: 0.95}   # optional
    models:
      - name: chat
        architecture: meta-llama/Llama-3.1-8B
        tensor_parallel: 1         # optional
        engine: vllm               # optional: vllm or sglang
        block_tokens: 16           # optional

and the CSV, sorted by arrival, with a header row::

    arrival_s,model,prompt_tokens,output_tokens[,prefix_tokens]

Both files are untrusted: sizes are bounded (:data:`MAX_CSV_BYTES`, :data:`MAX_YAML_BYTES`,
:data:`MAX_ROWS`, :data:`MAX_MODELS`, :data:`MAX_REQUEST_TOKENS`), unknown YAML keys,
duplicate keys and YAML aliases are refused, and every bad value is refused with its file,
line and what to change (:class:`WorkloadFileError`). Nothing is returned until both files
have been read whole and checked: a refusal leaves nothing half loaded.
:func:`save_workload` writes the same format; loading what it wrote gives back an equal
:class:`~kvshare.twin.workload.Workload`.
"""

from __future__ import annotations

import csv
import io
import math
import re
from pathlib import Path
from typing import Any

import yaml

from kvshare.twin.gpus import gpu_kinds
from kvshare.twin.workload import ModelSpec, Slo, TwinRequest, Workload, WorkloadError

__all__ = [
    "CSV_COLUMNS",
    "KNOWN_GPUS",
    "MAX_CSV_BYTES",
    "MAX_MODELS",
    "MAX_REQUEST_TOKENS",
    "MAX_ROWS",
    "MAX_YAML_BYTES",
    "WorkloadFileError",
    "load_workload",
    "save_workload",
]

#: GPU kinds a workload may name: the twin's (:func:`kvshare.twin.gpus.gpu_kinds`, whose
#: memory, compute and step tables come from NVIDIA's AIConfigurator).
KNOWN_GPUS: tuple[str, ...] = tuple(gpu_kinds())
CSV_COLUMNS = ("arrival_s", "model", "prompt_tokens", "output_tokens", "prefix_tokens")
MAX_CSV_BYTES = 64 * 1024 * 1024
MAX_YAML_BYTES = 1024 * 1024
MAX_ROWS = 1_000_000
MAX_MODELS = 256
#: Prompt plus output tokens of one request (above any context window the twin models).
MAX_REQUEST_TOKENS = 1 << 20
#: Latest arrival accepted, in seconds (a week).
MAX_ARRIVAL_S = 7 * 24 * 3600.0
_DIGITS = re.compile(r"[0-9]{1,9}")
_DECIMAL = re.compile(r"[0-9]{1,9}(\.[0-9]{1,24})?([eE][-+]?[0-9]{1,3})?")
_TOP_KEYS = ("name", "gpu", "duration_s", "seed", "source", "requests", "slo", "models")
_SLO_KEYS = ("ttft_p99_s", "tpot_p99_ms", "min_attainment")
_MODEL_KEYS = ("name", "architecture", "tensor_parallel", "engine", "block_tokens")


class WorkloadFileError(WorkloadError):
    """A workload file that cannot be loaded: its path, the line, and what to change."""

    def __init__(self, path: Path, line: int | None, problem: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {problem}")
        self.path = path
        self.line = line


def _read_bounded(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except OSError as error:
        raise WorkloadFileError(path, None, f"cannot be read ({error.strerror})") from error
    if len(data) > limit:
        raise WorkloadFileError(path, None, f"is larger than {limit} bytes; split the workload")
    return data


def _text(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise WorkloadFileError(path, line, "is not UTF-8 text; save it as UTF-8") from error


# -- YAML ---------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing aliases (a few lines of them can expand to gigabytes)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            raise yaml.MarkedYAMLError(
                problem="YAML aliases (*name) are not accepted; write the value out",
                problem_mark=mark,
            )
        return super().compose_node(parent, index)


class _Node:
    """A YAML node with the file and line it came from, read with checked types."""

    def __init__(self, path: Path, node: yaml.Node, loader: _StrictLoader) -> None:
        self.path, self.node, self._loader = path, node, loader
        self.line = node.start_mark.line + 1

    def fail(self, problem: str) -> WorkloadFileError:
        return WorkloadFileError(self.path, self.line, problem)

    def mapping(self, what: str, allowed: tuple[str, ...]) -> dict[str, _Node]:
        if not isinstance(self.node, yaml.MappingNode):
            raise self.fail(f"{what} must be a mapping of {', '.join(allowed)}")
        found: dict[str, _Node] = {}
        for key_node, value_node in self.node.value:
            key = _Node(self.path, key_node, self._loader)
            if not isinstance(key_node, yaml.ScalarNode) or key_node.value not in allowed:
                raise key.fail(
                    f"unknown key {key_node.value!r} in {what}; the keys are {', '.join(allowed)}"
                )
            if key_node.value in found:
                raise key.fail(f"{key_node.value} is given twice in {what}; keep one")
            found[key_node.value] = _Node(self.path, value_node, self._loader)
        return found

    def sequence(self, what: str) -> list[_Node]:
        if not isinstance(self.node, yaml.SequenceNode):
            raise self.fail(f"{what} must be a list")
        return [_Node(self.path, item, self._loader) for item in self.node.value]

    def scalar(self) -> Any:
        if not isinstance(self.node, yaml.ScalarNode):
            raise self.fail("expected a single value here, not a list or mapping")
        return self._loader.construct_object(self.node)

    def text(self, what: str, limit: int = 256) -> str:
        value = self.scalar()
        if not isinstance(value, str) or not value or len(value) > limit:
            raise self.fail(f"{what} must be text of 1-{limit} characters, not {value!r}")
        if not value.isprintable():
            raise self.fail(f"{what} must be printable text on one line")
        return value

    def number(self, what: str, *, low: float, high: float, integer: bool = False) -> float:
        raw = self.scalar()
        wrong_kind = integer and not isinstance(raw, int)
        value: float | None = None
        if isinstance(raw, int | float) and not isinstance(raw, bool) and not wrong_kind:
            value = float(raw)
        if value is None or not math.isfinite(value):
            kind = "a whole number" if integer else "a number"
            raise self.fail(f"{what} must be {kind}, not {self.node.value!r}")
        if not low <= value <= high:
            raise self.fail(f"{what} must be between {low:g} and {high:g}, not {value!r}")
        return value


def _yaml_root(path: Path) -> tuple[_Node, dict[str, _Node]]:
    text = _text(path, _read_bounded(path, MAX_YAML_BYTES))
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = mark.line + 1 if mark is not None else None
        raise WorkloadFileError(path, line, f"is not valid YAML: {error.problem}") from error
    except yaml.YAMLError as error:
        raise WorkloadFileError(path, None, f"is not valid YAML: {error}") from error
    finally:
        loader.dispose()
    if node is None:
        raise WorkloadFileError(path, None, "is empty; give at least models")
    root = _Node(path, node, loader)
    return root, root.mapping("the workload", _TOP_KEYS)


def _models(node: _Node) -> tuple[ModelSpec, ...]:
    items = node.sequence("models")
    if not items or len(items) > MAX_MODELS:
        raise node.fail(f"models must list 1-{MAX_MODELS} models")
    models = []
    seen: set[str] = set()
    for item in items:
        keys = item.mapping("a model", _MODEL_KEYS)
        for required in ("name", "architecture"):
            if required not in keys:
                raise item.fail(f"this model has no {required}")
        name = keys["name"].text("the model name", 128)
        if name in seen:
            raise keys["name"].fail(f"model {name!r} is listed twice; give each model once")
        seen.add(name)
        tensor_parallel = keys.get("tensor_parallel")
        engine = keys.get("engine")
        block = keys.get("block_tokens")
        architecture = keys["architecture"].text("architecture")
        try:
            models.append(
                ModelSpec(
                    name=name,
                    architecture=architecture,
                    tensor_parallel=int(
                        tensor_parallel.number("tensor_parallel", low=1, high=64, integer=True)
                    )
                    if tensor_parallel is not None
                    else 1,
                    engine=engine.text("engine") if engine is not None else "vllm",
                    block_tokens=int(block.number("block_tokens", low=1, high=4096, integer=True))
                    if block is not None
                    else None,
                )
            )
        except WorkloadFileError:
            raise
        except WorkloadError as error:
            raise item.fail(str(error)) from error
    return tuple(models)


def _slo(node: _Node) -> Slo:
    keys = node.mapping("slo", _SLO_KEYS)
    values = {
        "ttft_p99_s": keys["ttft_p99_s"].number("ttft_p99_s", low=1e-3, high=3600)
        if "ttft_p99_s" in keys
        else Slo.ttft_p99_s,
        "tpot_p99_ms": keys["tpot_p99_ms"].number("tpot_p99_ms", low=1e-3, high=60_000)
        if "tpot_p99_ms" in keys
        else Slo.tpot_p99_ms,
        "min_attainment": keys["min_attainment"].number("min_attainment", low=1e-6, high=1)
        if "min_attainment" in keys
        else Slo.min_attainment,
    }
    return Slo(**{key: float(value) for key, value in values.items()})


def _source(node: _Node) -> str:
    value = node.scalar()
    if not isinstance(value, str) or len(value) > 1024 or not value.isprintable():
        raise node.fail("source must be printable text of at most 1024 characters on one line")
    return value


# -- CSV ----------------------------------------------------------------------------------


def _count(path: Path, line: int, column: str, raw: str) -> int:
    if not _DIGITS.fullmatch(raw):
        raise WorkloadFileError(path, line, f"{column} {raw!r} is not a whole number >= 0")
    return int(raw)


def _seconds(path: Path, line: int, raw: str) -> float:
    if not _DECIMAL.fullmatch(raw):
        raise WorkloadFileError(path, line, f"arrival_s {raw!r} is not a plain number >= 0")
    return float(raw)


def _requests(path: Path, models: set[str]) -> tuple[TwinRequest, ...]:
    text = _text(path, _read_bounded(path, MAX_CSV_BYTES))
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader, None)
        if header is None:
            raise WorkloadFileError(path, 1, f"is empty; start with the header {CSV_COLUMNS[:4]}")
        width = len(header)
        if tuple(header) not in (CSV_COLUMNS[:4], CSV_COLUMNS):
            raise WorkloadFileError(
                path,
                1,
                f"header is {','.join(header)}; write {','.join(CSV_COLUMNS[:4])} "
                f"(and optionally ,{CSV_COLUMNS[4]})",
            )
        requests: list[TwinRequest] = []
        previous = 0.0
        for row in reader:
            line = reader.line_num
            if len(requests) >= MAX_ROWS:
                raise WorkloadFileError(path, line, f"has more than {MAX_ROWS} requests")
            if len(row) != width:
                raise WorkloadFileError(
                    path, line, f"has {len(row)} fields; every row needs {width}, like the header"
                )
            arrival = _seconds(path, line, row[0])
            if arrival > MAX_ARRIVAL_S:
                raise WorkloadFileError(
                    path, line, f"arrival_s {row[0]} is past {MAX_ARRIVAL_S:g} s (a week)"
                )
            if arrival < previous:
                raise WorkloadFileError(
                    path, line, f"arrival_s {row[0]} is before the row above; sort by arrival_s"
                )
            previous = arrival
            if row[1] not in models:
                raise WorkloadFileError(
                    path, line, f"model {row[1]!r} is not in the YAML's models {sorted(models)}"
                )
            prompt = _count(path, line, "prompt_tokens", row[2])
            output = _count(path, line, "output_tokens", row[3])
            prefix = _count(path, line, "prefix_tokens", row[4]) if width == 5 else 0
            if prompt < 1 or output < 1:
                raise WorkloadFileError(path, line, "prompt_tokens and output_tokens must be >= 1")
            if prompt + output > MAX_REQUEST_TOKENS:
                raise WorkloadFileError(
                    path, line, f"prompt + output tokens exceed {MAX_REQUEST_TOKENS}"
                )
            if prefix > prompt:
                raise WorkloadFileError(
                    path, line, "prefix_tokens is part of the prompt: make it <= prompt_tokens"
                )
            requests.append(TwinRequest(arrival, row[1], prompt, output, prefix))
    except csv.Error as error:
        raise WorkloadFileError(path, reader.line_num, f"is not valid CSV: {error}") from error
    return tuple(requests)


# -- load and save -----------------------------------------------------------------------


def load_workload(yaml_path: Path, csv_path: Path | None = None) -> Workload:
    """Load the workload a YAML file describes, with the requests of its CSV.

    ``csv_path`` overrides the YAML's ``requests``. Raises :class:`WorkloadFileError` for
    anything that cannot be run, naming the file and line.
    """
    root, keys = _yaml_root(yaml_path)
    if "models" not in keys:
        raise root.fail("the workload lists no models; add models: with at least one")
    models = _models(keys["models"])
    name = keys["name"].text("name", 128) if "name" in keys else yaml_path.stem
    gpu = keys["gpu"].text("gpu") if "gpu" in keys else "h200_sxm"
    if gpu not in KNOWN_GPUS:
        raise keys["gpu"].fail(f"gpu {gpu!r} is not one of {', '.join(KNOWN_GPUS)}")
    if csv_path is None:
        listed = keys["requests"].text("requests") if "requests" in keys else None
        if listed is not None and (Path(listed).is_absolute() or ".." in Path(listed).parts):
            raise keys["requests"].fail("requests must name a file beside the YAML")
        csv_path = yaml_path.with_name(listed or f"{yaml_path.stem}.csv")
    requests = _requests(csv_path, {model.name for model in models})
    last = requests[-1].arrival_s if requests else 0.0
    if "duration_s" in keys:
        duration = float(keys["duration_s"].number("duration_s", low=1e-3, high=MAX_ARRIVAL_S))
        if duration < last:
            raise keys["duration_s"].fail(
                f"duration_s {duration:g} ends before the last arrival ({last:g} s); raise it"
            )
    elif last > 0:
        duration = last
    else:
        raise root.fail("give duration_s: the requests do not say how long the workload lasts")
    seed = (
        int(keys["seed"].number("seed", low=0, high=2**31, integer=True)) if "seed" in keys else 0
    )
    source = (
        _source(keys["source"])
        if "source" in keys
        else f"files {yaml_path.name} and {csv_path.name}"
    )
    slo = _slo(keys["slo"]) if "slo" in keys else Slo()
    try:
        return Workload(name, gpu, models, requests, duration, slo, seed, source)
    except WorkloadError as error:
        raise WorkloadFileError(yaml_path, None, str(error)) from error


def save_workload(
    workload: Workload, directory: Path, stem: str | None = None
) -> tuple[Path, Path]:
    """Write ``workload`` as ``<stem>.yaml`` and ``<stem>.csv`` in ``directory`` (stem:
    the workload's name); returns both paths. Floats are written so they read back exactly.
    """
    stem = stem or workload.name
    directory.mkdir(parents=True, exist_ok=True)
    yaml_path, csv_path = directory / f"{stem}.yaml", directory / f"{stem}.csv"
    models = []
    for model in workload.models:
        entry: dict[str, Any] = {"name": model.name, "architecture": model.architecture}
        if model.tensor_parallel != 1:
            entry["tensor_parallel"] = model.tensor_parallel
        if model.engine != "vllm":
            entry["engine"] = model.engine
        if model.block_tokens is not None:
            entry["block_tokens"] = model.block_tokens
        models.append(entry)
    document = {
        "name": workload.name,
        "gpu": workload.gpu,
        "duration_s": workload.duration_s,
        "seed": workload.seed,
        "source": workload.source,
        "requests": csv_path.name,
        "slo": {key: getattr(workload.slo, key) for key in _SLO_KEYS},
        "models": models,
    }
    with_prefix = any(request.prefix_tokens for request in workload.requests)
    columns = CSV_COLUMNS if with_prefix else CSV_COLUMNS[:4]
    buffer = io.StringIO(newline="")
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for request in workload.requests:
        row = [repr(request.arrival_s), request.model, request.prompt_tokens, request.output_tokens]
        writer.writerow([*row, request.prefix_tokens] if with_prefix else row)
    yaml_path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    csv_path.write_text(buffer.getvalue(), encoding="utf-8")
    return yaml_path, csv_path
