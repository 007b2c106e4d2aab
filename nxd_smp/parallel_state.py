"""NxD's model-parallel state, read where ``neuronx_distributed`` is installed and its
parallel state is initialised (``initialize_model_parallel``); nothing otherwise.

NxD's own optimizers take their groups from it: ``NeuronZero1Optimizer`` shards over the
data-parallel replica groups (``get_zero1_sharding_groups()`` with context parallelism) and
adds its gradient norm up over the tensor- and pipeline-parallel groups. nxd_smp's
``NeuronZero1Optimizer`` and ``initialize_parallel_optimizer`` do the same when the caller
passes no group of their own. NxD is never imported at module level: it stays optional
(PyPI's ``neuronx-distributed`` is an empty placeholder).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["Coordinate", "ParallelGroups", "nxd_parallel_groups", "nxd_coordinate"]

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


@dataclass(frozen=True)
class Coordinate:
    """Where this process sits in NxD's parallel state: the ranks that name NxD's checkpoint
    files (``dp_rank_DD_tp_rank_TT_pp_rank_PP.pt``) and the data-parallel size."""

    data: int
    data_size: int
    tensor: int
    pipeline: int


def nxd_coordinate() -> Coordinate | None:
    """This process's ``Coordinate`` in NxD's parallel state; None when NxD is not installed
    or its parallel state not initialised."""
    ps = _initialized_state()
    if ps is None:
        return None
    return Coordinate(ps.get_data_parallel_rank(), ps.get_data_parallel_size(),
                      ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank())
