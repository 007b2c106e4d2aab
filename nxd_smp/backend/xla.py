"""The XLA backend (Trainium, the XLA CPU device): separate parameters and rank-free
in-graph collectives over replica groups, whatever form of group the caller passed.

Group forms, all ending in replica groups (lists of global ordinals):

* ``None``, or the default group (``init_process_group("xla")``, which every NxD script
  calls): one group of every replica;
* a ``dist.new_group(...)`` group: its ranks (``dist.get_process_group_ranks``) completed into
  the partition of the world it belongs to (``replica_partition``);
* replica-group lists: as given (NxD's ``get_data_parallel_replica_groups()``).

The collectives (``xm.reduce_scatter`` / ``xm.all_gather``, as torch_xla's and NxD's ZeRO-1
use them) return new tensors and never slice by a Python rank: this rank's identity enters
the graph as data (what the reduce-scatter returns, ``local_shard``'s index), so every rank
runs one compiled program. They are issued even for a group of one, so the step compiles to
the same graph shape at every size. Parameters are not views of a flat buffer: a bucket
exists only inside the step's graph (one concatenation in, one all-gather out).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core.errors import ConfigError
from ..core.flatten import flatten_bucket
from ..core.layout import BucketLayout
from ..core.environment import XLA_DOWNCAST_BF16, XLA_USE_BF16, xla_bf16_variable
from .base import Backend, GroupSpec, PendingShard, check_replica_groups, is_replica_groups, replica_partition
from .coordination import (
    Coordinator,
    LocalCoordinator,
    ProcessGroupCoordinator,
    RendezvousCoordinator,
    ThreadCoordinator,
)


#: 16 MiB (4M elements): a step works through its buckets one after the other, so a bucket's
#: temporaries (its concatenated gradient, its gathered parameters) are what the step adds to
#: memory, and XLA's fusions run faster at this size. On the XLA CPU device (16.8M-parameter
#: MLP): 25.5 bytes/param peak and 139 ms per step, against 37.1 and 199 ms with 128 MiB.
DEFAULT_BUCKET_CAP_MB = 16.0

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
    _xla_cpu.in_backward_graph = False


def _restart_at_next_sync() -> None:
    """Collectives were traced outside ``step()`` (sharded gradient accumulation, from
    backward hooks): their graph may also hold the step's, so the step must not number from 1
    again; the numbering restarts when the graph is cut (``torch_xla.sync()`` runs this
    thread's step closures)."""
    if not getattr(_xla_cpu, "in_backward_graph", False):
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(restart_channel_ids)
        _xla_cpu.in_backward_graph = True


def _next_channel_id() -> int:
    channel = getattr(_xla_cpu, "next_channel", 1)
    _xla_cpu.next_channel = channel + 1
    return channel


_BITCAST_TYPES = {"int16": "S16", "int32": "S32", "bfloat16": "BF16", "float32": "F32", "float16": "F16"}
_bitcast_ops: dict[torch.dtype, object] = {}


def _bitcast_op(dtype: torch.dtype):
    """An XLA op reinterpreting bits as ``dtype`` (one per dtype, built once)."""
    if dtype not in _bitcast_ops:
        import torch_xla.core.xla_builder as xb
        import torch_xla.core.xla_op_registry as xor

        name = str(dtype).split(".")[-1]
        if name not in _BITCAST_TYPES:
            raise ValueError(f"no XLA bitcast to {dtype}; supported: {sorted(_BITCAST_TYPES)}.")
        to_type = getattr(xb.Type, _BITCAST_TYPES[name])
        _bitcast_ops[dtype] = xor.Op(f"nxd_smp_bitcast_{name}", lambda x: x.bitcast(to_type))
    return _bitcast_ops[dtype]


def _replica_groups(group: GroupSpec, world_size: int) -> list[list[int]]:
    """The replica groups for any group form the caller can pass on an XLA device."""
    if group is None or group is dist.GroupMember.WORLD:
        return [list(range(world_size))]
    if is_replica_groups(group):
        return check_replica_groups(group, world_size)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ConfigError(
            "this process is not a member of the given process group (torch.distributed.new_group "
            "returned NON_GROUP_MEMBER here); pass the data-parallel group that contains this rank."
        )
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"process_group must be a torch.distributed ProcessGroup, replica groups (a list of "
            f"lists of ranks) or None, got {type(group).__name__}."
        )
    return replica_partition(dist.get_process_group_ranks(group), world_size)


