"""Request lengths from ShareGPT, the conversations vLLM's serving benchmark replays.

The committed table (:data:`TABLE_PATH`) holds, for each first turn of a ShareGPT
conversation in which a human asks and the assistant answers, the prompt and answer
lengths in tokens under the Llama-3.1 and the Qwen3 tokenizers. Its header says which file
it was read from, where that file is cut off, how many records were read and kept, and
which tokenizers counted; ``tools/sharegpt_lengths.py`` builds it and says how.

:class:`LengthSampler` draws (prompt, output) pairs from it with a seed, optionally within
bounds (:class:`LengthFilter`), in the token counts of the tokenizer a model uses
(:func:`tokenizer_for`).
"""

from __future__ import annotations

import functools
import gzip
import random
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "COLUMNS",
    "TABLE_PATH",
    "TOKENIZERS",
    "VLLM_BENCHMARK_FILTER",
    "LengthFilter",
    "LengthRow",
    "LengthSampler",
    "LengthTable",
    "load_table",
    "tokenizer_for",
]

TABLE_PATH = Path(__file__).resolve().parent / "data" / "sharegpt_lengths.csv.gz"
#: The table's columns: the record's place in the file, then prompt and output tokens.
COLUMNS = ("record", "llama3_prompt", "llama3_output", "qwen3_prompt", "qwen3_output")
#: Tokenizers the table counts with: ``llama3`` (Llama-3.x) and ``qwen3`` (Qwen2.5/Qwen3).
TOKENIZERS = ("llama3", "qwen3")


@dataclass(frozen=True)
class LengthRow:
    """One conversation's first turn: (prompt, output) tokens under each tokenizer."""

    record: int
    llama3: tuple[int, int]
    qwen3: tuple[int, int]

    def lengths(self, tokenizer: str) -> tuple[int, int]:
        """(prompt, output) tokens under ``tokenizer`` (one of :data:`TOKENIZERS`)."""
        if tokenizer == "llama3":
            return self.llama3
        if tokenizer == "qwen3":
            return self.qwen3
        raise ValueError(f"tokenizer {tokenizer!r} is not one of {TOKENIZERS}")


@dataclass(frozen=True)
class LengthTable:
    """The rows of the committed table and the comment lines of its header."""

    rows: tuple[LengthRow, ...]
    header: tuple[str, ...]


@functools.cache
def load_table(path: Path = TABLE_PATH) -> LengthTable:
    """Read the table at ``path`` (cached: the twin samples from it many times)."""
    header: list[str] = []
    rows: list[LengthRow] = []
    with gzip.open(path, "rt", encoding="utf-8") as lines:
        for number, raw in enumerate(lines, start=1):
            line = raw.rstrip("\n")
            if line.startswith("#"):
                header.append(line[1:].strip())
                continue
            if line == ",".join(COLUMNS):
                continue
            try:
                record, lp, lo, qp, qo = (int(field) for field in line.split(","))
            except ValueError as error:
                raise ValueError(f"{path}:{number}: not a row of {COLUMNS}: {line!r}") from error
            rows.append(LengthRow(record, (lp, lo), (qp, qo)))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return LengthTable(tuple(rows), tuple(header))


def tokenizer_for(architecture: str) -> str:
    """The table's tokenizer for a Hugging Face-style architecture name.

    Llama-3.x models share one tokenizer; Qwen2.5 and Qwen3 models share another.
    """
    name = architecture.rsplit("/", 1)[-1].lower()
    if name.startswith(("llama-3", "meta-llama-3", "llama3")):
        return "llama3"
    if name.startswith(("qwen3", "qwen2.5", "qwen2")):
        return "qwen3"
    raise ValueError(
        f"no ShareGPT token counts for {architecture!r}: the table counts with the "
        "Llama-3 and Qwen2.5/Qwen3 tokenizers"
    )


@dataclass(frozen=True)
class LengthFilter:
    """Bounds a drawn pair must meet, in tokens (None: no bound)."""

    min_prompt: int = 1
    max_prompt: int | None = None
    max_total: int | None = None

    def admits(self, prompt: int, output: int) -> bool:
        """Whether (``prompt``, ``output``) is within the bounds."""
        if prompt < self.min_prompt:
            return False
        if self.max_prompt is not None and prompt > self.max_prompt:
            return False
        return self.max_total is None or prompt + output <= self.max_total


#: The bounds vLLM's serving benchmark puts on ShareGPT pairs (prompt of at most 1,024
#: tokens, prompt and output together at most 2,048; both at least 4, which the table
#: already holds): the chat traffic every family but the long-context one draws.
VLLM_BENCHMARK_FILTER = LengthFilter(min_prompt=4, max_prompt=1024, max_total=2048)


class LengthSampler:
    """Seeded draws of (prompt, output) tokens from the table's pairs within a filter."""

    def __init__(
        self,
        tokenizer: str,
        *,
        seed: int,
        length_filter: LengthFilter = LengthFilter(),
        table: LengthTable | None = None,
    ) -> None:
        rows = (table or load_table()).rows
        self.pairs: tuple[tuple[int, int], ...] = tuple(
            pair for pair in (row.lengths(tokenizer) for row in rows) if length_filter.admits(*pair)
        )
        if not self.pairs:
            raise ValueError(f"no ShareGPT pair under {tokenizer} meets {length_filter}")
        self._rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.pairs)

    def sample(self) -> tuple[int, int]:
        """One (prompt tokens, output tokens) pair, drawn uniformly from the admitted ones."""
        return self.pairs[self._rng.randrange(len(self.pairs))]
