"""Layouts (titan_tpu/protocols/tensor_layout.py) against torch's own ops on real values: every op a
conversion is made of moves a layout as torch moves the elements, a rank's block of the result is
read from exactly the right boxes of the sources, and transformers' conversion ops run on
LayoutTensors give what they give on real tensors. Catches an offset shifted by one piece (cat), a
chunk's bounds off by the remainder, a transpose that swaps offsets but not axes, a view of the
destination in the wrong axis order."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from titan_tpu.models.hf.conversion import LayoutTensor, NoLayout
from titan_tpu.protocols.tensor_layout import BlockLayout, assemble


def sources(count: int, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(count)
    return {f"s{k}": torch.randn(shape, generator=generator) for k in range(count)}


def layouts(tensors: dict[str, torch.Tensor]) -> list[BlockLayout]:
    return [BlockLayout.whole(name, t.shape) for name, t in tensors.items()]


# (what torch does, what the layout does) on a list of 3 tensors of shape (4, 6, 5)
CHAINS: dict[str, tuple[Callable, Callable]] = {
    "stack": (lambda ts: torch.stack(ts, 1), lambda ls: BlockLayout.stack(ls, 1)),
    "cat": (lambda ts: torch.cat(ts, 1), lambda ls: BlockLayout.cat(ls, 1)),
    "stack then cat": (
        lambda ts: torch.cat([torch.stack(ts[:2]), torch.stack(ts[1:])], 1),
        lambda ls: BlockLayout.cat([BlockLayout.stack(ls[:2]), BlockLayout.stack(ls[1:])], 1),
    ),
    "cat then narrow": (lambda ts: torch.cat(ts, 2).narrow(2, 3, 9), lambda ls: BlockLayout.cat(ls, 2).narrow(2, 3, 9)),
    "transpose": (lambda ts: ts[0].transpose(0, 2), lambda ls: ls[0].transpose(0, 2)),
    "stack, transpose, narrow": (
        lambda ts: torch.stack(ts).transpose(1, 3).narrow(0, 1, 2),
        lambda ls: BlockLayout.stack(ls).transpose(1, 3).narrow(0, 1, 2),
    ),
    "narrow, squeeze, unsqueeze": (
        lambda ts: torch.stack(ts).narrow(0, 2, 1).squeeze(0).unsqueeze(2),
        lambda ls: BlockLayout.stack(ls).narrow(0, 2, 1).squeeze(0).unsqueeze(2),
    ),
}


@pytest.mark.parametrize("chain", list(CHAINS))
def test_a_layout_moves_elements_as_torch_does(chain: str) -> None:
    tensors = sources(3, (4, 6, 5))
    real, layout_of = CHAINS[chain]
    expected = real(list(tensors.values()))
    layout = layout_of(layouts(tensors))
    assert layout.shape == tuple(expected.shape)
    assert torch.equal(assemble(layout, tensors), expected)
    # Every block of the result (a rank's shard) is read from the right boxes, into a strided view.
    rng = random.Random(chain)
    for _ in range(20):
        offsets = [rng.randrange(n) for n in layout.shape]
        sizes = [rng.randint(1, n - o) for o, n in zip(offsets, layout.shape)]
        block = torch.full(sizes, float("nan"))
        for part in layout.blocks(offsets, sizes):
            box = tuple(slice(o, o + s) for o, s in zip(part.source_offsets, part.source_sizes))
            part.target_view(block).copy_(tensors[part.source][box])
        region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        assert torch.equal(block, expected[region]), (offsets, sizes)


def test_a_wrong_layout_is_seen() -> None:
    """The comparison's negative control: the pieces of a cat in the wrong order."""
    tensors = sources(2, (2, 3))
    swapped = BlockLayout.cat(layouts(tensors)[::-1], 0)
    assert not torch.equal(assemble(swapped, tensors), torch.cat(list(tensors.values()), 0))


def test_chunk_and_split_bounds_follow_torch() -> None:
    tensor = sources(1, (7, 3))["s0"]
    wrapped = LayoutTensor.of(BlockLayout.whole("s0", tensor.shape))
    for ours, real in [
        (torch.chunk(wrapped, 3, dim=0), torch.chunk(tensor, 3, dim=0)),
        (wrapped.split([2, 5]), tensor.split([2, 5])),
        (torch.split(wrapped, 3), torch.split(tensor, 3)),
    ]:
        assert len(ours) == len(real)
        for piece, value in zip(ours, real):
            assert torch.equal(assemble(piece.source_layout, {"s0": tensor}), value)


def test_transformers_conversion_ops_run_on_layouts_as_on_tensors() -> None:
    from transformers.core_model_loading import Chunk, Concatenate, MergeModulelist, SplitModulelist, Transpose

    experts = sources(4, (6, 5))
    gate, up = dict(list(experts.items())[:2]), dict(list(experts.items())[2:])

    def both(op, inputs: dict[str, dict[str, torch.Tensor]], targets: list[str]) -> None:
        real = op.convert({k: list(v.values()) for k, v in inputs.items()}, list(inputs), targets)
        wrapped = op.convert(
            {k: [LayoutTensor.of(BlockLayout.whole(n, t.shape)) for n, t in v.items()] for k, v in inputs.items()},
            list(inputs),
            targets,
        )
        values = {n: t for v in inputs.values() for n, t in v.items()}
        assert list(wrapped) == list(real)
        for key, value in real.items():
            assert torch.equal(assemble(wrapped[key].source_layout, values), value), (type(op).__name__, key)

    both(MergeModulelist(dim=0), {"gate": gate}, ["fused"])
    merged_gate, merged_up = torch.stack(list(gate.values())), torch.stack(list(up.values()))
    real_concat = Concatenate(dim=1).convert({"g": [merged_gate], "u": [merged_up]}, ["g", "u"], ["gate_up"])
    layout_concat = Concatenate(dim=1).convert(
        {
            "g": [LayoutTensor.of(BlockLayout.stack(layouts(gate)))],
            "u": [LayoutTensor.of(BlockLayout.stack(layouts(up)))],
        },
        ["g", "u"],
        ["gate_up"],
    )
    assert torch.equal(assemble(layout_concat["gate_up"].source_layout, experts), real_concat["gate_up"])
    both(Chunk(dim=0), {"qkv": {"s0": experts["s0"]}}, ["q", "k", "v"])
    both(Transpose(0, 1), {"w": {"s1": experts["s1"]}}, ["w_t"])
    both(SplitModulelist(dim=0), {"e.*": {"s2": torch.randn(3, 4, 2)}}, ["e.*"])


def test_an_op_without_a_layout_is_refused() -> None:
    from transformers.core_model_loading import Interleave

    wrapped = LayoutTensor.of(BlockLayout.whole("w", (4, 6)))
    with pytest.raises(NoLayout):
        Interleave(dim=0).convert({"w": [wrapped]}, ["w"], ["w"])
