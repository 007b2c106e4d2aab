"""nxd_smp's checkpoint inside the checkpoint folders of training loops that write one rank's
optimizer file: the Hugging Face Trainer (``checkpoint-N/optimizer.pt``, written by rank 0) and
accelerate (``save_state``'s ``optimizer.bin``, written by the main process).

At DP > 1 every rank holds another shard, so one rank's file cannot hold the optimizer. Here
every rank writes the nxd_smp checkpoint ``<folder>/nxd_smp`` (reshardable; with the fp32
masters under ``use_master_weights_in_ckpt``), and until the next step the optimizer's
``state_dict()`` is a small reference to it (``Zero1Optimizer.refer_to_checkpoint``), which the
loop writes as its optimizer file. On resume the loop hands that reference to every rank's
``load_state_dict``: a hook of the loop's own loads the checkpoint it names first
(``load_beside``, which checks that the checkpoint is the save the reference names), and the
reference is then accepted. When the loop rotates or removes the folder, nxd_smp's files go
with it.

``register_accelerate_hooks`` does this for accelerate; ``nxd_smp.hf_trainer`` for the Trainer.
Importing this module imports neither transformers nor accelerate.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import torch.nn as nn

from .checkpoint import load_checkpoint, save_checkpoint
from .checkpoint_checks import REFERENCE_FOLDER, REFERENCE_FORMAT, CheckpointError, check_reference, is_reference, load_file
from .zero1_optimizer import Zero1Optimizer, zero1_optimizer_of

__all__ = ["save_beside", "load_beside", "read_reference", "register_accelerate_hooks"]

_IDENTITY = "nxd_smp.loop_checkpoint"  # the name of the save's id among the checkpoint's objects
_REFERENCE_MAX_BYTES = 64 << 10  # a reference file is < 2 KB; a bigger optimizer file holds a state


class _SaveIdentity:
    """The id of one save, kept among the nxd_smp checkpoint's stateful objects: loading it
    checks (before anything changes) that the checkpoint found is the save a reference names."""

    def __init__(self, save_id: str) -> None:
        self.save_id = save_id

    def state_dict(self) -> dict[str, str]:
        return {"id": self.save_id}

    def load_state_dict(self, state: Any) -> None:
        if state != {"id": self.save_id}:
            found = state.get("id") if isinstance(state, dict) else state
            raise ValueError(f"it holds save {found!r}, but the optimizer file beside it refers to save "
                             f"{self.save_id!r}: the folder mixes two saves")


def _zero1(optimizer: Any) -> Zero1Optimizer:
    zero1 = zero1_optimizer_of(optimizer)
    if zero1 is None:
        raise TypeError(f"expected a nxd_smp Zero1Optimizer (or a wrapper holding one in .optimizer), got "
                        f"{type(optimizer).__name__}.")
    return zero1


def save_beside(folder: str | os.PathLike, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Write ``model`` and every rank's optimizer state to the nxd_smp checkpoint
    ``folder/nxd_smp`` (every rank calls it), and make the optimizer's ``state_dict()`` the
    reference to it until the next step. Returns that reference.

    Raises:
        TypeError: ``optimizer`` is not a nxd_smp optimizer.
        CheckpointError: as ``nxd_smp.save_checkpoint``.
    """
    zero1 = _zero1(optimizer)
    save_id = zero1.backend.coordinator.broadcast(uuid.uuid4().hex)  # one id for every rank
    save_checkpoint(Path(folder) / REFERENCE_FOLDER, model=model, optimizer=zero1,
                    stateful={_IDENTITY: _SaveIdentity(save_id)})
    reference = {
        "format": REFERENCE_FORMAT,
        "checkpoint": REFERENCE_FOLDER,
        "id": save_id,
        "dp_size": zero1.world_size,
        "note": f"every rank's optimizer state is in the nxd_smp checkpoint '{REFERENCE_FOLDER}' beside this file "
                f"(see nxd_smp's docs/training_loops.md)",
    }
    zero1.refer_to_checkpoint(reference)
    return reference


def load_beside(folder: str | os.PathLike, model: nn.Module, optimizer: Any, reference: Any, *,
                where: str = "Copy the whole folder, hidden entries and links included (cp -a).") -> None:
    """Load the nxd_smp checkpoint that ``reference`` names in ``folder`` into ``model`` and
    ``optimizer`` at this DP size (every rank calls it), after checking it is that save; the
    optimizer then accepts ``load_state_dict(reference)`` until the next step. ``where``: the
    advice when the checkpoint is not in ``folder``.

    Raises:
        CheckpointError: the reference is damaged, the checkpoint is missing, another save, or
            refused by ``nxd_smp.load_checkpoint`` (on every rank, with nothing changed).
    """
    zero1 = _zero1(optimizer)
    reference = check_reference(reference, f"the optimizer file in {folder}")
    path = Path(folder) / reference["checkpoint"]
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{path} is missing: the optimizer file in {folder} refers to the nxd_smp checkpoint saved there "
            f"(save {reference['id']}), which holds every rank's optimizer state. {where}"
        )
    try:
        load_checkpoint(path, model=model, optimizer=zero1, stateful={_IDENTITY: _SaveIdentity(reference["id"])})
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: {e}") from e
    zero1.refer_to_checkpoint(reference)


def read_reference(file: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint reference a loop's optimizer file holds; None if the file is missing or
    holds something else (an optimizer state of its own).

    Raises:
        CheckpointError: the file is unsafe, or holds a damaged reference.
    """
    file = Path(file)
    if not file.is_file() or file.stat().st_size > _REFERENCE_MAX_BYTES:
        return None
    value = load_file(file)
    return check_reference(value, str(file)) if is_reference(value) else None


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
        ValueError (in save_state / load_state): the optimizer was not prepared by ``accelerator``.
    """
    zero1 = _zero1(optimizer)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the torch.nn.Module the optimizer trains, got {type(model).__name__}.")

    def prepared_index() -> int:
        """Where accelerate keeps the optimizer (the reference is written only if it does)."""
        prepared = [zero1_optimizer_of(o) for o in getattr(accelerator, "_optimizers", [])]
        if zero1 not in prepared:
            raise ValueError("the nxd_smp optimizer was not prepared by this Accelerator: call "
                             "accelerator.prepare(optimizer) before save_state/load_state.")
        return prepared.index(zero1)

    def save(models: list, weights: list, output_dir: str) -> None:
        prepared_index()
        save_beside(output_dir, model, zero1)

    def load(models: list, input_dir: str) -> None:
        index = prepared_index()
        name = "optimizer.bin" if index == 0 else f"optimizer_{index}.bin"  # accelerate's names
        reference = read_reference(Path(input_dir) / name)
        if reference is not None:
            load_beside(input_dir, model, zero1, reference)

    return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)
