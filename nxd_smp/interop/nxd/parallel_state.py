"""NxD's model-parallel state, read where ``neuronx_distributed`` is installed and its
parallel state is initialised (``initialize_model_parallel``); nothing otherwise.

NxD's own optimizers take their groups from it: ``NeuronZero1Optimizer`` shards over the
data-parallel replica groups (``get_zero1_sharding_groups()`` with context parallelism) and
adds its gradient norm up over the tensor- and pipeline-parallel groups. nxd_smp's
``NeuronZero1Optimizer`` and ``initialize_parallel_optimizer`` do the same when the caller
passes no group of their own, through one function, ``nxd_topology``. NxD is never imported at
module level: it stays optional (PyPI's ``neuronx-distributed`` is an empty placeholder).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...backend import GroupSpec, NormGroupSpec
from ...core.errors import ConfigError
from ...optim.topology import Coordinate, Topology

_MODULE = "neuronx_distributed.parallel_layers.parallel_state"


@dataclass(frozen=True)
class ParallelGroups:
    """Replica groups (lists of global ranks) of NxD's parallel state.

    Attributes:
        sharding: the ZeRO-1 sharding groups: the data-parallel groups, or with context
            parallelism NxD's data x context parallel groups (``get_zero1_sharding_groups()``).
        data: the data-parallel groups (what NxD averages gradients over with ZeRO-1 off).
        tensor: the tensor-parallel groups, None at tensor-parallel size 1.
        pipeline: the pipeline-parallel groups, None at pipeline-parallel size 1.
        context: the context-parallel groups, None at context-parallel size 1.
    """

    sharding: list[list[int]]
    data: list[list[int]]
    tensor: list[list[int]] | None
    pipeline: list[list[int]] | None
    context: list[list[int]] | None


def _groups(groups) -> list[list[int]]:
    return [[int(r) for r in g] for g in groups]


def _initialized_state() -> Any:
    """NxD's parallel-state module, where NxD is installed and its model parallelism initialised;
    else None."""
    try:
        ps = importlib.import_module(_MODULE)
    except ImportError:
        return None
    return ps if ps.model_parallel_is_initialized() else None


def nxd_parallel_groups() -> ParallelGroups | None:
    """The groups of NxD's initialised parallel state, or None (NxD not installed, or its
    model parallelism not initialised)."""
    ps = _initialized_state()
    if ps is None:
        return None
    data = _groups(ps.get_data_parallel_replica_groups())
    sharding, context = data, None
    if ps.get_context_model_parallel_size() > 1:
        sharding = _groups(ps.get_zero1_sharding_groups())
        context = _groups(ps.get_context_model_parallel_replica_groups())
    tensor = ps.get_tensor_model_parallel_replica_groups() if ps.get_tensor_model_parallel_size() > 1 else None
    pipeline = (ps.get_pipeline_model_parallel_replica_groups()
                if ps.get_pipeline_model_parallel_size() > 1 else None)
    return ParallelGroups(sharding, data, tensor and _groups(tensor), pipeline and _groups(pipeline), context)


def nxd_coordinate() -> Coordinate | None:
    """This process's ``Coordinate`` in NxD's parallel state (the ranks that name NxD's checkpoint
    files, ``dp_rank_DD_tp_rank_TT_pp_rank_PP.pt``, and the data-parallel size); None when NxD is not
    installed or its parallel state not initialised."""
    ps = _initialized_state()
    if ps is None:
        return None
    return Coordinate(ps.get_data_parallel_rank(), ps.get_data_parallel_size(),
                      ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())


def nxd_topology(device: torch.device, *, data: GroupSpec = None, tensor: NormGroupSpec = None,
                 pipeline: NormGroupSpec = None, context: NormGroupSpec = None, sequence_parallel: bool = False,
                 sharded: bool = True, context_mean_here: bool = True, config_sizes: Mapping[str, int] | None = None,
                 params: Sequence[torch.Tensor] = (), owner: str = "NxD", pin_layout: bool = True) -> Topology:
    """The topology of an optimizer NxD's calls build, the groups left None taken from NxD's
    parallel state where it is initialised, as NxD's own optimizers take them: the data-parallel
    group is the ZeRO-1 sharding groups when ``sharded`` (data x context parallelism under context
    parallelism), else the data-parallel groups; the tensor-, pipeline- and context-parallel groups
    as they are, the context-parallel ones only where the optimizer takes the context-parallel mean
    itself (``context_mean_here``: without the fp32 accumulation hook, NxD's own wrapper takes it on
    ``.grad``). Where NxD's parallel state has no tensor-parallel group (its size 1) there is nothing
    to sum the sequence-parallel gradients over: ``sequence_parallel`` is then off. (Without NxD's
    state, marked parameters and no tensor-parallel group are refused by ``Topology.build``.)

    ``config_sizes``: the parallel sizes of an NxD config (``tensor_parallel_size``, ...): each size
    above 1 needs its groups (passed, or from NxD's parallel state), and then the data-parallel group
    too; at tensor-parallel size 1 the sequence-parallel sum is off.

    Raises:
        ConfigError: a group ``config_sizes`` needs is missing.
        as ``Topology.build``.
    """
    nxd = nxd_parallel_groups()
    if nxd is not None:
        data = (nxd.sharding if sharded else nxd.data) if data is None else data
        tensor = nxd.tensor if tensor is None else tensor
        pipeline = nxd.pipeline if pipeline is None else pipeline
        if context is None and context_mean_here:
            context = nxd.context
        sequence_parallel = sequence_parallel and tensor is not None
    if config_sizes is not None:
        _check_config_groups(config_sizes, data=data, tensor=tensor, pipeline=pipeline, context=context,
                             sequence_parallel=sequence_parallel)
        sequence_parallel = sequence_parallel and tensor is not None
    return Topology.build(device, data=data, tensor=tensor, pipeline=pipeline, context=context,
                          sequence_parallel=sequence_parallel, params=params, owner=owner, pin_layout=pin_layout)


def _check_config_groups(sizes: Mapping[str, int], *, data: Any, tensor: Any, pipeline: Any, context: Any,
                         sequence_parallel: bool) -> None:
    """Raise unless every model-parallel size of an NxD config above 1 has its groups."""
    needed = []
    if sizes.get("tensor_parallel_size", 1) > 1 and tensor is None:
        needed.append(f"grad_norm_groups=<the tensor-parallel groups> (tensor_parallel_size="
                      f"{sizes['tensor_parallel_size']}{', sequence_parallel' if sequence_parallel else ''})")
    if sizes.get("pipeline_parallel_size", 1) > 1 and pipeline is None:
        needed.append(f"pipeline_groups=<the pipeline-parallel groups> (pipeline_parallel_size="
                      f"{sizes['pipeline_parallel_size']})")
    if sizes.get("context_parallel_size", 1) > 1 and context is None:
        needed.append(f"context_parallel_groups=<the context-parallel groups> (context_parallel_size="
                      f"{sizes['context_parallel_size']})")
    model_parallel = any(sizes.get(k, 1) > 1 for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                       "context_parallel_size"))
    if model_parallel and data is None:
        needed.append("process_group=<this rank's data-parallel group>")
    if needed:
        raise ConfigError(missing_groups(needed))


def missing_groups(needed: list[str]) -> str:
    """The refusal of a config whose model parallelism lacks the groups ``needed``."""
    return ("the config has model parallelism, which nxd_smp does not set up; pass " + "; ".join(needed)
            + " (or initialise NxD's parallel state), so that the gradient reductions, the sharding and the "
              "clipped norm cover the whole model.")
