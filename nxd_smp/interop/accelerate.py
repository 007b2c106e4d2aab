"""accelerate's ``save_state`` / ``load_state`` with a nxd_smp optimizer: every rank's shard and the
masters kept in the nxd_smp checkpoint beside accelerate's files (``loop_checkpoints``).
Importing this module imports no accelerate: it works through the accelerator it is given."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ..checkpointing.files import local_path
from ..core.errors import ConfigError
from ..zero1_optimizer import zero1_optimizer_of
from .loop_checkpoints import require_zero1, load_beside, read_reference, save_beside

__all__ = ["register_accelerate_hooks"]


def register_accelerate_hooks(accelerator: Any, model: nn.Module, optimizer: Any) -> tuple[Any, Any]:
    """Make ``accelerator.save_state`` / ``load_state`` keep every rank's optimizer state and
    the masters of the nxd_smp ``optimizer`` (prepared by ``accelerator``) and ``model`` (prepared
    or not), at any DP size: save_state writes the nxd_smp checkpoint ``<dir>/nxd_smp`` and
    accelerate's ``optimizer.bin`` becomes the reference to it; load_state loads it first (at
    this DP size) and accelerate then hands every rank the reference. Call it on every rank,
    once, before the first ``save_state`` or ``load_state``. Returns accelerate's two hook
    handles (``.remove()`` undoes it).

    Without it, ``save_state`` keeps the main process's shard only and ``load_state`` refuses
    on the other ranks; with a reference to load but no hook, ``load_state`` says so.

    Raises:
        TypeError: ``optimizer`` is not a nxd_smp optimizer (or accelerate's wrapper of one).
        ValueError (in save_state / load_state): the optimizer was not prepared by ``accelerator``;
            the folder is a URL (``s3://...``, a ``ConfigError``): object storage is not supported yet.
    """
    zero1 = require_zero1(optimizer)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the torch.nn.Module the optimizer trains, got {type(model).__name__}.")

    def prepared_index() -> int:
        """Where accelerate keeps the optimizer (the reference is written only if it does)."""
        prepared = [zero1_optimizer_of(o) for o in getattr(accelerator, "_optimizers", [])]
        if zero1 not in prepared:
            raise ConfigError("the nxd_smp optimizer was not prepared by this Accelerator: call "
                             "accelerator.prepare(optimizer) before save_state/load_state.")
        return prepared.index(zero1)

    def save(models: list, weights: list, output_dir: str) -> None:
        folder = local_path(output_dir, "accelerate's output_dir")
        prepared_index()
        save_beside(folder, model, zero1)

    def load(models: list, input_dir: str) -> None:
        folder = local_path(input_dir, "accelerate's input_dir")
        index = prepared_index()
        name = "optimizer.bin" if index == 0 else f"optimizer_{index}.bin"  # accelerate's names
        reference = read_reference(folder / name)
        if reference is not None:
            load_beside(folder, model, zero1, reference)

    return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)
