"""The pipeline bubble model (titan_tpu/plan/pipeline_bubble.py) against the papers' formulas worked by hand.

Catches: a bubble that ignores interleaving (v), one counted against the total time where the
ideal time is meant, and a zero-bubble schedule charged 1F1B's bubble."""

import pytest

from titan_tpu.plan.pipeline_bubble import bubble_fraction, bubble_slots, stages_per_rank, step_time_factor


@pytest.mark.parametrize(
    ("schedule", "pp", "microbatches", "factor", "fraction"),
    [
        ("1F1B", 1, 4, 1.0, 0.0),  # one stage: no bubble
        ("1F1B", 2, 2, 1.5, 1 / 3),  # (m + p - 1) / m = 3 / 2; idle 1 of 3 slots
        ("GPipe", 4, 8, 11 / 8, 3 / 11),
        ("Interleaved1F1B", 4, 8, (8 + 1.5) / 8, 1.5 / 9.5),  # v = 2 halves the bubble
        ("InterleavedZeroBubble", 4, 8, (8 + 0.5) / 8, 0.5 / 8.5),  # a third of the interleaved one
    ],
)
def test_bubble_by_hand(schedule: str, pp: int, microbatches: int, factor: float, fraction: float) -> None:
    per_rank = stages_per_rank(schedule)
    assert step_time_factor(schedule, pp, microbatches, per_rank) == pytest.approx(factor)
    assert bubble_fraction(schedule, pp, microbatches, per_rank) == pytest.approx(fraction)


def test_more_microbatches_shrink_the_bubble_but_not_its_slots() -> None:
    assert bubble_slots("1F1B", 4, 4, 1) == bubble_slots("1F1B", 4, 32, 1) == 3
    assert bubble_fraction("1F1B", 4, 32, 1) < bubble_fraction("1F1B", 4, 4, 1)


def test_nonsense_degrees_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        bubble_slots("1F1B", 0, 4, 1)
