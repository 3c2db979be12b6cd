"""The start-up check of a running server's model (titan_tpu/generation/vllm/served_model.py), on
folders laid out as a server's root.

Bugs caught: a server of other shapes or another tokenizer accepted (the first push of the run's weights
would kill its engine core, or the run would sample with another vocabulary's ids); a folder the
trainer cannot read taken as a match without the vocabulary probe; the run's own folder refused."""

from __future__ import annotations

import json
from pathlib import Path

from titan_tpu.generation.vllm.client import ServedModel
from titan_tpu.generation.vllm.served_model import served_model_check

OURS = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2}


def folder(path: Path, tokenizer: str = '{"model": "ours"}', **changes: object) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**OURS, **changes, "torch_dtype": "float32"}))
    (path / "tokenizer.json").write_text(tokenizer)
    return path


def served(root: Path | str) -> ServedModel:
    return ServedModel("http://127.0.0.1:8000", "policy", 64, str(root))


def never_probed(model: ServedModel) -> bool:
    raise AssertionError("the probe is for servers whose folder the trainer cannot read")


def test_the_runs_own_model_passes_and_other_shapes_or_tokenizers_do_not(tmp_path: Path) -> None:
    ours = folder(tmp_path / "ours")
    check = served_model_check(OURS, ours, never_probed)
    assert check(served(ours)) is None
    assert check(served(folder(tmp_path / "same", hidden_size=64))) is None  # other keys (dtype) may differ
    wider = check(served(folder(tmp_path / "wider", vocab_size=640)))
    assert (
        wider
        == f"serves {tmp_path / 'wider'}, whose vocab_size is 640 where this run's model has 512; start it from this run's model"
    )
    deeper = check(served(folder(tmp_path / "deeper", num_hidden_layers=4)))
    assert deeper is not None and "num_hidden_layers is 4 where this run's model has 2" in deeper
    other = check(served(folder(tmp_path / "other", tokenizer='{"model": "theirs"}')))
    assert other is not None and "its tokenizer.json differs" in other
    # Without the run's folder there is no tokenizer to compare: the shapes alone decide.
    assert served_model_check(OURS, None, never_probed)(served(tmp_path / "other")) is None


def test_a_folder_out_of_reach_is_probed_with_the_last_token_id(tmp_path: Path) -> None:
    hub_name = served("Qwen/Qwen3-0.6B")  # a hub name, or a path on the server's host only
    asked: list[ServedModel] = []

    def probe(answer: bool):  # type: ignore[no-untyped-def]
        def accepts(model: ServedModel) -> bool:
            asked.append(model)
            return answer

        return accepts

    assert served_model_check(OURS, None, probe(True))(hub_name) is None
    refused = served_model_check(OURS, None, probe(False))(hub_name)
    assert (
        refused
        == "serves Qwen/Qwen3-0.6B, whose vocabulary is smaller than this run's 512 tokens; start it from this run's model"
    )
    assert asked == [hub_name, hub_name]
