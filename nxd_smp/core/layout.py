"""Bucket layout as pure arithmetic on element counts (no tensors, no communication).

Parameters are packed, in the order given, into flat buckets. A bucket holds
parameters of one (param group, dtype, device) only and is padded to a multiple of
``world_size * ALIGN`` elements, so that rank ``r`` owns the contiguous slice
``[r * shard_numel, (r + 1) * shard_numel)`` of every bucket and every shard starts on
a 64-byte boundary in fp32. A new bucket starts when the next parameter would push the
current one past ``cap_numel`` elements; a parameter larger than the cap gets a bucket
of its own. Parameters are never split across buckets.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

#: Elements per alignment unit: 16 fp32 elements = 64 bytes.
ALIGN = 16


def padded_numel(numel: int, world_size: int, align: int = ALIGN) -> int:
    """Smallest multiple of ``world_size * align`` that is >= ``numel`` (and >= one unit)."""
    if numel < 0 or world_size < 1 or align < 1:
        raise ValueError(f"bad layout sizes: numel={numel}, world_size={world_size}, align={align}")
    unit = world_size * align
    return max(1, -(-numel // unit)) * unit


def shard_range(padded: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s shard in a bucket of ``padded`` elements."""
    if padded % world_size:
        raise ValueError(f"{padded} elements do not split evenly over {world_size} ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    size = padded // world_size
    return rank * size, (rank + 1) * size


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The overlap of two half-open ranges, or None when they do not overlap."""
    start, end = max(a[0], b[0]), min(a[1], b[1])
    return (start, end) if start < end else None


class BucketKey(NamedTuple):
    """What the parameters of one optimizer bucket share: their param group (index), dtype, role
    in the gradient norm (``"replicated"``, ``"split"`` or ``"shared"``), and whether their
    gradients are summed over the tensor-parallel group first (sequence parallelism)."""

    group: int
    dtype: Any
    role: str = "replicated"
    sequence_parallel: bool = False


@dataclass(frozen=True)
class BucketLayout:
    """Where each parameter of one bucket lives in the flat buffer.

    Attributes:
        key: what the bucket's parameters share (an optimizer's: a ``BucketKey``).
        param_indices: indices of the parameters (into the caller's list), in order.
        offsets: start of each parameter in the flat buffer, in elements.
        numels: element count of each parameter.
        padded_numel: buffer length: the sum of ``numels`` rounded up to a multiple of
            ``world_size * ALIGN``.
        world_size: number of shards.
    """

    key: Hashable
    param_indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    padded_numel: int
    world_size: int

    @property
    def numel(self) -> int:
        """Elements used by parameters (without padding)."""
        return self.offsets[-1] + self.numels[-1] if self.numels else 0

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return shard_range(self.padded_numel, self.world_size, rank)

    def param_range(self, i: int) -> tuple[int, int]:
        """``[start, end)`` of the ``i``-th parameter of this bucket in the flat buffer."""
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def pieces(self, rank: int) -> list["Piece"]:
        """The parts of this bucket's parameters that ``rank``'s shard holds, in order."""
        shard = self.shard_range(rank)
        out = []
        for i in range(len(self.param_indices)):
            overlap = intersect(self.param_range(i), shard)
            if overlap is not None:
                start, end = overlap
                out.append(Piece(i, start - self.offsets[i], end - self.offsets[i], start - shard[0]))
        return out


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_start, param_end)`` of a flattened parameter (the
    ``index``-th of its bucket), stored from ``shard_start`` in a rank's shard."""

    index: int
    param_start: int
    param_end: int
    shard_start: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


def param_pieces(layouts: Sequence[BucketLayout], rank: int) -> list[tuple[int, Piece | None]]:
    """The one walk over where each parameter lies: per parameter of the layouts (their
    ``param_indices`` number them, from 0), its bucket and the ``Piece`` of it that ``rank``'s shard
    holds, None where it holds none. A parameter lies in one bucket and a shard is contiguous: at most
    one piece each."""
    places: list[tuple[int, Piece | None]] = [(-1, None)] * sum(len(layout.param_indices) for layout in layouts)
    for b, layout in enumerate(layouts):
        for i in layout.param_indices:
            places[i] = (b, None)
        for piece in layout.pieces(rank):
            places[layout.param_indices[piece.index]] = (b, piece)
    return places


def saved_pieces(layouts: Sequence[BucketLayout], world_size: int, names: Sequence[str]
                 ) -> dict[str, list[tuple[int, int]]]:
    """Per parameter name (``names``: in layout order), the ``[start, end)`` ranges all ``world_size``
    ranks hold, sorted: what a checkpoint records of how its pieces cut each parameter."""
    pieces: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for rank in range(world_size):
        for name, (_, piece) in zip(names, param_pieces(layouts, rank)):
            if piece is not None:
                pieces[name].append((piece.param_start, piece.param_end))
    return {name: sorted(ranges) for name, ranges in pieces.items()}


def plan_buckets(
    numels: Sequence[int],
    keys: Sequence[Hashable],
    world_size: int,
    cap_numel: int | None,
    align: int = ALIGN,
) -> list[BucketLayout]:
    """Pack parameters into buckets.

    Args:
        numels: element count of each parameter, in layout order.
        keys: for each parameter, what its bucket must share (e.g. group, dtype, device).
            Buckets are emitted per key in order of the key's first appearance.
        world_size: number of shards each bucket is split into.
        cap_numel: largest bucket, in elements (None: no limit). A parameter larger
            than the cap gets a bucket of its own.

    Returns:
        The buckets, each listing its parameters by index into ``numels``.
    """
    if len(numels) != len(keys):
        raise ValueError(f"{len(numels)} sizes but {len(keys)} keys")
    if cap_numel is not None and cap_numel < 1:
        raise ValueError(f"cap_numel must be >= 1 or None, got {cap_numel}")
    by_key: dict[Hashable, list[int]] = {}
    for index, key in enumerate(keys):
        by_key.setdefault(key, []).append(index)

    buckets: list[BucketLayout] = []
    for key, indices in by_key.items():
        current: list[int] = []
        used = 0
        for index in indices:
            n = numels[index]
            if current and cap_numel is not None and used + n > cap_numel:
                buckets.append(_bucket(key, current, numels, world_size, align))
                current, used = [], 0
            current.append(index)
            used += n
        if current:
            buckets.append(_bucket(key, current, numels, world_size, align))
    return buckets


def _bucket(
    key: Hashable, indices: list[int], numels: Sequence[int], world_size: int, align: int
) -> BucketLayout:
    offsets, sizes, offset = [], [], 0
    for index in indices:
        offsets.append(offset)
        sizes.append(numels[index])
        offset += numels[index]
    return BucketLayout(
        key=key,
        param_indices=tuple(indices),
        offsets=tuple(offsets),
        numels=tuple(sizes),
        padded_numel=padded_numel(offset, world_size, align),
        world_size=world_size,
    )
