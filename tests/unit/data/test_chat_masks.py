"""The SFT loss mask (titan_tpu/data/chat_masks.py).

On `messages` data: a hand-checked fixture per published template (the exact text of every trained
run of tokens), so a mask that starts one token early (the assistant header), ends one late (the
newline after the end of turn) or misses the end-of-turn token fails; reasoning Qwen 3 drops from an
earlier turn is not trained on. On prompt/completion data: ids and mask equal TRL's SFTTrainer with
completion-only loss on the same tokenizer. Negative control: the same mask shifted by one token
fails the fixture. Bad records are one line naming the record.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.chat_fixtures import CONVERSATION, checkpoint_folder
from titan_tpu.data.chat_masks import MaskedTokens, completion_tokens, conversation_tokens, end_of_turn
from titan_tpu.data.chat_template import ChatTemplate, ChatTemplateError
from titan_tpu.data.tokenizer import HFTokenizer

# The trained text of CONVERSATION, run by run, read off each template's rendering by hand.
TRAINED = {
    "qwen3": ["Four.<|im_end|>", "<think>\n\n</think>\n\nThirteen.<|im_end|>"],
    "llama3_1": ["<think>\nTwo and two make four.\n</think>\n\nFour.<|eot_id|>", "Thirteen.<|eot_id|>"],
}


def trained_runs(tokenizer: HFTokenizer, masked: MaskedTokens) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs: list[list[int]] = []
    previous = False
    for token, trained in zip(masked.ids, masked.trained):
        if trained and not previous:
            runs.append([])
        if trained:
            runs[-1].append(token)
        previous = trained
    return [tokenizer.decode(run) for run in runs]


def _setup(tmp_path: Path, family: str) -> tuple[ChatTemplate, HFTokenizer]:
    folder = checkpoint_folder(tmp_path, family)
    return ChatTemplate.from_folder(folder), HFTokenizer(folder / "tokenizer.json")


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_every_assistant_turn_through_its_end_of_turn_and_nothing_else(tmp_path: Path, family: str) -> None:
    template, tokenizer = _setup(tmp_path, family)
    masked = conversation_tokens(template, tokenizer, CONVERSATION, "assistant", "record 1")
    assert masked.ids == tokenizer.encode(template.render(CONVERSATION))
    assert trained_runs(tokenizer, masked) == TRAINED[family]
    # Negative control: the mask one token late (or early) is not the fixture.
    for shifted in ([False, *masked.trained[:-1]], [*masked.trained[1:], False]):
        assert trained_runs(tokenizer, MaskedTokens(masked.ids, shifted)) != TRAINED[family]


@pytest.mark.parametrize("family", sorted(TRAINED))
def test_last_assistant_and_all(tmp_path: Path, family: str) -> None:
    template, tokenizer = _setup(tmp_path, family)
    last = conversation_tokens(template, tokenizer, CONVERSATION, "last_assistant", "record 1")
    assert trained_runs(tokenizer, last) == TRAINED[family][-1:]
    everything = conversation_tokens(template, tokenizer, CONVERSATION, "all", "record 1")
    assert all(everything.trained) and everything.ids == last.ids


def test_the_end_of_turn_comes_from_the_template(tmp_path: Path) -> None:
    assert end_of_turn(_setup(tmp_path, "qwen3")[0]) == "<|im_end|>"
    assert end_of_turn(_setup(tmp_path, "llama3_1")[0]) == "<|eot_id|>"
    silent = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", {}, "silent.jinja")
    with pytest.raises(ChatTemplateError, match="silent.jinja writes nothing after an assistant turn"):
        end_of_turn(silent)


def test_prompt_completion_equals_trl_completion_only_loss(tmp_path: Path) -> None:
    """TRL's SFTTrainer tokenizes the records (bos from the tokenizer's post-processor, eos appended)
    and marks the completion; ours must give the same ids and mask."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    folder = checkpoint_folder(tmp_path, "llama3_1")
    reference = AutoTokenizer.from_pretrained(folder)
    records = [
        {"prompt": "What is two plus two?", "completion": " Four."},
        {"prompt": "Name a prime number larger than ten:", "completion": " Thirteen is prime.<|eot_id|>"},
        {"prompt": "The quick brown", "completion": " fox jumps over the lazy dog"},
    ]
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=reference.vocab_size + 8,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    config = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        completion_only_loss=True,
        report_to=[],
        max_length=None,
        bf16=False,
        use_cpu=True,
    )
    trl = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(records), processing_class=reference)
    tokenizer = HFTokenizer(folder / "tokenizer.json")
    for i, (record, row) in enumerate(zip(records, trl.train_dataset)):
        ours = completion_tokens(
            tokenizer,
            record["prompt"],
            record["completion"],
            "<|eot_id|>",
            "<|begin_of_text|>",
            "completion",
            f"record {i}",
        )
        assert ours.ids == row["input_ids"]
        # TRL folds the completion mask into unshifted labels: -100 where the loss does not count.
        trl_trained = [label != -100 for label in row["labels"]]
        assert ours.trained == trl_trained and any(trl_trained) and not all(trl_trained)
        # Negative control: shifted by one token, the mask is not TRL's.
        assert [False, *ours.trained[:-1]] != trl_trained


