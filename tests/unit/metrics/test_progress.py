"""The progress reporter: one line at the start, at most one per interval while work goes on, always
one at the end; and the Hugging Face reader reports each file it reads through it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from titan_tpu.checkpoint.hf_export import export_model_to_hf
from titan_tpu.checkpoint.hf_import import load_hf_weights
from titan_tpu.metrics.progress import Progress
from titan_tpu.models.llama3.args import LLAMA3_FLAVORS
from titan_tpu.models.llama3.model import Llama3Model
from titan_tpu.models.llama3.state_dict_adapter import LLAMA3_STATE_DICT_ADAPTER as ADAPTER


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_lines_are_throttled_and_the_last_always_comes() -> None:
    """Catches a reporter that logs every file (floods the log on a 1000-file folder), one that stays
    silent until the end, and one whose final line is lost to the throttle."""
    clock, lines = FakeClock(), []
    progress = Progress(
        "loading Hugging Face weights", 30, "files", total_bytes=140 * 10**9, every_s=5.0, clock=clock, log=lines.append
    )
    assert lines == ["loading Hugging Face weights: 0/30 files, 0.0/140.0 GB, 0 s"]
    for _ in range(3):  # 3 files in 3 s: under the interval, nothing new
        clock.now += 1.0
        progress.advance(1, 4_000_000_000)
    assert len(lines) == 1
    clock.now += 2.5  # 5.5 s since the first line
    progress.advance(1, 400_000_000)
    assert lines[-1] == "loading Hugging Face weights: 4/30 files, 12.4/140.0 GB, 6 s"
    clock.now += 1.0  # 1 s since that line: throttled again
    progress.advance(26, 127_600_000_000)
    assert len(lines) == 2
    clock.now += 34.5
    assert progress.finish() == pytest.approx(41.0)
    assert lines[-1] == "loading Hugging Face weights: 30/30 files, 140.0/140.0 GB, 41 s, done"
    assert len(lines) == 3


def test_without_bytes_the_line_counts_only() -> None:
    lines: list[str] = []
    progress = Progress("first step, compiling", 1, "step", clock=FakeClock(), log=lines.append)
    progress.advance()
    progress.finish()
    assert lines[-1] == "first step, compiling: 1/1 step, 0 s, done"


def test_bytes_are_in_the_unit_of_the_total() -> None:
    lines: list[str] = []
    Progress("writing", 39, "tensors", total_bytes=26_400_000, clock=FakeClock(), log=lines.append).finish()
    assert lines[-1] == "writing: 0/39 tensors, 0.0/26.4 MB, 0 s, done"


def test_the_hugging_face_reader_reports_every_shard(tmp_path: Path) -> None:
    """load_hf_weights with a progress starter: told the folder's file count and bytes, advanced once
    per shard with that shard's size, finished once; the weights still arrive (a reader that reports
    but skips a file fails the last check)."""
    args = LLAMA3_FLAVORS["debug"]
    torch.manual_seed(0)
    source = Llama3Model(args)
    source.init_weights()
    folder = export_model_to_hf(source, tmp_path / "hf", ADAPTER, args, max_shard_bytes=2 * 2**20)
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1
    events: list[tuple[str, int, int]] = []

    class Recorder:
        def advance(self, count: int = 1, nbytes: int = 0) -> None:
            events.append(("advance", count, nbytes))

        def finish(self) -> float:
            events.append(("finish", 0, 0))
            return 0.0

    def start(files: int, nbytes: int) -> Recorder:
        events.append(("start", files, nbytes))
        return Recorder()

    target = Llama3Model(args)
    load_hf_weights(target, folder, ADAPTER, args, progress=start)
    sizes = sorted(p.stat().st_size for p in shards)
    assert events[0] == ("start", len(shards), sum(sizes))
    assert sorted(e[2] for e in events[1:-1]) == sizes
    assert all(e[0] == "advance" and e[1] == 1 for e in events[1:-1])
    assert events[-1][0] == "finish"
    for name, value in source.state_dict().items():
        torch.testing.assert_close(target.state_dict()[name], value, rtol=0, atol=0)
