"""The published MFU records are well-formed: each names a config this repository ships, a slice by
its chip count, either the MFU or the TFLOP/s per chip the source prints (never both), an MFU in
(0, 100], an https source, and no configuration twice. Every check also runs on a record broken on
purpose, so a check that cannot fail is caught too."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest

from tests.support.paths import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "scripts"))

from published_mfu import PUBLISHED, PublishedResult  # noqa: E402

from titan_tpu.config.loader import CONFIG_DIR  # noqa: E402
from titan_tpu.plan.chips import parse_chips  # noqa: E402

CHIPS = re.compile(r"(v4|v5e|v5p|v6e|v7x)-([1-9][0-9]*)")
# Google names these generations' slices by TensorCores, two per chip.
NAMED_BY_TENSORCORES = ("v4", "v5p")


def problems(record: PublishedResult) -> list[str]:
    """What is wrong with one record, in words; empty when it is well-formed."""
    found = []
    if not (CONFIG_DIR / f"{record.model}.toml").is_file():
        found.append(f"model {record.model!r} has no titan_tpu/train_configs/{record.model}.toml")
    chips = CHIPS.fullmatch(record.chips)
    if chips is None:
        found.append(f"chips {record.chips!r} is not <v4|v5e|v5p|v6e|v7x>-<count>")
    else:
        generation, count = chips.group(1), int(chips.group(2))
        # A v5p-1024 stored as chips would double every per-chip figure the planner compares.
        named = re.fullmatch(rf"{generation}-([0-9]+)", record.published_name)
        if named and generation in NAMED_BY_TENSORCORES and int(named.group(1)) != 2 * count:
            chip_count = int(named.group(1)) // 2
            found.append(f"{record.published_name} counts TensorCores: {chip_count} chips, not {count}")
    printed = (record.printed_mfu_percent is not None, record.tflops_per_chip is not None)
    if printed == (True, True):
        found.append("gives both a printed MFU and a printed TFLOP/s per chip: keep the one the source prints")
    elif printed == (False, False):
        found.append("needs the printed MFU or the printed TFLOP/s per chip")
    elif chips is not None and not 0 < record.mfu_percent <= 100:
        found.append(f"MFU {record.mfu_percent:.2f} is outside (0, 100]")
    if record.seq_len <= 0:
        found.append(f"seq_len {record.seq_len} is not positive")
    if record.global_batch_tokens is not None and (
        record.global_batch_tokens <= 0 or record.global_batch_tokens % record.seq_len
    ):
        found.append(f"{record.global_batch_tokens} tokens is not a whole number of {record.seq_len}-token rows")
    if not record.source.startswith("https://"):
        found.append(f"source {record.source!r} is not an https URL")
    if not record.parallelism or not record.published_name:
        found.append("parallelism and published_name must say something")
    return found


def duplicates(records: tuple[PublishedResult, ...]) -> list[tuple[object, ...]]:
    """Configurations recorded more than once (model, slice, sequence, batch, layout)."""
    keys = [(r.model, r.chips, r.seq_len, r.global_batch_tokens, r.parallelism) for r in records]
    return [key for index, key in enumerate(keys) if key in keys[:index]]


@pytest.mark.parametrize("record", PUBLISHED, ids=lambda r: f"{r.model}@{r.chips}/{r.seq_len}")
def test_record_is_well_formed(record: PublishedResult) -> None:
    assert problems(record) == []


def test_no_configuration_is_recorded_twice() -> None:
    assert duplicates(PUBLISHED) == []


def test_derived_mfus_divide_by_the_whole_chips_peak() -> None:
    """A derived MFU is the printed TFLOP/s per chip over the whole chip's peak: times the peak of
    all the devices on a chip it gives the printed rate back. Catches a division by a per-device
    peak (Ironwood runs as two devices a chip: its rows would read twice as high), shown to fail the
    same comparison."""
    derived = [r for r in PUBLISHED if r.printed_mfu_percent is None]
    assert any(r.chips.startswith("v7x") for r in derived)  # the generation the bug shows on
    for record in derived:
        cluster = parse_chips(record.chips)
        chip_peak = cluster.peak_flops_per_device * cluster.devices / cluster.chips
        printed = record.tflops_per_chip * 1e12  # type: ignore[operator]
        assert record.mfu_percent / 100 * chip_peak == pytest.approx(printed), record
        if cluster.devices > cluster.chips:
            per_device_mfu = 100 * printed / cluster.peak_flops_per_device
            assert per_device_mfu / 100 * chip_peak != pytest.approx(printed)


# Negative controls: one deliberate fault per check, on a copy of a good derived record.
GOOD = next(r for r in PUBLISHED if r.chips == "v5p-512")


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        ({"model": "llama3_9b"}, "no titan_tpu/train_configs"),
        ({"chips": "v6-256"}, "is not <v4"),
        ({"chips": "v5p-1024"}, "counts TensorCores"),
        ({"tflops_per_chip": 0.0}, "outside (0, 100]"),
        ({"tflops_per_chip": 2000.0}, "outside (0, 100]"),
        ({"tflops_per_chip": None}, "needs the printed MFU or"),
        ({"printed_mfu_percent": 68.5}, "gives both"),
        ({"global_batch_tokens": 8_388_609}, "whole number"),
        ({"source": "http://example.com"}, "https"),
        ({"parallelism": ""}, "must say something"),
    ],
)
def test_each_check_rejects_a_broken_record(change: dict[str, object], complaint: str) -> None:
    assert problems(GOOD) == []
    broken = dataclasses.replace(GOOD, **change)  # type: ignore[arg-type]
    assert any(complaint in problem for problem in problems(broken)), problems(broken)


def test_duplicate_check_catches_a_repeated_record() -> None:
    assert duplicates((GOOD, dataclasses.replace(GOOD, tflops_per_chip=300.0))) != []