def test_bad_records_are_one_line_naming_the_record(tmp_path: Path) -> None:
    template, tokenizer = _setup(tmp_path, "qwen3")
    cases = {
        "unknown role 'robot'": [{"role": "robot", "content": "hi"}],
        "an empty conversation": [],
        "opens with an assistant turn": [{"role": "assistant", "content": "hi"}],
        "no assistant turn": [{"role": "user", "content": "hi"}],
    }
    for message, messages in cases.items():
        with pytest.raises(ChatTemplateError, match=f"^data.jsonl:3: .*{message}") as err:
            conversation_tokens(template, tokenizer, messages, "assistant", "data.jsonl:3")
        assert "\n" not in str(err.value)
    with pytest.raises(ChatTemplateError, match="^data.jsonl:3: sft.train_on = 'assistant' needs messages records"):
        completion_tokens(tokenizer, "a", "b", "<|im_end|>", None, "assistant", "data.jsonl:3")
    with pytest.raises(ChatTemplateError, match="needs prompt/completion records"):
        conversation_tokens(template, tokenizer, CONVERSATION, "completion", "data.jsonl:3")


def test_conversational_prompt_completion_equals_trl(tmp_path: Path) -> None:
    """Prompt and completion as lists of turns: TRL renders prompt + completion whole and trains on
    the tokens after the prompt rendered with the generation prompt."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from titan_tpu.data.chat_masks import conversational_completion_tokens

    folder = checkpoint_folder(tmp_path, "qwen3")
    reference = AutoTokenizer.from_pretrained(folder)
    records = [
        {"prompt": CONVERSATION[:2], "completion": [{"role": "assistant", "content": "Four."}]},
        {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]},
    ]
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=reference.vocab_size + 8,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    config = SFTConfig(
        output_dir=str(tmp_path / "trl"),
        completion_only_loss=True,
        report_to=[],
        max_length=None,
        bf16=False,
        use_cpu=True,
    )
    trl = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_list(records), processing_class=reference)
    template, tokenizer = ChatTemplate.from_folder(folder), HFTokenizer(folder / "tokenizer.json")
    for i, (record, row) in enumerate(zip(records, trl.train_dataset)):
        ours = conversational_completion_tokens(
            template, tokenizer, record["prompt"], record["completion"], "completion", f"record {i}"
        )
        trl_trained = [label != -100 for label in row["labels"]]
        assert ours.ids == row["input_ids"] and ours.trained == trl_trained and any(trl_trained)
        assert [False, *ours.trained[:-1]] != trl_trained  # negative control
