"""Where a tensor's elements come from when it is assembled from other tensors' blocks: one of ours
from a Hugging Face folder's tensors (a whole tensor under another name, experts stacked, gate and up
projections concatenated, a fused projection chunked, a transposed weight), or a folder's tensor from
ours on export. A `BlockLayout` is the target's shape and its `Piece`s; each piece is a box of the target
filled by a box of one source, whose axes may be permuted or dropped (a stacked source has no axis
for the stack). The pieces tile the target.

Both directions read and write blocks through it: a rank fills its shard of one of ours by reading,
for each piece the shard overlaps, only the overlapping block of that source (`BlockLayout.blocks`), and
an export fills each folder tensor piece by piece from our gathered tensors (`assemble`). Layouts are
built by the ops a conversion is made of (`whole`, `stack`, `cat`, `narrow`, `transpose`, `squeeze`,
`unsqueeze`), as `torch`'s ops of the same names would move the elements.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Piece:
    """The box `offsets`..`offsets + sizes` of the target holds `source`'s box starting at
    `source_offsets`; target axis d runs along source axis `axes[d]`, or is a size-1 axis the source
    lacks (None). A source axis that no target axis runs along is fixed at its offset (size 1)."""

    source: str
    source_offsets: tuple[int, ...]
    axes: tuple[int | None, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class PieceBlock:
    """The part of a piece inside a block of the target: read `source`'s box at `source_offsets`
    with `source_sizes` into `target_view(block)`, a view of the block in the source's axis order."""

    piece: Piece
    source_offsets: tuple[int, ...]
    source_sizes: tuple[int, ...]
    slices: tuple[slice, ...]  # of the block

    @property
    def source(self) -> str:
        return self.piece.source

    def target_view(self, block: torch.Tensor) -> torch.Tensor:
        """The view of `block` this piece fills, shaped and ordered as the source's box."""
        view = block[self.slices]
        axes = self.piece.axes
        for dim in reversed(range(len(axes))):
            if axes[dim] is None:
                view = view.squeeze(dim)
        kept = [axis for axis in axes if axis is not None]
        view = view.permute(sorted(range(len(kept)), key=lambda i: kept[i]))
        for axis in range(len(self.source_sizes)):
            if axis not in kept:
                view = view.unsqueeze(axis)
        return view

    def source_view(self, source: torch.Tensor) -> torch.Tensor:
        """The source's box as a view, shaped and ordered as the target block it fills (the reverse
        of `target_view`)."""
        box = source[tuple(slice(o, o + n) for o, n in zip(self.source_offsets, self.source_sizes))]
        axes = self.piece.axes
        kept = [axis for axis in axes if axis is not None]
        for source_axis in reversed(range(box.dim())):
            if source_axis not in kept:
                box = box.squeeze(source_axis)
        in_order = sorted(kept)
        box = box.permute([in_order.index(axis) for axis in kept])
        for dim, target_axis in enumerate(axes):
            if target_axis is None:
                box = box.unsqueeze(dim)
        return box


def _insert(values: tuple, dim: int, value: object) -> tuple:
    return values[:dim] + (value,) + values[dim:]


