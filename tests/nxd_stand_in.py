"""A stand-in for NxD's parallel state (``neuronx_distributed.parallel_layers.parallel_state``),
exposing the names nxd_smp reads exactly as NxD 2.29's sources spell them, with NxD's rank
layout: tensor-parallel ranks consecutive, pipeline stages ``world / pp`` apart, data-parallel
ranks the rest. Nothing can install NxD here (PyPI's package is an empty placeholder)."""

from __future__ import annotations

import sys
import types

MODULE = "neuronx_distributed.parallel_layers.parallel_state"


def layout(world: int, tp: int, pp: int) -> dict[str, list[list[int]]]:
    """NxD's replica groups for ``world`` ranks at tensor-parallel size ``tp`` and pipeline size
    ``pp``: {"tp": ..., "pp": ..., "dp": ...}."""
    stage = world // pp
    tp_groups = [list(range(s, s + tp)) for s in range(0, world, tp)]
    pp_groups = [list(range(r, world, stage)) for r in range(stage)]
    dp_groups = [list(range(p * stage + t, (p + 1) * stage, tp)) for p in range(pp) for t in range(tp)]
    return {"tp": tp_groups, "pp": pp_groups, "dp": dp_groups}


def install(world: int, tp: int = 1, pp: int = 1, initialized: bool = True, rank: int = 0) -> types.ModuleType:
    """Put the stand-in (and its parent packages) into ``sys.modules`` as global rank ``rank``
    sees it; returns it."""
    groups = layout(world, tp, pp)
    ps = types.ModuleType(MODULE)
    ps.model_parallel_is_initialized = lambda: initialized
    ps.get_data_parallel_replica_groups = lambda: [list(g) for g in groups["dp"]]
    ps.get_tensor_model_parallel_replica_groups = lambda: [list(g) for g in groups["tp"]]
    ps.get_pipeline_model_parallel_replica_groups = lambda: [list(g) for g in groups["pp"]]
    ps.get_tensor_model_parallel_size = lambda: tp
    ps.get_pipeline_model_parallel_size = lambda: pp
    ps.get_data_parallel_size = lambda: world // (tp * pp)
    ps.get_context_model_parallel_size = lambda: 1
    ps.get_context_model_parallel_replica_groups = lambda: [[r] for r in range(world)]
    ps.get_zero1_sharding_groups = lambda: [list(g) for g in groups["dp"]]
    ps.get_data_parallel_rank = lambda: next(g.index(rank) for g in groups["dp"] if rank in g)
    ps.get_tensor_model_parallel_rank = lambda: next(g.index(rank) for g in groups["tp"] if rank in g)
    ps.get_pipeline_model_parallel_rank = lambda: next(g.index(rank) for g in groups["pp"] if rank in g)
    for name in ("neuronx_distributed", "neuronx_distributed.parallel_layers"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["neuronx_distributed.parallel_layers"].parallel_state = ps
    sys.modules[MODULE] = ps
    return ps


def uninstall() -> None:
    for name in (MODULE, "neuronx_distributed.parallel_layers", "neuronx_distributed"):
        sys.modules.pop(name, None)
