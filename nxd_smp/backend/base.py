"""What a backend is: the interface the optimizer, the gradient norm and the checkpoints
talk to, and the pure arithmetic that turns one group form into another."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import torch
import torch.distributed as dist

from ..core.errors import ConfigError

if TYPE_CHECKING:
    from ..core.layout import BucketLayout
    from .coordination import Coordinator


#: A data-parallel group as users pass it: a torch.distributed process group, torch_xla
#: replica groups (a list of lists of global ranks), or None (every rank).
GroupSpec = Union[dist.ProcessGroup, Sequence[Sequence[int]], None]
#: A tensor- or pipeline-parallel group spec: the same forms, or a list of process groups.
NormGroupSpec = Union[dist.ProcessGroup, Sequence[dist.ProcessGroup], Sequence[Sequence[int]], None]


def is_replica_groups(obj: object) -> bool:
    """True for a torch_xla-style list of lists of ranks."""
    return (
        isinstance(obj, (list, tuple))
        and len(obj) > 0
        and all(isinstance(g, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in g)
                for g in obj)
    )


def check_replica_groups(groups: Sequence[Sequence[int]], world_size: int) -> list[list[int]]:
    """``groups`` as lists, checked to be a partition of ``range(world_size)`` into groups of
    one size (what an XLA collective's replica groups must be).

    Raises:
        ValueError: naming what is wrong and the fix.
    """
    groups = [list(g) for g in groups]
    if not groups or any(not g for g in groups) or len({len(g) for g in groups}) != 1:
        raise ConfigError(f"replica groups must be non-empty lists of ranks, all the same size, got {groups}.")
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(world_size)):
        raise ConfigError(
            f"replica groups {groups} do not split the {world_size} ranks into groups (each rank "
            f"exactly once); pass groups that cover ranks 0..{world_size - 1}, e.g. NxD's "
            f"get_data_parallel_replica_groups()."
        )
    return groups


def replica_partition(ranks: Sequence[int], world_size: int) -> list[list[int]]:
    """The replica groups of which ``ranks`` (one process group's global ranks) is one.

    An XLA collective names every group of the step, and every rank must build the same
    program, so one group's ranks are completed into a partition of the world: the world
    itself, consecutive blocks (``[2, 3]`` of 4: ``[[0, 1], [2, 3]]``) or evenly strided
    slices (``[1, 3]`` of 4: ``[[0, 2], [1, 3]]``), the layouts NxD's parallel state makes.

    Raises:
        ValueError: ``ranks`` is none of those layouts.
    """
    ranks = sorted(ranks)
    n = len(ranks)
    if n == 0 or world_size % n or ranks[0] < 0 or ranks[-1] >= world_size or len(set(ranks)) != n:
        raise ConfigError(
            f"the process group's ranks {ranks} cannot be one of equal groups of a world of {world_size}."
        )
    if ranks == list(range(ranks[0], ranks[0] + n)) and ranks[0] % n == 0:
        return [list(range(start, start + n)) for start in range(0, world_size, n)]
    stride = world_size // n
    if ranks == list(range(ranks[0], world_size, stride)) and ranks[0] < stride:
        return [list(range(start, world_size, stride)) for start in range(stride)]
    raise ConfigError(
        f"the process group's ranks {ranks} are neither consecutive blocks nor an evenly strided "
        f"slice of the {world_size} ranks, so the other groups of the step cannot be inferred; pass "
        f"every group as replica groups (a list of lists of ranks) instead."
    )


class PendingShard:
    """A reduce-scatter under way: ``wait()`` returns this rank's shard of the sum.

    Args:
        shard: where the result is (or will be).
        work: torch.distributed's handle of an asynchronous collective, or None (done).
        source: the input buffer, kept alive until the collective is done.
    """

    def __init__(self, shard: torch.Tensor, work: object = None, source: torch.Tensor | None = None):
        self._shard, self._work, self._source = shard, work, source

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = self._source = None
        return self._shard


class Backend(ABC):
    """Everything that depends on the device, decided once when an optimizer is built.

    Attributes:
        device: where the parameters live.
        rank, world_size: this rank's index in the data-parallel group and the group's size
            (host integers; on XLA they never enter a graph).
        default_bucket_cap_mb: the bucket size when the caller chose none.
        persistent_grad_buffers: gradients accumulate into one persistent flat buffer per
            bucket (eager) rather than per-parameter tensors joined at step time (XLA).
        has_fused_kernels: torch.optim's fused kernels exist for this device.
        fused_grad_scale: those kernels take the clip coefficient as ``grad_scale`` (and a
            skipped step as ``found_inf``); where not known to, the gradient is scaled before
            the step and a skipped step undone after it.
        holds_dtensors: DTensor parameters can be managed through their local parts.
        step_counter_on_device: a step skipped on an overflow must be undone inside the
            step's graph, so the inner optimizer keeps its ``step`` on the device.
        param_shard_is_storage: ``param_shard(b)`` is a writable view of the parameters'
            own memory (so bf16 shards can be updated in place without master weights).
        host_rank_slices: a part of this rank's shard may be cut with host integers derived
            from ``rank`` (False on XLA, where the rank enters a graph only as data, so that
            every rank runs one program: there a part is selected with a mask).
        fp32: the torch dtype this device stores as fp32, for master weights, optimizer
            states, fp32 accumulation and norms: ``torch.float32``, or ``torch.float64`` on an
            XLA device under ``XLA_DOWNCAST_BF16=1`` (which stores float32 as bf16).
    """

    device: torch.device
    rank: int
    world_size: int
    default_bucket_cap_mb: float
    persistent_grad_buffers: bool
    has_fused_kernels: bool
    fused_grad_scale: bool = False
    holds_dtensors: bool = False
    step_counter_on_device: bool
    param_shard_is_storage: bool
    host_rank_slices: bool = True
    fp32: torch.dtype = torch.float32

    def device_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype the device holds a tensor of torch dtype ``dtype`` in (what checkpoints
        record): ``dtype`` itself, except on an XLA device under torch_xla's bf16 switches."""
        return dtype

    @property
    @abstractmethod
    def global_ranks(self) -> list[int]:
        """The group's members as global ranks (XLA ordinals on an XLA device), in rank order."""

    # ---------------------------------------------------------------- collectives (sums)
    def begin_step(self) -> None:
        """An optimizer step starts (the XLA CPU device numbers its collectives per step)."""

    @abstractmethod
    def reduce_scatter(
        self, flats: Sequence[torch.Tensor], into: Sequence[torch.Tensor | None] | None = None
    ) -> list[torch.Tensor]:
        """Per flat buffer (length divisible by ``world_size``), this rank's shard of the sum
        over ranks. The buffers may be overwritten. ``into``: per buffer, an optional tensor
        of the same length whose shard may hold the result (eager devices reuse memory)."""

    def reduce_scatter_start(self, flat: torch.Tensor, out: torch.Tensor | None = None) -> PendingShard:
        """Start the reduce-scatter of one flat buffer from a backward hook; ``wait()`` on
        the result gives this rank's shard of the sum (in ``out`` where given, on devices
        that write in place). Eager devices launch it asynchronously (it overlaps the rest of
        backward); on XLA it is traced into the backward graph, where the compiler schedules it."""
        return PendingShard(self.reduce_scatter([flat])[0])

    @abstractmethod
    def all_reduce_(self, tensor: torch.Tensor) -> None:
        """``tensor = sum over ranks of tensor``, in place."""

    def all_reduce_many_(self, tensors: Sequence[torch.Tensor], bucket_cap_bytes: int = 512 << 20) -> None:
        """``all_reduce_`` of each of ``tensors``, bucketed: consecutive tensors of one dtype
        are joined into flat buckets of at most ``bucket_cap_bytes`` (a larger tensor goes
        alone), one collective each, as NxD buckets its data-parallel all-reduce (512 MB)."""
        buckets: dict[torch.dtype, list[torch.Tensor]] = {}
        filled: dict[torch.dtype, int] = {}

        def flush(dtype: torch.dtype) -> None:
            bucket = buckets.pop(dtype, [])
            filled.pop(dtype, None)
            if not bucket:
                return
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.all_reduce_(flat)
            torch._foreach_copy_(bucket, [part.view_as(t) for part, t in zip(flat.split([t.numel() for t in bucket]), bucket)])

        for t in tensors:
            size = t.numel() * t.element_size()
            if buckets.get(t.dtype) and filled[t.dtype] + size > bucket_cap_bytes:
                flush(t.dtype)
            buckets.setdefault(t.dtype, []).append(t)
            filled[t.dtype] = filled.get(t.dtype, 0) + size
        for dtype in list(buckets):
            flush(dtype)

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (1-D, of one length on every rank) joined in rank order: a new
        tensor of ``world_size`` times its length, on the device."""

    @abstractmethod
    def local_shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's part of a flat tensor that holds the same values on every rank."""

    # ---------------------------------------------------------------- parameters
    @abstractmethod
    def place_params(self, params: Sequence[torch.Tensor], layouts: Sequence[BucketLayout]) -> None:
        """Take over the storage of ``params`` (in layout order) for buckets ``layouts``."""

    @abstractmethod
    def param_shard(self, b: int) -> torch.Tensor:
        """This rank's shard of bucket ``b``'s current parameter values (flat, padded)."""

    @abstractmethod
    def publish(self, shards: Sequence[torch.Tensor]) -> None:
        """Make every rank's parameters the gathered ``shards`` (one per bucket, any float
        dtype; cast to the parameter dtype)."""

    def adopt_param_storage(self) -> list[int]:
        """Take back parameters whose storage was replaced behind the backend's back by a tensor
        of the same dtype on the same device (their new values kept); return their indices.

        Raises:
            RuntimeError: a parameter was moved to another device or dtype.
        """
        return []

    def bitcast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``tensor``'s bits read as ``dtype`` (of the same size), on the device."""
        return tensor.view(dtype)

    def update_in_place(self, tensors: Sequence[torch.Tensor]) -> None:
        """``tensors`` (the masters and optimizer states a step wrote) are each to be written into
        their own buffer (eager devices: they already are)."""

    # ---------------------------------------------------------------- host side
    def random_generator(self, seed: int) -> torch.Generator | None:
        """A generator for this rank's random draws (None: the device's default one)."""
        return None

    @abstractmethod
    def to_host(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
        """CPU tensors with the values of ``tensors``, each in the dtype the device holds it in
        (``device_dtype``), and whether they are copies (False: some may be the live tensors
        themselves)."""

    @property
    @abstractmethod
    def coordinator(self) -> Coordinator:
        """Host-side coordination of the data-parallel group (checkpoints)."""

    @property
    @abstractmethod
    def world_coordinator(self) -> Coordinator:
        """Host-side coordination of every rank of the job (its tensor- and pipeline-parallel peers
        too): a load's verdict is world-wide (``agreement.agree``)."""

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The torch.distributed group the collectives run on (None: none, or the default)."""
        return None
