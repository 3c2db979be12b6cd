"""Which name of a tied parameter a Hugging Face folder holds (`hf_format.tied_repeats`): the one
transformers' `save_pretrained` writes. A model whose head is registered before its embedding
(CamembertForCausalLM, XLMRobertaForCausalLM) declares the head tied to the embedding
(`_tied_weights_keys`), so the folder holds the embedding's name, not the first one listed."""

from __future__ import annotations

from torch import nn

from titan_tpu.checkpoint.hf_format import tied_repeats


class HeadFirst(nn.Module):
    def __init__(self, declare: bool) -> None:
        super().__init__()
        self.head = nn.Linear(4, 8, bias=False)
        self.embed = nn.Embedding(8, 4)
        self.head.weight = self.embed.weight
        if declare:
            self._tied_weights_keys = {"head.weight": "embed.weight"}


def test_the_declared_target_of_a_tie_is_the_repeat() -> None:
    assert tied_repeats(HeadFirst(declare=True)) == {"head.weight"}
    # Nested under a prefix (the hf family keeps transformers' model under `hf.`).
    wrapper = nn.Module()
    wrapper.hf = HeadFirst(declare=True)
    assert tied_repeats(wrapper) == {"hf.head.weight"}


def test_without_a_declaration_the_first_name_is_kept() -> None:
    """The negative control: the rule that used to apply to every model, which kept the head."""
    assert tied_repeats(HeadFirst(declare=False)) == {"embed.weight"}