class XlaBackend(Backend):
    """An XLA device: rank-free in-graph collectives over replica groups.

    Args:
        group: any group form (see the module's docstring).
        pin_layout: passed to the torch_xla ops (NxD passes False). With it off, the buckets
            of one step go out as one coalesced collective.

    On the XLA CPU device (where replicas are threads of one process) every collective is a
    single-tensor op with a channel id, which is how XLA:CPU matches the replicas of one
    collective, and runs after the previous one; ``pin_layout`` and coalescing do not apply
    there. Elsewhere (Neuron) no channel id is added.

    Under ``XLA_DOWNCAST_BF16=1`` torch_xla stores float32 as bf16 and float64 as fp32: ``fp32``
    is then ``torch.float64`` (NxD's masters under that mode) and ``device_dtype`` says what the
    device holds; under ``XLA_USE_BF16=1`` both are bf16.

    torch_xla orders its collectives through a numeric token: each one's input gets
    ``+ token`` and the token becomes ``token * result[0]``. An inf at the start of one
    result (an fp16 overflow) makes the token NaN and every later collective's input NaN,
    the parameters' all-gather included, so a step the loss scaler skips would still write
    NaN parameters. Each collective here starts from a fresh token and leaves a fresh one.
    """

    default_bucket_cap_mb = DEFAULT_BUCKET_CAP_MB
    persistent_grad_buffers = False
    has_fused_kernels = False
    step_counter_on_device = True
    param_shard_is_storage = False
    host_rank_slices = False

    def __init__(self, device: torch.device, group: GroupSpec = None, pin_layout: bool = True):
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.runtime as xr

        self._xm = xm
        self._xlac = torch_xla._XLAC
        self.device = device
        me, world = xr.global_ordinal(), xr.world_size()
        if dist.is_available() and dist.is_initialized() and dist.get_rank() != me:
            raise ConfigError(
                f"torch.distributed rank {dist.get_rank()} is XLA replica {me}: the process group's "
                f"ranks cannot name replicas. Initialise it with init_process_group('xla', "
                f"init_method='xla://'), or pass replica groups (lists of XLA ordinals)."
            )
        self.groups = _replica_groups(group, world)
        mine = [g for g in self.groups if me in g]
        if not mine:
            raise ConfigError(
                f"this process (ordinal {me}) is in none of the replica groups {self.groups}; "
                f"pass groups that cover every rank."
            )
        self.ordinal = me
        self.members = mine[0]
        self.rank, self.world_size = mine[0].index(me), len(mine[0])
        self.pin_layout = bool(pin_layout)
        self._bf16_variable = xla_bf16_variable()
        if self._bf16_variable == XLA_DOWNCAST_BF16:
            self.fp32 = torch.float64
        self._cpu = xr.device_type() == "CPU"
        self._threads = xr.addressable_device_count() == world  # every replica a thread here
        self._rank_index: torch.Tensor | None = None
        self._params: list[torch.Tensor] = []
        self._layouts: list[BucketLayout] = []
        self._coordinator: Coordinator | None = None
        self._world_coordinator: Coordinator | None = None

    def device_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if self._bf16_variable is None or not dtype.is_floating_point:
            return dtype
        if dtype == torch.float32 or (dtype == torch.float64 and self._bf16_variable == XLA_USE_BF16):
            return torch.bfloat16
        return torch.float32 if dtype == torch.float64 else dtype

    @property
    def global_ranks(self) -> list[int]:
        return list(self.members)

    # ---------------------------------------------------------------- collectives
    def local_shard(self, flat: torch.Tensor) -> torch.Tensor:
        # Rank as data: a gather with this rank's index, the same program on every rank.
        if self._rank_index is None:
            self._rank_index = torch.tensor([self.rank], device=flat.device)
        return flat.view(self.world_size, -1).index_select(0, self._rank_index).view(-1)

    def begin_step(self) -> None:
        if self._cpu and not getattr(_xla_cpu, "in_backward_graph", False):
            restart_channel_ids()

    def _run(self, op, tensor, **kwargs):
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
            _xla_cpu.last = out.reshape(-1)[:1].clone()
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

    def reduce_scatter(self, flats, into=None):
        xm = self._xm

        def op(t, **kwargs):
            return xm.reduce_scatter(xm.REDUCE_SUM, t, scale=1.0, scatter_dim=0, shard_count=self.world_size,
                                     groups=self.groups, **kwargs)

        return self._per_bucket(op, flats)

    def reduce_scatter_start(self, flat: torch.Tensor, out: torch.Tensor | None = None) -> PendingShard:
        # (``out`` is ignored: XLA's collectives return new tensors.)
        if self._cpu:
            _restart_at_next_sync()
        return PendingShard(self.reduce_scatter([flat])[0])

    def _all_gather(self, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        xm = self._xm

        def op(t, **kwargs):
            return xm.all_gather(t, dim=0, groups=self.groups, **kwargs)

        return self._per_bucket(op, shards)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_gather([tensor])[0]

    def all_reduce_(self, tensor: torch.Tensor) -> None:
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

    # ---------------------------------------------------------------- parameters
    def place_params(self, params: Sequence[torch.Tensor], layouts: Sequence[BucketLayout]) -> None:
        """The parameters stay as they are; a bucket is built inside the graph when needed."""
        self._params = list(params)
        self._layouts = list(layouts)

    def param_shard(self, b: int) -> torch.Tensor:
        layout = self._layouts[b]
        parts = [self._params[index].detach() for index in layout.param_indices]
        return self.local_shard(flatten_bucket(layout, parts, parts[0].dtype, self.device))

    @torch.no_grad()
    def publish(self, shards: Sequence[torch.Tensor]) -> None:
        values = []
        for layout, shard in zip(self._layouts, shards):
            dtype = self._params[layout.param_indices[0]].dtype
            values.append(shard if shard.dtype == dtype else shard.to(dtype))
        targets, sources = [], []
        for layout, flat in zip(self._layouts, self._all_gather(values)):
            for i, index in enumerate(layout.param_indices):
                start, end = layout.param_range(i)
                targets.append(self._params[index])
                sources.append(flat[start:end].view(self._params[index].shape))
        torch._foreach_copy_(targets, sources)

    def bitcast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # torch_xla runs Tensor.view(dtype) on the host (an aten fallback); XLA's
        # BitcastConvert keeps it in the graph.
        if tensor.dtype == dtype:
            return tensor
        return _bitcast_op(dtype)(tensor)

    def update_in_place(self, tensors: Sequence[torch.Tensor]) -> None:
        """Each tensor's new value in its own buffer, with no copy.

        torch_xla marks the buffers of updated tensors as donors and XLA pairs donors with outputs
        of the same byte size in order (parameter numbers, output indices). The outputs go in the
        order of the tensors' ids (the order of their last in-place write); the parameters are
        numbered as the lowering first reaches them, from the parameters' all-gather into the update
        (for Adam: ``exp_avg_sq`` before ``exp_avg``). Two same-sized state tensors paired crosswise
        cost XLA a copy of each, and the copies' temporary memory (docs/trainium.md). An
        optimization barrier over all of them, in decreasing id order (the lowering visits the
        last operand first), makes the lowering reach their old values in the outputs' order. The
        barrier computes nothing: XLA:CPU removes it before code generation."""
        on_device = [t for t in tensors if t.device.type == self.device.type]  # (AdamW's ``step``: host)
        if on_device:
            self._xm.optimization_barrier_(sorted(on_device, key=self._xlac._xla_get_tensor_id, reverse=True))

    # ---------------------------------------------------------------- host side
    def to_host(self, tensors):
        # Host tensors come back from the transfer as themselves (AdamW keeps its ``step``
        # on the CPU for an XLA parameter): they are cloned, or an asynchronous save would
        # write the counter the steps after it go on incrementing. Device tensors come back in
        # the dtype the device holds them in (under XLA_DOWNCAST_BF16 a float32 parameter as
        # bf16, a float64 master as fp32): the cast is exact, and checkpoints record that.
        on_device = [i for i, t in enumerate(tensors) if t.device.type != "cpu"]
        moved = self._xlac._xla_get_cpu_tensors([tensors[i].detach() for i in on_device]) if on_device else []
        host = [t.detach().clone() if t.device.type == "cpu" else None for t in tensors]
        for i, t in zip(on_device, moved):
            host[i] = t.to(self.device_dtype(t.dtype))
        return host, True

    @property
    def coordinator(self) -> Coordinator:
        if self._coordinator is None:
            if self.world_size == 1:
                self._coordinator = LocalCoordinator()
            elif self._threads:
                self._coordinator = ThreadCoordinator(self.members, self.rank)
            elif dist.is_available() and dist.is_initialized():
                self._coordinator = ProcessGroupCoordinator(self.members)
            else:
                self._coordinator = RendezvousCoordinator(self.members, self.rank)
        return self._coordinator

    @property
    def world_coordinator(self) -> Coordinator:
        if self._world_coordinator is None:
            world = sorted({r for g in self.groups for r in g})
            if len(world) == 1:
                self._world_coordinator = LocalCoordinator()
            elif self._threads:
                self._world_coordinator = ThreadCoordinator(world, world.index(self.ordinal))
            elif dist.is_available() and dist.is_initialized():
                self._world_coordinator = ProcessGroupCoordinator(world)
            else:
                self._world_coordinator = RendezvousCoordinator(world, world.index(self.ordinal))
        return self._world_coordinator
