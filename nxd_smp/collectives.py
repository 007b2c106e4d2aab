"""The three collectives the optimizer needs, over one data-parallel group.

``Collectives`` is the small interface; two backends implement it:

* ``ProcessGroupCollectives``: a ``torch.distributed`` process group (gloo, nccl, or
  torch_xla's ``xla`` backend), in place on views of flat buffers, so nothing is copied.
  With a group of one rank nothing is sent.
* ``XlaReplicaCollectives``: torch_xla in-graph ops over replica groups
  (``xm.reduce_scatter`` / ``xm.all_gather``), as torch_xla's and NxD's ZeRO-1 use them.
  They return new tensors and never slice by a Python rank: this rank's identity enters the
  graph as data (what the reduce-scatter returns, ``local_shard``'s index), so every rank
  runs one compiled program. They are issued even for a group of one, so the step compiles
  to the same graph shape at every size.

All reductions are sums; the caller applies the 1/world_size of a mean.
"""

from __future__ import annotations

import threading
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
        """This rank's slice (a view) of a flat 1-D buffer whose length divides by
        ``world_size``; for eager devices, where a Python rank costs nothing."""
        size = flat.numel() // self.world_size
        return flat[self.rank * size : (self.rank + 1) * size]

    def local_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a replicated flat tensor (the same values on every rank)."""
        return self.shard(flat)

    def begin_step(self) -> None:
        """Called when an optimizer step starts (the XLA CPU device numbers its collectives
        per step)."""

    @abstractmethod
    def reduce_scatter(self, flats: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per flat buffer, this rank's shard of the sum over ranks. The buffers may be
        overwritten (the process-group backend returns views into them)."""

    @abstractmethod
    def all_gather(
        self, shards: Sequence[torch.Tensor], outs: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Per shard, the concatenation over ranks. ``outs``: buffers to gather into (the
        process-group backend needs them, and each shard must be ``shard(out)``)."""

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

    def reduce_scatter(self, flats):
        shards = [self.shard(flat) for flat in flats]
        if self.world_size > 1:
            for flat, shard in zip(flats, shards):
                dist.reduce_scatter_tensor(shard, flat, group=self.group)
        return shards

    def all_gather(self, shards, outs=None):
        if outs is None:
            raise ValueError("the process-group backend gathers in place: pass the output buffers.")
        if self.world_size > 1:
            for out, shard in zip(outs, shards):
                dist.all_gather_into_tensor(out, shard, group=self.group)
        return list(outs)

    def all_reduce_(self, tensor):
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)


# The XLA CPU device runs replicas as threads and matches the replicas of a collective by
# its kind and channel id. Two things make that reliable: every collective of a step has a
# channel id of its own (one id for all of them let a fast replica join the next
# collective's rendezvous while a slow one was still in the previous one), numbered from 1
# at each step so every step compiles to the same graph; and each collective's input waits
# for the previous collective's output (an optimization barrier), since XLA:CPU runs a
# replica's independent collectives in an order of its own. State per replica thread,
# shared by every group.
_xla_cpu = threading.local()


def restart_channel_ids() -> None:
    """Number the next collectives on the XLA CPU device from 1 again (per thread)."""
    _xla_cpu.next_channel = 1


def _next_channel_id() -> int:
    channel = getattr(_xla_cpu, "next_channel", 1)
    _xla_cpu.next_channel = channel + 1
    return channel


class XlaReplicaCollectives(Collectives):
    """torch_xla in-graph collectives over replica groups (lists of global ordinals).

    Args:
        groups: the replica groups, each a list of global ordinals, all the same size
            (None: one group of all replicas).
        pin_layout: passed to the torch_xla ops (NxD passes False). With it off, the buckets
            of one step go out as one coalesced collective.

    On the XLA CPU device (where replicas are threads of one process) every collective is a
    single-tensor op with a channel id, which is how XLA:CPU matches the replicas of one
    collective, and runs after the previous one; ``pin_layout`` and coalescing do not apply
    there. Elsewhere (Neuron) no channel id is added.

    torch_xla orders its collectives through a numeric token: each one's input gets
    ``+ token`` and the token becomes ``token * result[0]``. An inf at the start of one
    result (an fp16 overflow) makes the token NaN and every later collective's input NaN,
    the parameters' all-gather included, so a step the loss scaler skips would still write
    NaN parameters. Each collective here starts from a fresh token and leaves a fresh one.
    """

    def __init__(self, groups: Sequence[Sequence[int]] | None = None, pin_layout: bool = True):
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self._xm = xm
        self._xlac = torch_xla._XLAC
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
        self._cpu = xr.device_type() == "CPU"
        self._rank_index: dict[torch.device, torch.Tensor] = {}

    def local_shard(self, flat):
        # Rank as data: a gather with this rank's index, the same program on every rank.
        index = self._rank_index.get(flat.device)
        if index is None:
            index = self._rank_index[flat.device] = torch.tensor([self.rank], device=flat.device)
        return flat.view(self.world_size, -1).index_select(0, index).view(-1)

    def begin_step(self) -> None:
        if self._cpu:
            restart_channel_ids()

    def _run(self, op, tensor: torch.Tensor, **kwargs):
        """One collective op on ``tensor``, fenced from torch_xla's numeric token (fresh in,
        fresh out); on the XLA CPU device also ordered after the previous collective and
        given a channel id of its own."""
        self._xlac._set_all_reduce_token(self._xlac._xla_get_default_device(), None)
        try:
            if not self._cpu:
                return op(tensor, **kwargs)
            last = getattr(_xla_cpu, "last", None)
            if last is not None:
                self._xm.optimization_barrier_([tensor, last])
            out = op(tensor, channel_id=_next_channel_id(), **kwargs)
            _xla_cpu.last = out.reshape(-1)[:1]
            return out
        finally:
            self._xlac._set_all_reduce_token(self._xlac._xla_get_default_device(), None)

    def _per_bucket(self, op, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``op`` over each tensor; coalesced into one collective where torch_xla allows it
        (``pin_layout`` off, not the XLA CPU device, more than one bucket)."""
        if self._cpu:
            return [self._run(op, t, pin_layout=False) for t in tensors]
        if self.pin_layout or len(tensors) < 2:  # torch_xla's coalesced forms cannot pin their layout
            return [self._run(op, t, pin_layout=self.pin_layout) for t in tensors]
        return list(self._run(op, list(tensors), pin_layout=False))

    def reduce_scatter(self, flats):
        xm = self._xm

        def op(t, **kwargs):
            return xm.reduce_scatter(xm.REDUCE_SUM, t, scale=1.0, scatter_dim=0, shard_count=self.world_size,
                                     groups=self.groups, **kwargs)

        return self._per_bucket(op, flats)

    def all_gather(self, shards, outs=None):
        xm = self._xm

        def op(t, **kwargs):
            return xm.all_gather(t, dim=0, groups=self.groups, **kwargs)

        return self._per_bucket(op, shards)

    def all_reduce_(self, tensor):
        if self._cpu:
            # No all-reduce form takes a channel id of our choosing: gather and add up (these
            # are norms, a few elements), in the group's order, the same on every rank.
            gathered = self._run(
                lambda t, **kw: self._xm.all_gather(t.reshape(1, -1), dim=0, groups=self.groups, **kw),
                tensor, pin_layout=False)
            result = gathered.sum(dim=0).view(tensor.shape)
        else:
            result = self._run(
                lambda t: self._xm.all_reduce(self._xm.REDUCE_SUM, t, groups=self.groups, pin_layout=self.pin_layout),
                tensor)
        tensor.copy_(result)


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
