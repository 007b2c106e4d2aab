"""A rank's flat range of one parameter's optimizer state, as a tensor torch's distributed
checkpoint can plan (``FlatShard``).

ZeRO-1 cuts flat buckets, so a rank holds one contiguous range ``[start, start + n)`` of a
parameter's flattened elements: in general no ``Shard`` placement of a DTensor. torch's
distributed checkpoint (``dcp.save``/``dcp.load``, through ``get_optimizer_state_dict``) plans a
tensor by its global shape and the boxes (chunks) each rank holds of it. A flat range of an
N-d tensor is at most 2N-1 boxes, each contiguous in row-major order (``boxes``); under tensor
parallelism the parameter's local part sits at a global offset, added to every box.

``FlatShard`` is a wrapper tensor of the parameter's global shape whose data is the range only.
It answers the three questions the checkpoint planner asks (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``: the boxes, and views of the range for each),
so every rank writes only what it owns and ``dcp.load`` writes straight into the range. Nothing
else computes with it: an operation it does not know is refused by name. It pickles as its
range (a plain 1-D tensor), so ``torch.save`` of a state dict holding it loads with
``weights_only=True`` anywhere; copies (``copy.deepcopy``, DCP's asynchronous staging) stay
``FlatShard``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]


def boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes ``(offsets, sizes)`` that elements ``[start, end)`` of a row-major tensor of ``shape``
    fill, in order, each contiguous: at most ``2 * len(shape) - 1`` (one for a 0-dim tensor)."""
    shape = tuple(int(s) for s in shape)
    if start >= end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(0 for _ in shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last and not (start % inner == 0 and end - start == inner):
        return [((first, *o), (1, *s)) for o, s in boxes(shape[1:], start - first * inner, end - first * inner)]
    out: list[Box] = []
    whole_from = first
    if start % inner:
        out += [((first, *o), (1, *s)) for o, s in boxes(shape[1:], start % inner, inner)]
        whole_from = first + 1
    whole_to = end // inner
    if whole_to > whole_from:
        out.append(((whole_from, *rest), (whole_to - whole_from, *shape[1:])))
    if end % inner:
        out += [((whole_to, *o), (1, *s)) for o, s in boxes(shape[1:], 0, end % inner)]
    return out


_COPYING = {"clone", "_to_copy"}


class FlatShard(torch.Tensor):
    """Elements ``[start, start + local.numel())`` of a parameter's local part (of shape
    ``local_shape``, at ``global_offset`` in a tensor of ``global_shape``), held by ``local`` (1-D)."""

    _local: torch.Tensor
    start: int
    local_shape: tuple[int, ...]
    global_offset: tuple[int, ...]

    @staticmethod
    def __new__(cls, local: torch.Tensor, start: int, local_shape: Sequence[int],
                global_shape: Sequence[int] | None = None, global_offset: Sequence[int] | None = None) -> FlatShard:
        local_shape = tuple(int(s) for s in local_shape)
        global_shape = local_shape if global_shape is None else tuple(int(s) for s in global_shape)
        global_offset = tuple(0 for _ in local_shape) if global_offset is None else tuple(int(o) for o in global_offset)
        if local.dim() != 1 or start < 0 or start + local.numel() > math.prod(local_shape) \
                or len(global_shape) != len(local_shape) or len(global_offset) != len(local_shape) \
                or any(o + s > g for o, s, g in zip(global_offset, local_shape, global_shape)):
            raise ValueError(f"a FlatShard of {local.numel()} elements from {start} does not lie in a local part of "
                             f"shape {local_shape} at {global_offset} of {global_shape}.")
        self = torch.Tensor._make_wrapper_subclass(cls, global_shape, dtype=local.dtype, device=local.device,
                                                   requires_grad=False)
        self._local, self.start, self.local_shape, self.global_offset = local, int(start), local_shape, global_offset
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def local(self) -> torch.Tensor:
        """The range's elements, a 1-D tensor."""
        return self._local

    @property
    def end(self) -> int:
        return self.start + self._local.numel()

    def _with(self, local: torch.Tensor) -> FlatShard:
        return FlatShard(local, self.start, self.local_shape, tuple(self.shape), self.global_offset)

    def _boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """The range's boxes in global coordinates, each with where its elements start in ``local``."""
        out, at = [], 0
        for offsets, sizes in boxes(self.local_shape, self.start, self.end):
            out.append((tuple(o + g for o, g in zip(offsets, self.global_offset)), sizes, at))
            at += math.prod(sizes)
        return out

    # ---------------------------------------------------------------- torch.distributed.checkpoint
    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self._local)
        items = []
        for offsets, sizes, _ in self._boxes():
            chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            items.append(WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape)))
        return items

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes, _ in self._boxes()]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        for offsets, sizes, at in self._boxes():
            if torch.Size(offsets) == index.offset:
                return self._local[at:at + math.prod(sizes)].view(sizes)
        raise ValueError(f"nxd_smp's FlatShard of {index.fqn!r} holds no chunk at {tuple(index.offset or ())}.")

    # ---------------------------------------------------------------- copies and pickling
    def __reduce_ex__(self, protocol: int) -> Any:
        return self._local.__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatShard:
        if id(self) not in memo:
            memo[id(self)] = self._with(self._local.clone())
        return memo[id(self)]

    def __repr__(self) -> str:  # type: ignore[override]
        return (f"FlatShard(elements [{self.start}, {self.end}) of a local part {self.local_shape} at "
                f"{self.global_offset} of {tuple(self.shape)}, {self.dtype}, {self._local.device})")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        this = args[0] if args and isinstance(args[0], FlatShard) else None
        if this is None:
            pass  # (a FlatShard as another operand: refused below)
        elif name in ("detach", "alias"):
            return this._with(this._local)
        elif name in _COPYING:
            return this._with(func(this._local, *args[1:], **kwargs))
        elif name in ("new_empty", "empty_like"):  # (DCP's staging copies the attributes in afterwards)
            return this._with(torch.empty(0, dtype=kwargs.get("dtype") or this.dtype,
                                          device=kwargs.get("device") or this._local.device))
        elif name == "copy_" and isinstance(args[1], FlatShard) and (args[1].start, args[1].end) == (
                this.start, this.end):
            this._local.copy_(args[1]._local, **kwargs)
            return this
        raise TypeError(
            f"{func} on nxd_smp's FlatShard: it holds one rank's flat range of a parameter's optimizer state, for "
            f"torch.distributed.checkpoint to plan (dcp.save/dcp.load) and torch.save to write; .local holds the "
            f"elements. A full (gathered) optimizer state is nxd_smp.checkpoint's to write.")
