"""How a run reads on the console: which of a task's values its step line shows, a note under it,
durations and counts a person reads at a glance, and a sampled answer shortened to a few lines.

metrics.jsonl keeps every value of every record; the console line is for someone watching the run,
so a task with many values (GRPO has about twenty) picks the few that say how it is going.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# Which end of a long text a sample line keeps; (label, text, end kept) is one line of a sample.
Keep = Literal["start", "end"]
SampleField = tuple[str, str, Keep]


@dataclass(frozen=True)
class ConsoleView:
    """What a task's step line shows.

    shown: (key, label) of the task's values to show, in this order; None shows every value under
    its own name. brief: the line leaves the gradient norm, learning rate, TFLOP/s, MFU and memory
    to metrics.jsonl (a line that must fit a terminal). note: one more line under the step line
    (why the loss is what it is)."""

    shown: tuple[tuple[str, str], ...] | None = None
    brief: bool = False
    note: str | None = None


def duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m', '3d04h': two units at most, as a person says how long is left."""
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def count(value: float) -> str:
    """Three significant digits and a suffix: 2_056_320 -> '2.06M', 8.03e9 -> '8.03B'."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.0f}"


def shortened(text: str, width: int, keep: Keep) -> str:
    """`text` quoted on one line (newlines and tabs escaped as repr escapes them) and cut to about
    `width` characters, with '...' outside the quotes where it was cut: a prompt keeps its end (what
    the model answers), a completion its start."""
    body = repr(text)[1:-1]
    if len(body) <= width:
        return f"'{body}'"
    if keep == "end":
        return f"...'{body[len(body) - width :]}'"
    return f"'{body[:width]}'..."


def sample_lines(title: str, fields: Sequence[SampleField], width: int = 120) -> list[str]:
    """A title line, then one indented line per (label, text, which end to keep)."""
    pad = max((len(label) for label, _, _ in fields), default=0) + 1
    return [title, *(f"  {label + ':':<{pad}} {shortened(text, width, keep)}" for label, text, keep in fields)]
