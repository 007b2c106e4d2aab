"""The eager backend (CPU, CUDA): parameters as views into flat buffers, torch.distributed
collectives in place on views of those buffers.

A process group of one rank (or no torch.distributed at all) sends nothing. Replica-group
lists (NxD's form) are turned into process groups here, every rank creating the same groups
in the same order, as ``torch.distributed.new_group`` requires.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core.errors import ConfigError
from ..core.dtensors import DeviceMesh
from ..core.layout import BucketLayout
from ..core.memory import plain_alias, staggered_empty
from .base import Backend, GroupSpec, PendingShard, check_replica_groups, is_replica_groups
from .coordination import Coordinator, LocalCoordinator, ProcessGroupCoordinator


#: 128 MiB of fp32 gradient (32M elements): the fused kernels run over a few large shards.
#: NxD reports NaNs on Neuron above ~140 MB, so stay below that everywhere.
DEFAULT_BUCKET_CAP_MB = 128.0

_translated: dict[tuple[int, tuple[tuple[int, ...], ...]], dist.ProcessGroup] = {}

# torch 2.13 deprecates the ``*_tensor`` names for the ``*_single`` ones (same arguments); torch 2.9 has
# only the former.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


#: Device types whose fused AdamW/Adam/SGD kernels are known to take ``grad_scale`` and ``found_inf``
#: (torch's CPU and CUDA kernels, tested here). Another device's fused kernel (a PrivateUse1 device such as
#: Trainium's ``neuron``) gets gradients already scaled.
FUSED_GRAD_SCALE_DEVICES = ("cpu", "cuda")


def _fused_kernel_devices() -> tuple[str, ...]:
    """The device types torch.optim offers ``fused=True`` on (torch's own list, which names the
    PrivateUse1 backend when one is registered)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        return tuple(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - the list moved
        return FUSED_GRAD_SCALE_DEVICES


def _dist_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def _from_replica_groups(groups: Sequence[Sequence[int]]) -> dist.ProcessGroup | None:
    """This rank's process group among replica ``groups`` (every rank creates all of them,
    in order; made once per default group). Without torch.distributed, ``[[0]]`` (NxD's
    groups in a process of its own) is this process alone: None."""
    if not _dist_active():
        if [list(g) for g in groups] == [[0]]:
            return None
        raise ConfigError(
            f"replica groups {[list(g) for g in groups]} were given but torch.distributed is not initialised; "
            f"call torch.distributed.init_process_group(...) first, or pass None."
        )
    groups = check_replica_groups(groups, dist.get_world_size())
    key = (id(dist.group.WORLD), tuple(tuple(g) for g in groups))
    if key not in _translated:
        from torch.distributed import distributed_c10d

        me, mine = dist.get_rank(), None
        for g in groups:
            created = distributed_c10d.new_group(g)
            if me in g:
                mine = created
        _translated[key] = mine
    return _translated[key]


def _check_group(group: object) -> dist.ProcessGroup | None:
    if group is None:
        return None
    if DeviceMesh is not None and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ConfigError(f"a {group.ndim}-dimensional DeviceMesh was given as the process group; pass its "
                             f"data-parallel dimension (mesh['dp']) or device_mesh=mesh.")
        group = group.get_group()
    if is_replica_groups(group):
        return _from_replica_groups(group)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ConfigError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given process "
            f"group (torch.distributed.new_group returned NON_GROUP_MEMBER here); pass the "
            f"data-parallel group that contains this rank."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup, replica groups (a list of "
            f"lists of ranks) or None, got {type(group).__name__}."
        )
    if not _dist_active():
        raise ConfigError(
            "a process_group was given but torch.distributed is not initialised; call "
            "torch.distributed.init_process_group(...) first."
        )
    if dist.get_rank(group) < 0:
        raise ConfigError(
            f"this process (global rank {dist.get_rank()}) is not a member of the given "
            f"process_group; pass the data-parallel group that contains this rank."
        )
    return group


class EagerBackend(Backend):
    """CPU and CUDA: torch.distributed over ``group`` (None: the default group, or a single
    process without torch.distributed)."""

    default_bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    persistent_grad_buffers = True
    step_counter_on_device = False
    param_shard_is_storage = True
    holds_dtensors = True

    def __init__(self, device: torch.device, group: GroupSpec = None):
        self.device = device
        self.has_fused_kernels = device.type in _fused_kernel_devices()
        self.fused_grad_scale = device.type in FUSED_GRAD_SCALE_DEVICES
        self.group = _check_group(group)
        self._built_alone = not _dist_active()  # before torch.distributed was initialised
        if _dist_active():
            self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        else:
            self.rank, self.world_size = 0, 1
        self._flat_params: list[torch.Tensor] = []
        self._params: list[torch.Tensor] = []
        self._home_pointers: list[int] = []  # where each parameter's storage starts in its flat buffer
        self._homes: dict[int, torch.Tensor] = {}  # parameter index -> its slice of a flat buffer
        self._coordinator: Coordinator | None = None
        self._world_coordinator: Coordinator | None = None

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.group

    @property
    def global_ranks(self) -> list[int]:
        if not _dist_active():
            return [0]
        return dist.get_process_group_ranks(self.group or dist.group.WORLD)

    # ---------------------------------------------------------------- collectives
    def _shard(self, flat: torch.Tensor) -> torch.Tensor:
        size = flat.numel() // self.world_size
        return flat[self.rank * size : (self.rank + 1) * size]

    local_shard = _shard

    def reduce_scatter(self, flats, into=None):
        shards = [self._shard(flat) for flat in flats]
        if self.world_size > 1:
            for flat, shard in zip(flats, shards):
                _reduce_scatter(shard, flat, group=self.group)
        return shards if into is None else [
            self._shard(spare).copy_(shard) if spare is not None and spare.dtype != shard.dtype else shard
            for shard, spare in zip(shards, into)
        ]

    def reduce_scatter_start(self, flat: torch.Tensor, out: torch.Tensor | None = None) -> PendingShard:
        if out is None:
            out = torch.empty(flat.numel() // self.world_size, dtype=flat.dtype, device=flat.device)
        if self.world_size == 1:
            return PendingShard(out.copy_(flat))
        work = _reduce_scatter(out, flat, group=self.group, async_op=True)
        return PendingShard(out, work, flat)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor.clone()
        out = torch.empty(self.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        _all_gather(out, tensor.contiguous(), group=self.group)
        return out

    def begin_step(self) -> None:
        """Refuse to step alone among ranks: an optimizer built before torch.distributed was
        initialised holds the whole model as one rank's shard, and every rank would train on
        its own gradients (the Trainer and accelerate initialise it in ``TrainingArguments`` /
        ``Accelerator()``, which scripts often build after the optimizer)."""
        if self._built_alone and _dist_active() and dist.get_world_size() > 1:
            raise RuntimeError(
                f"this optimizer was built before torch.distributed was initialised, so it is a DP group of "
                f"one, but the process group now has {dist.get_world_size()} ranks: each rank would train "
                f"alone. Build the optimizer after the process group exists (after TrainingArguments(...) "
                f"for the Trainer, after Accelerator() for accelerate, or after init_process_group)."
            )

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    # ---------------------------------------------------------------- parameters
    @torch.no_grad()
    def place_params(self, params: Sequence[torch.Tensor], layouts: Sequence[BucketLayout]) -> None:
        """Each parameter becomes a view into its bucket's flat buffer, which the all-gather
        fills in place. On the host each one gets a storage of its own over its range of the
        buffer (``plain_alias``: offset 0, writes through either seen by both), as a parameter
        made alone has: torch 2.13's ``DTensor.detach()`` of a local part at a nonzero offset of a
        shared storage reports a pointer into no storage, and ``dcp.async_save``'s staging
        (TorchTitan's asynchronous checkpoints under tensor parallelism) fails on it. (On an
        accelerator a slice of a storage is memory its caching allocator does not own: there the
        parameters stay plain views until that is tested.)"""
        self._params = list(params)
        self._homes = {}
        own_storage = torch.device(self.device).type == "cpu"
        for layout in layouts:
            first = params[layout.param_indices[0]]
            flat = staggered_empty(layout.padded_numel, first.dtype, self.device, "param").zero_()
            for i, index in enumerate(layout.param_indices):
                start, end = layout.param_range(i)
                flat[start:end].copy_(params[index].detach().reshape(-1))
                view = flat[start:end].view(params[index].shape)
                params[index].data = plain_alias(view) if own_storage else view
                self._homes[index] = flat[start:end]
            self._flat_params.append(flat)
        self._home_pointers = [self._homes[i].data_ptr() for i in range(len(self._params))]

    def param_shard(self, b: int) -> torch.Tensor:
        return self._shard(self._flat_params[b])

    @torch.no_grad()
    def publish(self, shards: Sequence[torch.Tensor]) -> None:
        for flat, value in zip(self._flat_params, shards):
            mine = self._shard(flat)
            if not (value.data_ptr() == mine.data_ptr() and value.dtype == mine.dtype):
                mine.copy_(value)
        if self.world_size > 1:
            for flat in self._flat_params:
                _all_gather(flat, self._shard(flat), group=self.group)

    @torch.no_grad()
    def adopt_param_storage(self) -> list[int]:
        """Parameters whose storage was replaced by a tensor of the same dtype on the same device
        (``model.to(torch.device("cpu", 0))``, which the Trainer and accelerate call under
        torchrun, copies every CPU tensor; ``load_state_dict(assign=True)``) go back into their
        flat buffer with their new values; returns their indices."""
        pointers = list(map(torch.Tensor.data_ptr, self._params))
        if pointers == self._home_pointers:
            return []  # (every step but one after model.to(...) or an assign)
        adopted = []
        for i, p in enumerate(self._params):
            home = self._homes[i]
            if pointers[i] == self._home_pointers[i]:
                continue
            if p.dtype != home.dtype or p.device != home.device:
                raise RuntimeError(
                    f"parameter {i} (shape {tuple(p.shape)}) was moved to {p.dtype} on {p.device} after the "
                    f"optimizer was built for {home.dtype} on {home.device} (model.to(...), "
                    f"load_state_dict(assign=True), or assigning .data). Build the optimizer after the model "
                    f"has its final device and dtype."
                )
            home.copy_(p.detach().reshape(-1))
            p.data = home.view(p.shape)
            adopted.append(i)
        return adopted

    # ---------------------------------------------------------------- host side
    def random_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(self.device).manual_seed(seed + 7919 * self.rank)

    def to_host(self, tensors):
        if self.device.type == "cpu":
            return [t.detach() for t in tensors], False
        # ``copy=True``: a host tensor among them (AdamW's ``step`` unless fused) is copied too
        return [t.detach().to("cpu", copy=True) for t in tensors], True

    @property
    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            if self.world_size == 1 or not _dist_active():
                self._coordinator = LocalCoordinator()
            else:
                self._coordinator = ProcessGroupCoordinator(dist.get_process_group_ranks(self.group or dist.group.WORLD))
        return self._coordinator

    @property
    def world_coordinator(self) -> Coordinator:
        if self._world_coordinator is None:
            if not _dist_active() or dist.get_world_size() == 1:
                self._world_coordinator = LocalCoordinator()
            else:
                self._world_coordinator = ProcessGroupCoordinator(range(dist.get_world_size()))
        return self._world_coordinator
