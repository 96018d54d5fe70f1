"""Workload files: what is saved loads back equal, and every bad file is refused with its
file, line and what to change, loading nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshare.twin import families, workload_files
from kvshare.twin.workload import ModelSpec, Slo, TwinRequest, Workload
from kvshare.twin.workload_files import WorkloadFileError, load_workload, save_workload

GOOD_YAML = """\
name: pair
gpu: h100_sxm
duration_s: 10
models:
  - name: chat
    architecture: meta-llama/Llama-3.1-8B
  - name: code
    architecture: Qwen/Qwen3-8B
    engine: sglang
    block_tokens: 64
"""
GOOD_CSV = """\
arrival_s,model,prompt_tokens,output_tokens
0.5,chat,100,20
1.25,code,2000,8
"""


def _write(tmp_path: Path, yaml_text: str = GOOD_YAML, csv_text: str = GOOD_CSV) -> Path:
    (tmp_path / "w.csv").write_text(csv_text, encoding="utf-8")
    (tmp_path / "w.yaml").write_text(yaml_text, encoding="utf-8")
    return tmp_path / "w.yaml"


def test_a_good_pair_of_files_loads_with_defaults(tmp_path: Path) -> None:
    workload = load_workload(_write(tmp_path))
    assert workload.name == "pair" and workload.gpu == "h100_sxm"
    assert workload.slo == Slo()
    assert workload.model("code") == ModelSpec(
        "code", "Qwen/Qwen3-8B", engine="sglang", block_tokens=64
    )
    assert workload.requests == (
        TwinRequest(0.5, "chat", 100, 20),
        TwinRequest(1.25, "code", 2000, 8),
    )
    assert workload.source == "files w.yaml and w.csv"


def test_a_saved_workload_loads_back_equal(tmp_path: Path) -> None:
    models = (
        ModelSpec("a", "meta-llama/Llama-3.1-8B", tensor_parallel=2, block_tokens=16),
        ModelSpec('b,odd "name"', "Qwen/Qwen3-1.7B", engine="sglang"),
    )
    requests = tuple(
        TwinRequest(i * 0.1 + 1e-9 * i, models[i % 2].name, 50 + i, 1 + i % 5, i % 7)
        for i in range(300)
    )
    workload = Workload(
        "odd", "l40s", models, requests, 31.7, Slo(1.5, 80.0, 0.9), seed=11, source=""
    )
    yaml_path, csv_path = save_workload(workload, tmp_path)
    assert load_workload(yaml_path) == workload
    assert csv_path.read_text().splitlines()[0] == ",".join(workload_files.CSV_COLUMNS)


@pytest.mark.parametrize("family", families.FAMILIES)
def test_every_generated_family_round_trips_exactly(tmp_path: Path, family: str) -> None:
    workload = families.generate(family, seed=2, model_class="small", duration_s=60)
    yaml_path, csv_path = save_workload(workload, tmp_path)
    assert load_workload(yaml_path) == workload
    # No family sets shared prefixes, so the optional column is left out.
    assert csv_path.read_text().splitlines()[0] == "arrival_s,model,prompt_tokens,output_tokens"


WITH_PREFIX = "arrival_s,model,prompt_tokens,output_tokens,prefix_tokens\n0.5,chat,100,20,0\n"
BAD_CSV = [
    ("arrival_s,model,prompt\n", 1, "header is"),
    ("", 1, "is empty"),
    (GOOD_CSV + "2.0,chat,100\n", 4, "has 3 fields"),
    (GOOD_CSV + "2.0,nobody,100,10\n", 4, "model 'nobody' is not in the YAML"),
    (GOOD_CSV + "1.0,chat,100,10\n", 4, "sort by arrival_s"),
    (GOOD_CSV + "nan,chat,100,10\n", 4, "arrival_s 'nan'"),
    (GOOD_CSV + "-1,chat,100,10\n", 4, "arrival_s '-1'"),
    (GOOD_CSV + "2,chat,-5,10\n", 4, "prompt_tokens '-5'"),
    (GOOD_CSV + "2,chat,1.5,10\n", 4, "prompt_tokens '1.5'"),
    (GOOD_CSV + "2,chat,100,0\n", 4, "must be >= 1"),
    (GOOD_CSV + "2,chat,900000,900000\n", 4, "exceed"),
    (GOOD_CSV + "700000,chat,10,10\n", 4, "a week"),
    (WITH_PREFIX.replace(",20,0\n", ",20,200\n"), 2, "prefix_tokens is part of the prompt"),
    (GOOD_CSV + '2,"chat,10,10\n', 4, "fields|CSV"),
]  # fmt: skip


@pytest.mark.parametrize(("csv_text", "line", "problem"), BAD_CSV)
def test_a_bad_csv_row_is_refused_with_its_line(
    tmp_path: Path, csv_text: str, line: int, problem: str
) -> None:
    yaml_path = _write(tmp_path, csv_text=csv_text)
    with pytest.raises(WorkloadFileError, match=problem) as refused:
        load_workload(yaml_path)
    assert refused.value.path == tmp_path / "w.csv"
    assert refused.value.line == line
    assert str(refused.value).startswith(f"{tmp_path / 'w.csv'}:{line}: ")


BAD_YAML = [
    (GOOD_YAML + "colour: blue\n", 11, "unknown key 'colour'"),
    (GOOD_YAML + "gpu: a100_sxm\n", 11, "gpu is given twice"),
    (GOOD_YAML.replace("h100_sxm", "h300_sxm"), 2, "'h300_sxm' is not one of"),
    # AIConfigurator has kernel data for it, the twin no memory figures or step tables.
    (GOOD_YAML.replace("h100_sxm", "b300_sxm"), 2, "'b300_sxm' is not one of"),
    (GOOD_YAML.replace("duration_s: 10", "duration_s: 1"), 3, "ends before the last arrival"),
    (GOOD_YAML.replace("duration_s: 10", "duration_s: .nan"), 3, "must be a number"),
    (GOOD_YAML.replace("duration_s: 10", "duration_s: [10]"), 3, "single value"),
    (GOOD_YAML.replace("engine: sglang", "engine: trt"), 7, "engine must be vllm or sglang"),
    (GOOD_YAML.replace("block_tokens: 64", "block_tokens: true"), 10, "whole number"),
    (GOOD_YAML.replace("block_tokens: 64", "block_tokens: 0"), 10, "between 1 and 4096"),
    (GOOD_YAML.replace("block_tokens: 64", "flavour: mint"), 10, "unknown key 'flavour'"),
    (GOOD_YAML.replace("Qwen/Qwen3-8B", "qwen3"), 7, "Hugging Face-style"),
    (GOOD_YAML.replace("name: code", "name: chat"), 7, "listed twice"),
    (GOOD_YAML.replace("  - name: code\n", "  - tensor_parallel: 1\n"), 7, "has no name"),
    ("name: x\nduration_s: 3\n", 1, "lists no models"),
    ("name: x\nmodels: []\n", 2, "1-256 models"),
    ("- just\n- a list\n", 1, "must be a mapping"),
    ("a: &x [1]\nb: *x\n", 2, "aliases"),
    ("name: [unclosed\n", 2, "not valid YAML"),
    (GOOD_YAML + "slo: {ttft_p99_s: 0}\n", 11, "between"),
    (GOOD_YAML + "slo: {p50: 1}\n", 11, "unknown key 'p50' in slo"),
    (GOOD_YAML + "seed: -1\n", 11, "between 0"),
    (GOOD_YAML + "requests: ../../etc/passwd\n", 11, "beside the YAML"),
]  # fmt: skip


@pytest.mark.parametrize(("yaml_text", "line", "problem"), BAD_YAML)
def test_a_bad_yaml_value_is_refused_with_its_line(
    tmp_path: Path, yaml_text: str, line: int, problem: str
) -> None:
    yaml_path = _write(tmp_path, yaml_text=yaml_text)
    with pytest.raises(WorkloadFileError, match=problem) as refused:
        load_workload(yaml_path)
    assert refused.value.path == yaml_path
    assert refused.value.line == line


def test_an_empty_or_non_utf8_or_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WorkloadFileError, match="is empty"):
        load_workload(_write(tmp_path, yaml_text="# nothing\n", csv_text=GOOD_CSV))
    (tmp_path / "w.yaml").write_text(GOOD_YAML, encoding="utf-8")
    (tmp_path / "w.csv").write_bytes(GOOD_CSV.encode() + b"2,chat,1\xff,1\n")
    with pytest.raises(WorkloadFileError, match="not UTF-8") as refused:
        load_workload(tmp_path / "w.yaml")
    assert refused.value.line == 4
    with pytest.raises(WorkloadFileError, match="cannot be read"):
        load_workload(tmp_path / "absent.yaml")


def test_files_over_the_size_and_row_bounds_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    yaml_path = _write(tmp_path)
    monkeypatch.setattr(workload_files, "MAX_CSV_BYTES", 40)
    with pytest.raises(WorkloadFileError, match="larger than 40 bytes"):
        load_workload(yaml_path)
    monkeypatch.setattr(workload_files, "MAX_CSV_BYTES", 1 << 20)
    monkeypatch.setattr(workload_files, "MAX_ROWS", 1)
    with pytest.raises(WorkloadFileError, match="more than 1 requests") as refused:
        load_workload(yaml_path)
    assert refused.value.line == 3
    monkeypatch.setattr(workload_files, "MAX_YAML_BYTES", 10)
    with pytest.raises(WorkloadFileError, match="larger than 10 bytes"):
        load_workload(yaml_path)


def test_a_csv_given_apart_from_the_yaml_is_used(tmp_path: Path) -> None:
    yaml_path = _write(tmp_path)
    other = tmp_path / "other.csv"
    other.write_text("arrival_s,model,prompt_tokens,output_tokens\n3,chat,7,7\n", encoding="utf-8")
    assert load_workload(yaml_path, other).requests == (TwinRequest(3.0, "chat", 7, 7),)


def test_a_workload_without_duration_lasts_until_its_last_arrival(tmp_path: Path) -> None:
    workload = load_workload(_write(tmp_path, GOOD_YAML.replace("duration_s: 10\n", "")))
    assert workload.duration_s == 1.25
    header_only = "arrival_s,model,prompt_tokens,output_tokens\n"
    yaml_text = GOOD_YAML.replace("duration_s: 10\n", "")
    with pytest.raises(WorkloadFileError, match="give duration_s"):
        load_workload(_write(tmp_path, yaml_text, header_only))
