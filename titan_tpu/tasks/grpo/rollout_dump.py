"""What multi-turn episodes did, for people to read: a few whole episodes (messages, tool calls, tool
results, reward) appended to `<dump_folder>/rollouts/step-N.jsonl` at every evaluation, and whenever
`<dump_folder>/rollouts/DUMP` exists (the file is a request: the next rollout is written and the file
removed); one of them is shown in the log. A step written twice (a resumed run repeats the steps after
its checkpoint) keeps both: lines are appended, never overwritten."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from titan_tpu.generation.episodes import Trajectory
from titan_tpu.metrics.console import SampleField, sample_lines
from titan_tpu.tasks.grpo.prompts import Prompt

logger = logging.getLogger("titan_tpu")
FOLDER = "rollouts"
REQUEST = "DUMP"


def dump_requested(dump_folder: Path) -> bool:
    """Whether a dump was asked for (and the request taken: the file is removed)."""
    request = dump_folder / FOLDER / REQUEST
    if not request.exists():
        return False
    request.unlink(missing_ok=True)
    return True


def episode_record(step: int, row: int, prompt: Prompt, episode: Trajectory) -> dict[str, object]:
    return {
        "step": step,
        "row": row,
        "record": prompt.place,
        "tools": [tool.get("function", tool).get("name") for tool in episode.tools],
        "messages": episode.messages,
        "reward": episode.reward,
        "turns": episode.turns,
        "tool_calls": episode.tool_calls,
        "tool_errors": episode.tool_errors,
        "timeouts": episode.timeouts,
        "end": episode.end,
        "model_tokens": episode.model_tokens,
        "tokens": len(episode.prompt) + len(episode.tokens),
    }


def write_episodes(dump_folder: Path, step: int, episodes: Sequence[tuple[int, Prompt, Trajectory]]) -> Path:
    folder = dump_folder / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step}.jsonl"
    with path.open("a", encoding="utf-8") as out:
        for row, prompt, episode in episodes:
            out.write(json.dumps(episode_record(step, row, prompt, episode), ensure_ascii=False, default=str) + "\n")
    return path


def log_episode(step: int, path: Path, row: int, episode: Trajectory) -> None:
    """One episode, a line per message after the system prompt: what was said and which tools were called."""
    title = (
        f"step {step}: episode of row {row} (reward {episode.reward:.4g}, {episode.turns} turns, "
        f"{episode.tool_calls} tool calls, ended by {episode.end}); written with others to {path}:"
    )
    fields: list[SampleField] = []
    for message in episode.messages:
        if message.get("role") == "system":
            continue
        calls = [
            f"{call['function']['name']}({json.dumps(call['function']['arguments'], ensure_ascii=False)})"
            for call in message.get("tool_calls", [])
        ]
        text = " ".join([str(message.get("content", "")), *calls]).strip()
        fields.append((str(message.get("role")), text, "start"))
    for line in sample_lines(title, fields):
        logger.info(line)


class EpisodeDumps:
    """The writer rank's episodes of the latest rollout, and when to write the first `count` of them."""

    def __init__(self, dump_folder: Path, count: int, group_size: int) -> None:
        self.dump_folder = dump_folder
        self.count = count
        self.group_size = group_size
        self.latest: tuple[int, list[Prompt], dict[int, Trajectory]] | None = None

    def after_rollout(self, step: int, prompts: list[Prompt], episodes: dict[int, Trajectory]) -> None:
        self.latest = (step, prompts, episodes)
        if dump_requested(self.dump_folder):
            self.write(step)

    def write(self, step: int) -> None:
        """The latest rollout's first episodes, filed under `step`, and one of them in the log."""
        if self.latest is None or self.count == 0:
            return
        _, prompts, episodes = self.latest
        rows = sorted(episodes)[: self.count]
        if not rows:
            return
        path = write_episodes(self.dump_folder, step, [(r, prompts[r // self.group_size], episodes[r]) for r in rows])
        log_episode(step, path, rows[0], episodes[rows[0]])
