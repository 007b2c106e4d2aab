"""The topology: every group one optimizer communicates over, and this rank's place in them, built
once from whatever forms the caller passed.

* ``data``: the data-parallel (ZeRO-1 sharding) group: the shards, the gradient's reduce-scatter,
  the parameters' all-gather;
* ``tensor``: the tensor-parallel groups: a parameter marked ``tensor_model_parallel=True`` adds each
  member's part to the norm, the others count once; with sequence parallelism the gradients of the
  parameters NxD marks ``sequence_parallel_enabled`` are summed over them;
* ``pipeline``: the pipeline-parallel groups: the stages' squares add up in the norm (a parameter
  marked ``shared=True`` is counted by another stage);
* ``context``: the context-parallel groups the gradients are averaged over, those the data group does
  not already span (NxD's ZeRO-1 sharding groups span data x context parallelism, whose mean then
  covers them).

Every group is a backend (``nxd_smp.backend``), so any group form works on any device. The two
reductions NxD's trainer wrapper does before its step (the context-parallel mean, the
sequence-parallel sum) and the norm by role live here once, for the ``Zero1Optimizer`` (on its flat
buckets) and for NxD's wrapper with ZeRO-1 off (on ``.grad``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..core.errors import ConfigError
from ..backend import Backend, GroupSpec, NormGroupSpec, group_backends, select_backend
from ..core.dtensors import DeviceMesh, fully_sharded, param_mesh
from .norm import global_norm, gradient_coefficient, sum_of_squares
from .param_groups import check_sequence_parallel

__all__ = ["Coordinate", "Topology"]


@dataclass(frozen=True)
class Coordinate:
    """Where this rank sits: its data-parallel rank and the group's size, its tensor- and
    pipeline-parallel ranks (0 without those groups)."""

    data: int
    data_size: int
    tensor: int
    pipeline: int


@dataclass(frozen=True)
class Topology:
    """The groups of one optimizer (see the module's docstring); build it with ``build``.

    Attributes:
        data: the data-parallel group's backend.
        tensor, pipeline: the tensor- and pipeline-parallel groups' backends (empty without).
        context: the context-parallel groups the data group does not span.
        context_size: the size of the context-parallel groups passed (1 without), whether or not
            the data group spans them.
        sequence_parallel: the gradients of marked parameters are summed over ``tensor``.
    """

    data: Backend
    tensor: tuple[Backend, ...] = ()
    pipeline: tuple[Backend, ...] = ()
    context: tuple[Backend, ...] = ()
    context_size: int = 1
    sequence_parallel: bool = False

    @classmethod
    def build(
        cls,
        device: torch.device,
        *,
        data: GroupSpec = None,
        tensor: NormGroupSpec = None,
        pipeline: NormGroupSpec = None,
        context: NormGroupSpec = None,
        sequence_parallel: bool = False,
        device_mesh: DeviceMesh | None = None,
        params: Sequence[torch.Tensor] = (),
        owner: str = "Zero1Optimizer",
        pin_layout: bool = True,
        given: "Topology | None" = None,
    ) -> "Topology":
        """The topology of groups given in any form (None, a process group, a list of process
        groups, torch_xla replica groups) for parameters on ``device``: the one place every way of
        passing groups is resolved (a caller's ``topology=`` arrives as ``given``, returned as it is,
        and refused beside any group). ``sequence_parallel``:
        sum the gradients of ``params`` marked ``sequence_parallel_enabled`` over the
        tensor-parallel groups (off when none is marked).

        ``device_mesh``: a torch ``DeviceMesh`` whose dimension ``"dp"`` (or TorchTitan's
        ``"dp_replicate"``, or its flattened ``"dp"``) is the data-parallel group and ``"tp"`` (optional)
        the tensor-parallel one, instead of ``data`` and ``tensor``; other dimensions of size 1 are ignored. DTensor
        ``params`` (``parallelize_module``) count as split in the norm where they are sharded, and
        without a tensor-parallel group their mesh's is taken.

        Raises:
            TypeError, ValueError: a group form that does not fit the device or this rank; DTensor
                parameters spread over the data-parallel group (FSDP2's ``fully_shard``, or tensor
                parallelism without its data-parallel group named).
            ConfigError: sequence parallelism with marked parameters and no tensor-parallel group.
        """
        if given is not None:
            if not isinstance(given, Topology) or any(g is not None for g in (data, tensor, pipeline, context,
                                                                              device_mesh)):
                raise TypeError(f"{owner}'s topology must be a Topology, given instead of process_group, "
                                f"grad_norm_groups, pipeline_groups, context_parallel_groups and device_mesh (not "
                                f"beside them).")
            return given
        if device_mesh is not None:
            if data is not None or tensor is not None:
                raise TypeError("device_mesh names the data- and tensor-parallel groups; pass it instead of "
                                "process_group and grad_norm_groups, not beside them.")
            data, tensor = _mesh_groups(device_mesh)
        if fully_sharded(params):
            raise ConfigError(f"the parameters belong to {_FULLY_SHARDED}")
        mesh = param_mesh(params)
        if mesh is not None and tensor is None:
            tensor = _tensor_group_of(mesh)
        data_backend = select_backend(device, data, pin_layout=pin_layout)
        if mesh is not None:
            if not data_backend.holds_dtensors:
                raise ConfigError("DTensor parameters on an XLA device are not supported: on torch-xla use NxD's "
                                 "tensor parallelism (its layers mark tensor_model_parallel) with grad_norm_groups.")
            _check_not_sharded_over(mesh, data_backend.global_ranks)
        tensor_backends = tuple(group_backends(tensor, device, pin_layout=pin_layout))
        if mesh is not None:
            _check_tensor_group(mesh, tensor_backends)
        contexts = group_backends(context, device, pin_layout=pin_layout)
        outside = tuple(cp for cp in contexts if not set(cp.global_ranks) <= set(data_backend.global_ranks))
        marked = sequence_parallel and check_sequence_parallel(
            params, tensor_parallel_known=bool(tensor_backends), owner=owner)
        return cls(data_backend, tensor_backends, tuple(group_backends(pipeline, device, pin_layout=pin_layout)),
                   outside, math.prod(cp.world_size for cp in contexts), bool(marked))

    @property
    def tensor_size(self) -> int:
        """The size of the tensor-parallel group (1 without one)."""
        return math.prod(group.world_size for group in self.tensor)

    @property
    def mean_over(self) -> int:
        """How many ranks a gradient's mean is over: data x the context parallelism outside it."""
        return self.data.world_size * math.prod(group.world_size for group in self.context)

    @property
    def coordinate(self) -> Coordinate:
        return Coordinate(self.data.rank, self.data.world_size, self.tensor[0].rank if self.tensor else 0,
                          self.pipeline[0].rank if self.pipeline else 0)

    def sum_model_parallel_(self, tensors: Sequence[torch.Tensor], marked: Sequence[bool], *,
                            per_parameter: bool = False, mean: bool = True) -> None:
        """NxD's trainer wrapper's reductions before the step, in its order, in place: every tensor
        over the context-parallel groups, then those ``marked`` (sequence parallel) over the
        tensor-parallel groups (when ``sequence_parallel``).

        ``per_parameter``: as NxD's wrapper does on ``.grad``: the context-parallel mean divides
        first (unless ``mean`` is False: ``grad_reduction="sum"``), tensors are all-reduced in buckets
        (``Backend.all_reduce_many_``) and groups of one send nothing. Else the tensors are flat buckets
        (or shards of them), each all-reduced alone, and the context-parallel sum is left a sum (its
        1/size is in ``mean_over``)."""
        for group in self.context:
            if per_parameter and mean and group.world_size > 1 and tensors:
                torch._foreach_div_(list(tensors), float(group.world_size))
            _sum_over(group, tensors, per_parameter)
        if self.sequence_parallel:
            chosen = [tensor for tensor, m in zip(tensors, marked, strict=True) if m]
            for group in self.tensor:
                _sum_over(group, chosen, per_parameter)

    def global_norm(self, by_role: Mapping[str, Sequence[torch.Tensor]], *, sharded: bool, dtype: torch.dtype,
                    device: torch.device, compiled: bool = False) -> torch.Tensor:
        """The L2 norm over the whole model of the gradients ``by_role`` (``"replicated"`` and
        ``"split"`` tensors of ``norm.norm_role``; ``"shared"`` ones are left out), a 0-dim tensor
        of ``dtype`` (the plan's norm dtype) on every rank: the split parts added up over the
        tensor-parallel groups, then the total over the data-parallel group when the tensors are
        this rank's ``sharded`` part, and over the pipeline stages. On CPU the sums travel in
        fp64 and the norm is rounded to ``dtype`` once, so it is the same at any DP size."""
        split = by_role.get("split", ())
        exact = torch.float64 if device.type == "cpu" else dtype
        return global_norm(
            sum_of_squares(list(by_role.get("replicated", ())), device, compiled, dtype=exact),
            sum_of_squares(list(split), device, compiled, dtype=exact) if split else None,
            tensor_parallel=self.tensor,
            data_parallel=self.data if sharded else None,
            pipeline_parallel=self.pipeline,
        ).to(dtype)

    def norm_and_coefficient(self, by_role: Mapping[str, Sequence[torch.Tensor]], *, sharded: bool,
                             dtype: torch.dtype, device: torch.device, divisor: int = 1, grad_clipping: bool,
                             max_norm: float | None, loss_scale: torch.Tensor | None = None, compiled: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | float | None, torch.Tensor | None]:
        """A step's norm and what its gradients are multiplied by, for every gradient source (the
        optimizer's shards, NxD's wrapper's whole ``.grad``): ``global_norm`` of ``by_role``, divided by
        ``divisor`` (the mean's size, where the gradients are still sums: ``mean_over``) and by the loss
        scale; then ``norm.gradient_coefficient``: the clip coefficient, over the same divisor and scale
        (None for 1). Returns ``(norm, coefficient, found_inf)``, ``found_inf`` (the scaled norm not
        finite: a step to skip, alike on every rank) None without a loss scale."""
        norm = self.global_norm(by_role, sharded=sharded, dtype=dtype, device=device, compiled=compiled)
        norm = norm / divisor if divisor > 1 else norm  # (sums -> means)
        found_inf = None
        if loss_scale is not None:
            norm = norm / loss_scale
            found_inf = ~torch.isfinite(norm)  # the norm is reduced over every rank: all skip alike
        coef = gradient_coefficient(norm, grad_clipping, max_norm, divisor if divisor > 1 else None, loss_scale)
        return norm, coef, found_inf


def _sum_over(group: Backend, tensors: Sequence[torch.Tensor], per_parameter: bool) -> None:
    """All-reduce ``tensors`` over ``group`` in place: each alone (flat buckets), or in buckets,
    sending nothing over a group of one (``per_parameter``, as NxD's wrapper does)."""
    if not per_parameter:
        for tensor in tensors:
            group.all_reduce_(tensor)
    elif group.world_size > 1 and tensors:
        group.all_reduce_many_(tensors)


_FULLY_SHARDED = (
    "a model sharded by FSDP2 (fully_shard): it already shards the parameters over data parallelism, which "
    "ZeRO-1 cannot shard again. Use torch.optim.AdamW with FSDP2's MixedPrecisionPolicy(param_dtype="
    "torch.bfloat16, reduce_dtype=torch.float32), the fully sharded form of standard mixed precision, and carry "
    "an nxd_smp checkpoint into it with `python -m nxd_smp export-torch CKPT OUT_DIR` (a DCP directory that "
    "dcp.load reshards).")

#: The names of a ``device_mesh``'s data-parallel dimension, first found first: ``"dp"`` (nxd_smp's, and
#: TorchTitan's flattened data-parallel dimension, which ``mesh["dp"]`` resolves though ``mesh_dim_names``
#: lacks it), TorchTitan's ``"dp_replicate"``, or its ``"batch"`` (0.3's data-loading dimension, the
#: data-parallel ranks); and of its tensor-parallel one.
DATA_DIMS = ("dp", "dp_replicate", "batch")
TENSOR_DIMS = ("tp",)


def _named(mesh: object, names: Sequence[str]) -> tuple[str, object] | None:
    """The first of ``names`` that ``mesh`` resolves (a dimension or a flattened one), with its mesh."""
    for name in names:
        try:
            return name, mesh[name]
        except (KeyError, RuntimeError, ValueError, IndexError):
            continue
    return None


def _mesh_groups(mesh: object) -> tuple[object, object]:
    """The data- and tensor-parallel process groups of ``mesh``, by the names of its dimensions
    (``DATA_DIMS``, ``TENSOR_DIMS``); every other dimension must be of size 1 (TorchTitan's ``dp_shard``
    and ``cp`` where they are not used)."""
    if DeviceMesh is None or not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}.")
    names = tuple(mesh.mesh_dim_names or ())
    data, tensor = _named(mesh, DATA_DIMS), _named(mesh, TENSOR_DIMS)
    if data is None:
        raise ConfigError(
            f"device_mesh has dimensions {names or '(unnamed)'}; nxd_smp takes a mesh with a data-parallel dimension "
            f"named {' or '.join(map(repr, DATA_DIMS))} (the group it shards over; TorchTitan's flattened 'dp' "
            f"too) and optionally 'tp' (tensor parallelism), e.g. init_device_mesh(device_type, (dp, tp), "
            f"mesh_dim_names=('dp', 'tp')). For other layouts pass process_group=mesh[<dim>].get_group() and "
            f"grad_norm_groups=mesh['tp'].get_group()."
        )
    data_ranks, chosen = set(data[1].mesh.flatten().tolist()), {data[0], tensor[0] if tensor else None}
    others = [(name, mesh.size(i)) for i, name in enumerate(names)  # (what a flattened "dp" covers is data)
              if mesh.size(i) > 1 and name not in chosen and not set(mesh[name].mesh.flatten().tolist()) <= data_ranks]
    if others:
        raise ConfigError(
            f"device_mesh has dimensions {dict(zip(names, mesh.shape))}: "
            f"{', '.join(f'{n!r} of size {k}' for n, k in others)} "
            f"is neither the data-parallel dimension it shards over ({data[0]!r}) nor tensor parallelism. A "
            f"'dp_shard' or 'fsdp' dimension is FSDP2's ({_FULLY_SHARDED}); context parallelism is "
            f"context_parallel_groups=mesh['cp'].get_group() with process_group and grad_norm_groups.")
    return data[1].get_group(), (tensor[1].get_group() if tensor else None)


