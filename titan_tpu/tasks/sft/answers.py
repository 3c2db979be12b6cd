"""Held-out answers: greedy generation of each held-out conversation's last assistant turn, scored by
exact match against what the template renders for it (the fine-tuning learning signal the loss
alone does not show: a model can lower the loss and still never stop, or answer in the wrong form).

The prompt is the conversation before that turn with the generation prompt, as a user's chat
client sends it; the expected answer is the turn's text in the rendered conversation, through its
end-of-turn token (`chat_masks.assistant_spans`), so a model must also stop where the template
does. Conversations are split over data-parallel ranks and the counts summed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
from torch import nn

from titan_tpu.data.chat_masks import assistant_spans, check_messages
from titan_tpu.data.sft_dataset import RecordSource
from titan_tpu.distributed.parallelize import reshard_setting
from titan_tpu.generation.answers import greedy_answer_score
from titan_tpu.generation.builtin import BuiltinEngine
from titan_tpu.metrics.console import SampleField, sample_lines
from titan_tpu.protocols.rollout import SamplingParams
from titan_tpu.tasks.base import TaskContext
from titan_tpu.tasks.sft.data import ChatEncoding

logger = logging.getLogger("titan_tpu")


@dataclasses.dataclass(frozen=True)
class HeldOutAnswer:
    prompt: list[int]
    expected: str


def held_out_answers(source: RecordSource, encoding: ChatEncoding, count: int, longest: int) -> list[HeldOutAnswer]:
    """The first `count` held-out conversations whose prompt and answer fit `longest` tokens."""
    return list(islice(_answers(source, encoding, longest), count))


def _answers(source: RecordSource, encoding: ChatEncoding, longest: int) -> Iterator[HeldOutAnswer]:
    template, fields, switches = encoding.template, encoding.fields, encoding.switches
    for _, where, record in source.records():
        messages: Any = record.get(fields.messages)
        if messages is None and isinstance(record.get(fields.prompt), list):
            messages = [*record[fields.prompt], *record.get(fields.completion, [])]
        if not isinstance(messages, list) or not messages or messages[-1].get("role") != "assistant":
            continue
        check_messages(messages, where)
        text, spans = assistant_spans(template, messages, where, **switches)
        start, end = spans[-1]
        prompt = encoding.tokenizer.encode(template.render(messages[:-1], add_generation_prompt=True, **switches))
        expected = text[start:end]
        if len(prompt) + len(encoding.tokenizer.encode(expected)) <= longest:
            yield HeldOutAnswer(prompt, expected)


@torch.no_grad()
def exact_answer_rate(
    model: nn.Module,
    answers: list[HeldOutAnswer],
    encoding: ChatEncoding,
    max_new_tokens: int,
    ctx: TaskContext,
    step: int,
    shown: list[tuple[HeldOutAnswer, str]] | None = None,
) -> dict[str, float]:
    """{"sft/exact_answers": share of held-out answers generated exactly, "sft/answers": how many}.
    `shown` receives this rank's first answer and the text generated for it, to be read in the log."""
    decoding = ctx.spec.capabilities.decoding
    if decoding is None:
        raise RuntimeError(f"model {ctx.spec.name} does not decode with a KV cache; sft.eval_generations needs one")
    params = SamplingParams(max_new_tokens, temperature=0.0, stop_ids=encoding.stop_ids)
    reshard = reshard_setting(model, ctx.config, ctx.compute_dtype, ctx.device.type)
    engine = BuiltinEngine(decoding, encoding.pad_id, ctx.device, reshard)
    engine.load_weights(model, step)

    def exact(indices: list[int], ids: list[list[int]]) -> float:
        texts = [encoding.tokenizer.decode(i) for i in ids]
        if shown is not None and texts:
            shown.append((answers[indices[0]], texts[0]))
        return float(sum(text == answers[k].expected for k, text in zip(indices, texts)))

    was_training = model.training
    model.eval()
    try:
        correct, total = greedy_answer_score(
            engine,
            [a.prompt for a in answers],
            params,
            exact,
            ctx.dp_rank,
            ctx.dp_world,
            ctx.parallel.dp_reduce_mesh,
            ctx.device,
        )
    finally:
        model.train(was_training)
    return {"sft/exact_answers": correct / total if total else 0.0, "sft/answers": total}


def log_answer(step: int, answer: HeldOutAnswer, generated: str, encoding: ChatEncoding) -> None:
    """One held-out answer beside what the model generated for it, a few lines in the log: what the
    exact-answer rate counts, seen on one case."""
    verdict = "exact" if generated == answer.expected else "not exact"
    fields: list[SampleField] = [
        ("prompt", encoding.tokenizer.decode(answer.prompt), "end"),
        ("generated", generated, "start"),
        ("expected", answer.expected, "start"),
    ]
    for line in sample_lines(f"step {step}: a held-out answer, greedy ({verdict}):", fields):
        logger.info(line)
