"""The live view: redrawn in place on a terminal, periodic plain lines otherwise."""

from __future__ import annotations

import io

from kvshare.demo.stats import Mode, Sample
from kvshare.demo.view import LiveView, render_frame

GIB = 2**30


def sample(held: int, served: int, waiting: int) -> Sample:
    return Sample(
        t=1.0,
        served=served,
        arrived=served + waiting,
        waiting=waiting,
        running=1,
        held=held,
        used=held,
        lease=held,
        lease_peak=held,
        preemptions=0,
        reclaims=0,
    )


LATEST: dict[tuple[Mode, int], Sample] = {
    ("static", 0): sample(GIB, 10, 5),
    ("static", 1): sample(GIB, 3, 0),
    ("elastic", 0): sample(3 * GIB, 15, 0),
}


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_frame_shows_progress_and_every_model_in_both_runs() -> None:
    lines = render_frame(10.0, 40.0, gpu_bytes=4 * GIB, models=3, latest=LATEST, footer=["end"])
    text = "\n".join(lines)
    assert "10.0 s of 40 s" in text
    assert "static partitions" in text and "elastic (kvshare)" in text
    row0 = next(line for line in lines if line.startswith("model-0"))
    assert "10" in row0 and "1.00 GiB" in row0 and "3.00 GiB" in row0
    row2 = next(line for line in lines if line.startswith("model-2"))
    assert row2.count("starting") == 2
    total = next(line for line in lines if line.startswith("total"))
    assert "2.00 GiB" in total  # static: 1 + 1 GiB
    assert lines[-1] == "end"


def test_on_a_terminal_each_frame_replaces_the_last() -> None:
    out = FakeTty()
    view = LiveView(out, duration_s=40, gpu_bytes=4 * GIB, models=3)
    assert view.interactive
    view.update(1.0, LATEST)
    first = out.getvalue()
    assert "\x1b[" not in first
    view.update(2.0, LATEST)
    second = out.getvalue()[len(first) :]
    drawn = first.count("\n")
    assert second.startswith(f"\x1b[{drawn}F\x1b[J")


def test_without_a_terminal_it_prints_plain_lines_now_and_then() -> None:
    out = io.StringIO()
    view = LiveView(out, duration_s=40, gpu_bytes=4 * GIB, models=3, plain_every_s=3600)
    assert not view.interactive
    view.update(1.0, LATEST)
    view.update(2.0, LATEST)  # within the period: nothing new
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert "\x1b" not in lines[0]
    assert lines[0].startswith("[  1.0 s] static: served 13, queued 5")
    assert "elastic: served 15, queued 0, KV GiB per model 3.00" in lines[0]