def _tensor_group_of(mesh: object) -> object:
    """The process group of the DTensor parameters' mesh: their tensor-parallel group."""
    if mesh.ndim != 1:
        raise ConfigError(
            f"the DTensor parameters live on a {mesh.ndim}-dimensional mesh {mesh}; nxd_smp shards a model "
            f"parallelized over one tensor-parallel dimension (parallelize_module(model, mesh['tp'], plan)). "
            f"Pass device_mesh=mesh with dimensions ('dp', 'tp'). (A mesh with a data-parallel dimension is FSDP2's "
            f"or HSDP's: {_FULLY_SHARDED})"
        )
    return mesh.get_group()


def _check_tensor_group(mesh: object, tensor_backends: Sequence[Backend]) -> None:
    """The DTensor parameters' mesh is the one tensor-parallel group the norm sums their parts over."""
    ranks = sorted(mesh.mesh.flatten().tolist())
    given = sorted(tensor_backends[0].global_ranks) if len(tensor_backends) == 1 else None
    if mesh.ndim != 1 or ranks != given:
        raise ConfigError(
            f"the DTensor parameters live on mesh {mesh} (ranks {ranks}), but the tensor-parallel group is "
            f"{given if given is not None else f'{len(tensor_backends)} groups'}: the norm adds their parts over "
            f"that group, so it must be their mesh. Parallelize the model over mesh['tp'] and pass device_mesh=mesh.")


def _check_not_sharded_over(mesh: object, data_ranks: Sequence[int]) -> None:
    """Refuse DTensor parameters spread over ranks of the data-parallel group: FSDP2 has sharded them
    already, or the data-parallel group was not named and spans the tensor-parallel ranks."""
    import torch.distributed as dist

    shared = set(mesh.mesh.flatten().tolist()) & set(data_ranks) - {dist.get_rank()}
    if shared:
        raise ConfigError(
            f"the model's DTensor parameters are spread over ranks {sorted(shared)}, which are also in the "
            f"data-parallel group {sorted(data_ranks)}. Two causes:\n"
            f"* tensor parallelism without its data-parallel group: pass device_mesh=mesh (dimensions "
            f"('dp', 'tp')) or process_group=mesh['dp'].get_group();\n"
            f"* {_FULLY_SHARDED}"
        )
