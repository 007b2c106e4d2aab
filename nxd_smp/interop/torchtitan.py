"""TorchTitan: its optimizers container over ``Zero1Optimizer`` (``build_zero1_optimizers``).

TorchTitan's trainer and its ``CheckpointManager`` hold the optimizers in an ``OptimizersContainer``:
a ``Stateful`` whose ``state_dict()`` is the flat, name-keyed dict its checkpoint utilities build from
each optimizer's own ``state_dict()`` (its param groups name their parameters: ``param_names``), and
that ``dcp.save``/``dcp.load`` write and fill in place. ``Zero1Optimizer`` speaks that protocol (its state
exists from construction, so TorchTitan's ``init_optim_state`` never steps it; each rank describes only
the ranges it owns): this container builds one per model part, over the part's named parameters, and
is otherwise TorchTitan's own (``step``, ``zero_grad``, ``state_dict``, ``load_state_dict``, hooks).

TorchTitan is imported when the container is built; nxd_smp never requires it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..zero1_optimizer import Zero1Optimizer

__all__ = ["build_zero1_optimizers"]


def _container_class() -> type:
    try:
        from torchtitan.components.optimizer import OptimizersContainer
    except ImportError as e:  # pragma: no cover - exercised where torchtitan is missing
        raise ImportError("nxd_smp.interop.torchtitan needs torchtitan (pip install torchtitan).") from e
    return OptimizersContainer


def build_zero1_optimizers(model_parts: nn.Module | Sequence[nn.Module],
                           optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                           **zero1_options: Any) -> Any:
    """A TorchTitan ``OptimizersContainer`` holding one ``Zero1Optimizer(named parameters of the part,
    optimizer_class, **zero1_options)`` per model part (hyperparameters such as ``lr`` and nxd_smp's
    options such as ``device_mesh=``, ``grad_reduction="sum"`` for TorchTitan's per-token loss).
    Hand it to TorchTitan's ``CheckpointManager(optimizers=...)`` and LR schedulers as its own
    ``build_optimizers`` result.

    Raises:
        ImportError: torchtitan is not installed.
        TypeError: ``model_parts`` is not a module or a list of them.
    """
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    if not parts or not all(isinstance(part, nn.Module) for part in parts):
        raise TypeError("model_parts must be an nn.Module or a non-empty list of them (TorchTitan's model_parts).")
    base = _container_class()
    optimizers = [Zero1Optimizer([(name, p) for name, p in part.named_parameters() if p.requires_grad],
                                 optimizer_class, **zero1_options) for part in parts]
    container = base.__new__(base)
    container.model_parts = parts
    container.optimizers = optimizers
    container._post_init([p for optimizer in optimizers for p in optimizer.managed_params])
    return container
