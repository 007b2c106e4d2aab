"""Sharded, reshardable, atomic checkpoints of a model, its ``Zero1Optimizer``, and the
caller's scheduler and other stateful objects; saved synchronously or in the background.
The public entry points; the work is done in rooms of one job each:

* ``checkpoint_format``: the files and keys, the records, the completion record, safe reads;
* ``checkpoint_save`` / ``checkpoint_load``: saving, and loading with the resharding plan
  (the piece arithmetic is ``resharding``, beside ``layout``);
* ``checkpoint_writer``: the background writer of asynchronous saves;
* ``checkpoint_links``: the version links, their atomic swap and the retention;
* ``checkpoint_storage``: the bytes on disk;
* ``checkpoint_tools``: the offline tools (process-local: they never communicate).

A checkpoint saved at DP size N loads at any DP size M; ``path`` always names a complete
checkpoint (the old one or the new one); a refused load changes nothing; loading never runs
code from the files. Rank, world and the ranks' agreement come from the optimizer's backend
(``nxd_smp.backend``): under torch.distributed a gloo group made for checkpoints, the shared
memory of the XLA CPU device's replica threads, or ``xm.rendezvous`` on Neuron.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .backend import Backend, select_backend, this_replica
from .checkpoint_format import CheckpointError, check_args, managed_param_names, param_group_names, stateful_objects
from .checkpoint_load import load, load_full_optimizer_state
from .checkpoint_save import save
from .checkpoint_tools import consolidate, inspect_checkpoint, read_checkpoint
from .checkpoint_writer import finalize_checkpoint, finish_save_in_flight
from .zero1_optimizer import Zero1Optimizer

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "finalize_checkpoint",
    "inspect_checkpoint",
    "consolidate",
    "read_checkpoint",
    "managed_param_names",
    "param_group_names",
    "load_full_optimizer_state",
]


# A model saved or loaded without its optimizer: the default backend of its device, made once
# per device, rank of this process (XLA CPU replicas are its threads) and default process
# group (its coordinator may make a gloo group at first use).
_model_backends: dict[tuple[str, object, int], Backend] = {}


def _backend(model: nn.Module, optimizer: Zero1Optimizer | None) -> Backend:
    """The optimizer's backend, or (a model alone) the default one for the model's device:
    where rank, world and coordination come from."""
    if optimizer is not None:
        return optimizer.backend
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    device = first.device if first is not None else torch.device("cpu")
    world = id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else 0
    key = (str(device), this_replica(), world)
    if key not in _model_backends:
        _model_backends[key] = select_backend(device)
    return _model_backends[key]


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: Zero1Optimizer | None = None,
    scheduler: Any = None,
    stateful: Mapping[str, Any] | None = None,
    extra: Any = None,
    save_master_weights: bool | None = None,
    async_save: bool = False,
    num_kept_ckpts: int | None = None,
    progress: bool | None = None,
) -> Path:
    """Write ``model`` (and ``optimizer``'s sharded state) to ``path``; every rank calls it.

    Args:
        path: the checkpoint's name: a symbolic link that is swapped atomically to the
            new version once it is complete. Missing parent directories are created; an
            existing empty directory at ``path`` is replaced, anything else is refused.
        model: the model; its ``state_dict()`` is written once (it is replicated).
        optimizer: a ``Zero1Optimizer``; each rank writes only the pieces it owns.
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``), saved
            with the optimizer and restored by ``load_checkpoint(..., scheduler=...)``.
        stateful: more such objects by name (a sampler, a data loader, ...).
        extra: anything picklable (step counter, RNG state, ...), returned by ``load_checkpoint``.
        save_master_weights: write the fp32 master weights (default: the optimizer's
            ``use_master_weights_in_ckpt``).
        async_save: return once the state is copied to host memory; writing, fsync and the
            swap of ``path`` happen in the background. At most one save is in flight: the
            next save (or ``finalize_checkpoint()``) waits for it and raises its error.
        num_kept_ckpts: keep only the newest this many complete checkpoints in ``path``'s
            directory (NxD's name); the new one and the newest complete one are never removed.
        progress: show a progress bar on rank 0 (default: when this module's logger is
            at INFO or below).

    Returns:
        The path of the version directory behind ``path`` (for an asynchronous save, the one
        it will be once the background part is done).

    Raises:
        CheckpointError: bad arguments, or the error of a previous asynchronous save that
            nothing raised yet (that save is then over, and this one is not started).
    """
    check_args(model, optimizer)
    objects = stateful_objects(scheduler, stateful)
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save must be True or False, got {async_save!r}.")
    if num_kept_ckpts is not None and (isinstance(num_kept_ckpts, bool) or not isinstance(num_kept_ckpts, int)
                                       or num_kept_ckpts < 1):
        raise ValueError(f"num_kept_ckpts must be a positive int or None, got {num_kept_ckpts!r}.")
    path = Path(path)
    masters_on = optimizer is not None and optimizer.mixed_precision.use_master_weights
    if save_master_weights is None:
        save_master_weights = optimizer is not None and optimizer.mixed_precision.use_master_weights_in_ckpt
    if save_master_weights and not masters_on:
        raise CheckpointError(
            "save_master_weights=True, but the optimizer keeps no master weights "
            "(use_master_weights=False); pass save_master_weights=None or False."
        )
    finish_save_in_flight(raise_error=True)  # at most one in flight; its failure surfaces here
    if path.exists() and not path.is_symlink() and not (path.is_dir() and not any(path.iterdir())):
        raise CheckpointError(
            f"{path} exists and is not an nxd_smp checkpoint link; pass a new path or remove it."
        )
    return save(path, model, optimizer, _backend(model, optimizer), objects=objects, extra=extra,
                save_master_weights=bool(save_master_weights), async_save=async_save,
                num_kept_ckpts=num_kept_ckpts, progress=progress)



def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: Zero1Optimizer | None = None,
    scheduler: Any = None,
    stateful: Mapping[str, Any] | None = None,
    verify_checksums: bool = True,
    progress: bool | None = None,
) -> Any:
    """Load a checkpoint written by ``save_checkpoint`` at any DP size; every rank calls it.

    ``path`` is a checkpoint, or a directory of them (the newest complete one is loaded).
    The model gets the saved weights; the optimizer its states, hyperparameters and, when
    the checkpoint has them, master weights (the parameters then equal ``master.to(param
    dtype)``). Without saved master weights the masters are rebuilt from the loaded
    parameters, with a warning that precision was lost. ``scheduler`` and the ``stateful``
    objects get their saved state. Pending ``main_grad`` is cleared. Everything is read and
    checked (sizes of all files, CRC-32 of every tensor read) before anything changes. An
    asynchronous save of this process still in flight is waited for first.

    Returns:
        The ``extra`` object that was saved.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        CheckpointError: incomplete, truncated or corrupted files, or names, shapes, dtypes
            or saved objects that do not fit, each named.
    """
    check_args(model, optimizer)
    objects = stateful_objects(scheduler, stateful)
    finish_save_in_flight(raise_error=False)
    return load(Path(path), model, optimizer, _backend(model, optimizer).coordinator, objects=objects,
                verify_checksums=verify_checksums, progress=progress)


if __name__ == "__main__":  # ``python -m nxd_smp.checkpoint ...``: the CLI under its old name
    import sys

    from .cli import main

    sys.exit(main(prog="python -m nxd_smp.checkpoint"))
