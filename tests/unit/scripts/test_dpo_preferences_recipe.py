"""scripts/recipes/dpo_preferences.py end to end on tiny settings (a tiny model, a few steps): the records
written, the DPO run and its random-preference control through the trainer, the held-out accuracy
before, during and after, result.json. How much the run learns is the full run's
(docs/benchmarks/dpo_preferences_*.md); this checks that the pieces are wired together.

Bugs caught: a "before" that is not the untrained policy (it must tie every pair: 0), a control whose
records are not the same pairs with some of them swapped, a result.json of another shape."""

from __future__ import annotations

import json
from pathlib import Path

from scripts.recipes.dpo_preferences import main
from tests.support.launch import fixed_kernels

TINY = "--model.overrides={ n_layers = 1, dim = 64, n_heads = 4, n_kv_heads = 2, head_dim = 16, ffn_hidden_dim = 128 }"


def test_the_recipe_writes_both_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--out", str(out), "--steps=2", "--control-steps=2", "--eval-freq=2", "--train-pairs=64"]
    result = main([*argv, "--held-out-pairs=32", TINY, *fixed_kernels("dpo_qwen3_debug")])
    assert json.loads((out / "result.json").read_text()) == json.loads(json.dumps(result))
    assert set(result) == {"dpo", "control", "seconds"}
    for run in ("dpo", "control"):
        numbers = result[run]
        assert isinstance(numbers, dict)
        assert numbers["before"] == 0.0  # the policy is its reference: every pair ties
        assert [list(point) for point in numbers["curve"]] == [[2, numbers["after"]]]
    train, control = (
        [json.loads(line) for line in (out / "data" / name).read_text().splitlines()]
        for name in ("train.jsonl", "random_preferences.jsonl")
    )
    swapped = [a["chosen"] == b["rejected"] and a["rejected"] == b["chosen"] for a, b in zip(train, control)]
    kept = [a == b for a, b in zip(train, control)]
    assert all(s or k for s, k in zip(swapped, kept)) and 16 < sum(swapped) < 48