def _normalise(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise IndexError(f"dimension {dim} is out of range for {ndim} dimensions")
    return dim % ndim if ndim else 0


@dataclass(frozen=True)
class BlockLayout:
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @classmethod
    def whole(cls, source: str, shape: Sequence[int]) -> BlockLayout:
        shape = tuple(int(n) for n in shape)
        zeros = (0,) * len(shape)
        return cls(shape, (Piece(source, zeros, tuple(range(len(shape))), zeros, shape),))

    @property
    def sources(self) -> list[str]:
        """The sources, each once, in the order of their first piece."""
        return list(dict.fromkeys(piece.source for piece in self.pieces))

    @staticmethod
    def stack(layouts: Sequence[BlockLayout], dim: int = 0) -> BlockLayout:
        shape = layouts[0].shape
        if any(layout.shape != shape for layout in layouts):
            raise ValueError(f"stack of differently shaped tensors: {[list(layout.shape) for layout in layouts]}")
        dim = _normalise(dim, len(shape) + 1)
        pieces = tuple(
            dataclasses.replace(
                piece,
                axes=_insert(piece.axes, dim, None),
                offsets=_insert(piece.offsets, dim, k),
                sizes=_insert(piece.sizes, dim, 1),
            )
            for k, layout in enumerate(layouts)
            for piece in layout.pieces
        )
        return BlockLayout(_insert(shape, dim, len(layouts)), pieces)

    @staticmethod
    def cat(layouts: Sequence[BlockLayout], dim: int = 0) -> BlockLayout:
        dim = _normalise(dim, len(layouts[0].shape))
        pieces: list[Piece] = []
        start = 0
        for layout in layouts:
            rest = layout.shape[:dim] + layout.shape[dim + 1 :]
            if rest != layouts[0].shape[:dim] + layouts[0].shape[dim + 1 :]:
                raise ValueError(f"cat along {dim} of shapes {[list(layout.shape) for layout in layouts]}")
            for piece in layout.pieces:
                offsets = list(piece.offsets)
                offsets[dim] += start
                pieces.append(dataclasses.replace(piece, offsets=tuple(offsets)))
            start += layout.shape[dim]
        shape = list(layouts[0].shape)
        shape[dim] = start
        return BlockLayout(tuple(shape), tuple(pieces))

    def narrow(self, dim: int, start: int, length: int) -> BlockLayout:
        dim = _normalise(dim, len(self.shape))
        offsets = [0] * len(self.shape)
        sizes = list(self.shape)
        offsets[dim], sizes[dim] = start, length
        pieces = tuple(
            dataclasses.replace(
                part.piece,
                source_offsets=part.source_offsets,
                offsets=tuple(s.start for s in part.slices),
                sizes=tuple(s.stop - s.start for s in part.slices),
            )
            for part in self.blocks(offsets, sizes)
        )
        return BlockLayout(tuple(sizes), pieces)

    def _rearranged(self, arrange: Callable[[tuple], tuple]) -> BlockLayout:
        """The layout with every per-axis tuple (the shape, each piece's axes, offsets and sizes)
        passed through `arrange`."""
        pieces = tuple(
            dataclasses.replace(p, axes=arrange(p.axes), offsets=arrange(p.offsets), sizes=arrange(p.sizes))
            for p in self.pieces
        )
        return BlockLayout(arrange(self.shape), pieces)

    def transpose(self, dim0: int, dim1: int) -> BlockLayout:
        dim0, dim1 = _normalise(dim0, len(self.shape)), _normalise(dim1, len(self.shape))

        def swap(values: tuple) -> tuple:
            swapped = list(values)
            swapped[dim0], swapped[dim1] = values[dim1], values[dim0]
            return tuple(swapped)

        return self._rearranged(swap)

    def squeeze(self, dim: int) -> BlockLayout:
        dim = _normalise(dim, len(self.shape))
        if self.shape[dim] != 1:
            return self
        return self._rearranged(lambda values: values[:dim] + values[dim + 1 :])

    def unsqueeze(self, dim: int) -> BlockLayout:
        return BlockLayout.stack([self], dim)  # a stack of one: a size-1 axis no source has

    def blocks(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[PieceBlock]:
        """The pieces' parts inside the target's box at `offsets` with `sizes` (a rank's shard)."""
        for piece in self.pieces:
            low = [max(o, p) for o, p in zip(offsets, piece.offsets)]
            high = [min(o + s, p + n) for o, s, p, n in zip(offsets, sizes, piece.offsets, piece.sizes)]
            if any(lo >= hi for lo, hi in zip(low, high)):
                continue
            source_offsets = list(piece.source_offsets)
            source_sizes = [1] * len(source_offsets)
            for dim, axis in enumerate(piece.axes):
                if axis is not None:
                    source_offsets[axis] += low[dim] - piece.offsets[dim]
                    source_sizes[axis] = high[dim] - low[dim]
            slices = tuple(slice(lo - o, hi - o) for lo, hi, o in zip(low, high, offsets))
            yield PieceBlock(piece, tuple(source_offsets), tuple(source_sizes), slices)

    def extents(self) -> dict[str, tuple[int, ...]]:
        """Per source, the smallest shape that holds every box read from it."""
        ends: dict[str, list[int]] = {}
        for block in self.blocks((0,) * len(self.shape), self.shape):
            end = [o + s for o, s in zip(block.source_offsets, block.source_sizes)]
            seen = ends.setdefault(block.source, end)
            seen[:] = [max(a, b) for a, b in zip(seen, end)]
        return {source: tuple(end) for source, end in ends.items()}


def assemble(layout: BlockLayout, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The target of `layout` from whole `sources`: a view where it is one box of one source (a
    renamed tensor, one expert of a stack), else a new tensor in the first source's dtype."""
    parts = list(layout.blocks((0,) * len(layout.shape), layout.shape))
    if len(parts) == 1:
        return parts[0].source_view(sources[parts[0].source])
    first = sources[parts[0].source]
    out = torch.empty(layout.shape, dtype=first.dtype, device=first.device)
    for part in parts:
        out[part.slices].copy_(part.source_view(sources[part.source]))
    return out
