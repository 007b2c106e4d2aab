"""The three collectives the optimizer needs, over one data-parallel group.

``Collectives`` is the small interface; two backends implement it:

* ``ProcessGroupCollectives``: a ``torch.distributed`` process group (gloo, nccl, or
  torch_xla's ``xla`` backend). With a group of one rank nothing is sent.
* ``XlaReplicaCollectives``: torch_xla in-graph ops over replica groups
  (``xm.reduce_scatter`` / ``xm.all_gather``, coalesced over buckets), as torch_xla's
  and NxD's ZeRO-1 use them. They are issued even for a group of one, so the step
  compiles to the same graph shape at every size.

All reductions are sums; the caller applies the 1/world_size of a mean.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = [
    "Collectives",
    "ProcessGroupCollectives",
    "XlaReplicaCollectives",
    "make_collectives",
]


class Collectives(ABC):
    """Sum-collectives over one group; ``rank`` is this process's index in the group."""

    rank: int
    world_size: int

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a flat 1-D buffer whose length divides by ``world_size``."""
        size = flat.numel() // self.world_size
        return flat[self.rank * size : (self.rank + 1) * size]

    @abstractmethod
    def reduce_scatter_(self, flats: Sequence[torch.Tensor]) -> None:
        """In place, per buffer: ``shard(flat) = shard(sum over ranks of flat)``.

        The rest of each ``flat`` is left undefined.
        """

    @abstractmethod
    def all_gather_(self, flats: Sequence[torch.Tensor]) -> None:
        """In place, per buffer: ``flat = concat over ranks of shard(flat)``."""

    @abstractmethod
    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """``tensor = sum over ranks of tensor``, in place."""


class ProcessGroupCollectives(Collectives):
    """Collectives over a ``torch.distributed`` process group (None: the default group).

    Without an initialised default group, a ``None`` group means a single process.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.rank, self.world_size = 0, 1
            return
        if group is not None and group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given "
                f"process_group (torch.distributed.new_group returned NON_GROUP_MEMBER here); "
                f"pass the data-parallel group that contains this rank."
            )
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"process_group must be a torch.distributed ProcessGroup or None, got "
                f"{type(group).__name__}; for torch_xla replica groups pass a list of lists "
                f"of ranks to NeuronZero1Optimizer(sharding_groups=...)."
            )
        if not dist.is_initialized():
            raise ValueError(
                "a process_group was given but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first."
            )
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError(
                f"this process (global rank {dist.get_rank()}) is not a member of the given "
                f"process_group; pass the data-parallel group that contains this rank."
            )
        self.rank, self.world_size = rank, dist.get_world_size(group)

    def reduce_scatter_(self, flats):
        if self.world_size > 1:
            for flat in flats:
                dist.reduce_scatter_tensor(self.shard(flat), flat, group=self.group)

    def all_gather_(self, flats):
        if self.world_size > 1:
            for flat in flats:
                dist.all_gather_into_tensor(flat, self.shard(flat), group=self.group)

    def all_reduce_(self, tensor):
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


class XlaReplicaCollectives(Collectives):
    """torch_xla in-graph collectives over replica groups (lists of global ordinals).

    Args:
        groups: the replica groups, each a list of global ordinals, all the same size
            (None: one group of all replicas).
        pin_layout: passed to the torch_xla ops (NxD passes False).
    """

    def __init__(self, groups: Sequence[Sequence[int]] | None = None, pin_layout: bool = True):
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self._xm = xm
        me = xr.global_ordinal()
        if groups is None:
            groups = [list(range(xr.world_size()))]
        groups = [list(g) for g in groups]
        if not groups or any(not g for g in groups) or len({len(g) for g in groups}) != 1:
            raise ValueError(
                f"replica groups must be non-empty lists of ranks, all the same size, got {groups}."
            )
        mine = [g for g in groups if me in g]
        if not mine:
            raise ValueError(
                f"this process (ordinal {me}) is in none of the replica groups {groups}; "
                f"pass groups that cover every rank."
            )
        self.groups = groups
        self.pin_layout = bool(pin_layout)
        self.rank, self.world_size = mine[0].index(me), len(mine[0])

    def reduce_scatter_(self, flats):
        if not flats:
            return
        kwargs = dict(scale=1.0, scatter_dim=0, shard_count=self.world_size, groups=self.groups)
        if self.pin_layout:  # torch_xla's coalesced reduce-scatter cannot pin its layout
            results = [
                self._xm.reduce_scatter(self._xm.REDUCE_SUM, f, pin_layout=True, **kwargs)
                for f in flats
            ]
        else:
            results = self._xm.reduce_scatter(
                self._xm.REDUCE_SUM, list(flats), pin_layout=False, **kwargs
            )
        for flat, result in zip(flats, results):
            self.shard(flat).copy_(result)

    def all_gather_(self, flats):
        if not flats:
            return
        shards = [self.shard(flat) for flat in flats]
        if self.pin_layout:  # torch_xla has no coalesced all-gather with a pinned layout
            results = [
                self._xm.all_gather(s, dim=0, groups=self.groups, pin_layout=True) for s in shards
            ]
        else:
            results = self._xm.all_gather(shards, dim=0, groups=self.groups, pin_layout=False)
        for flat, result in zip(flats, results):
            flat.copy_(result)

    def all_reduce_(self, tensor):
        self._xm.all_reduce(
            self._xm.REDUCE_SUM, [tensor], groups=self.groups, pin_layout=self.pin_layout
        )


def is_replica_groups(obj: object) -> bool:
    """True for a torch_xla-style list of lists of ranks."""
    return (
        isinstance(obj, (list, tuple))
        and len(obj) > 0
        and all(isinstance(g, (list, tuple)) and all(isinstance(r, int) for r in g) for g in obj)
    )


def make_collectives(
    group: dist.ProcessGroup | Sequence[Sequence[int]] | None,
    device: torch.device,
    pin_layout: bool = True,
) -> Collectives:
    """Pick the backend for ``group`` on ``device``.

    Replica groups (lists of ranks) select the torch_xla backend; so does ``None`` on an
    XLA device when no torch.distributed group is initialised. A process group (or
    ``None`` with torch.distributed initialised) selects the process-group backend.
    """
    if is_replica_groups(group):
        if device.type != "xla":
            raise ValueError(
                f"replica groups (lists of ranks) need parameters on an XLA device, but they "
                f"are on {device}; pass a torch.distributed process group instead."
            )
        return XlaReplicaCollectives(group, pin_layout)
    if group is None and device.type == "xla" and not dist.is_initialized():
        return XlaReplicaCollectives(None, pin_layout)
    return ProcessGroupCollectives(group)
