"""Which saved pieces a rank reads into its new shards: pure arithmetic on element ranges,
beside ``core.layout`` (no tensors, no files).

A checkpoint keeps every sharded state tensor as pieces of the flattened parameter, each
``[start, end)`` of one parameter as one rank held it at the DP size it was saved at. A rank
loading at another DP size holds other pieces (``BucketLayout.pieces``); for each of them,
``overlaps`` says which parts of which saved pieces land where in its shard. A saved piece
that lies wholly inside one of the rank's pieces is read straight into the shard; one that
straddles a shard boundary is read whole and the overlap copied.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..core.layout import BucketLayout, Piece


def named_pieces(
    layouts: Sequence[BucketLayout], rank: int, names: Sequence[str]
) -> Iterator[tuple[int, str, Piece]]:
    """``(bucket, parameter name, piece)`` for every piece of ``rank``'s shard of every
    bucket, in order (``names``: the parameters' names in layout order)."""
    for b, layout in enumerate(layouts):
        for piece in layout.pieces(rank):
            yield b, names[layout.param_indices[piece.index]], piece


def saved_pieces(layouts: Sequence[BucketLayout], world_size: int, names: Sequence[str]) -> dict[str, list[tuple[int, int]]]:
    """Per parameter name, the ``[start, end)`` ranges all ``world_size`` ranks hold, sorted:
    what a checkpoint records of how its pieces cut each parameter."""
    pieces: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for rank in range(world_size):
        for _, name, piece in named_pieces(layouts, rank, names):
            pieces[name].append((piece.param_start, piece.param_end))
    return {name: sorted(ranges) for name, ranges in pieces.items()}


@dataclass(frozen=True)
class Overlap:
    """Elements ``[saved_start + src, saved_start + src + numel)`` of the saved piece
    ``[saved_start, saved_end)`` go to ``[dst, dst + numel)`` of the loading rank's shard.
    ``whole``: the saved piece lies inside the rank's piece (``src`` is 0, ``numel`` its length)."""

    saved_start: int
    saved_end: int
    src: int
    dst: int
    numel: int
    whole: bool


def overlaps(saved: Sequence[tuple[int, int]], piece: Piece) -> list[Overlap]:
    """The parts of the saved pieces ``saved`` (ranges of one parameter) that ``piece`` of a
    loading rank's shard holds, each with where it lands in that shard."""
    out = []
    for lo, hi in saved:
        start, end = max(lo, piece.param_start), min(hi, piece.param_end)
        if start >= end:
            continue
        out.append(Overlap(lo, hi, start - lo, piece.shard_start + (start - piece.param_start), end - start,
                           lo >= piece.param_start and hi <= piece.param_end))
    return out
