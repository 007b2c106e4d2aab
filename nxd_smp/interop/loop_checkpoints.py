"""nxd_smp's checkpoint inside the checkpoint folders of training loops that write one rank's
optimizer file: the Hugging Face Trainer (``checkpoint-N/optimizer.pt``, written by rank 0) and
accelerate (``save_state``'s ``optimizer.bin``, written by the main process).

At DP > 1 every rank holds another shard, so one rank's file cannot hold the optimizer. Here
every rank writes the nxd_smp checkpoint ``<folder>/nxd_smp`` (reshardable; with the fp32
masters under ``use_master_weights_in_ckpt``), and until the optimizer's state next changes its
``state_dict()`` is a small reference to it (``refer_to_checkpoint``), which the loop writes as its
optimizer file. On resume the loop hands that reference to every rank's ``load_state_dict``: a
hook of the loop's own loads the checkpoint it names first (``load_beside``, which checks that the
checkpoint is the save the reference names), and the reference is then accepted. When the loop
rotates or removes the folder, nxd_smp's files go with it.

All of it goes through torch's optimizer hooks (a ``state_dict`` pre-hook, a ``load_state_dict``
pre-hook), so the optimizer itself names no training loop; what a refusal advises about the loops
is registered here (``optim.rank_state.add_hint``). ``nxd_smp.interop.accelerate`` does this for
accelerate, ``nxd_smp.interop.hf_trainer`` for the Trainer. Importing this module imports neither
transformers nor accelerate.
"""

from __future__ import annotations

import os
import re
import stat
import uuid
import weakref
from collections.abc import Mapping
from typing import Any

import torch.nn as nn

from ..checkpoint import load_checkpoint, save_checkpoint
from ..checkpointing.files import Folder, local_path
from ..checkpointing.reader import load_file
from ..core.errors import CheckpointError
from ..optim.loading.check import is_size
from ..optim.rank_state import add_hint
from ..optim.state_fit import describe
from ..zero1_optimizer import STATE_LOADED, Zero1Optimizer, zero1_optimizer_of

__all__ = ["save_beside", "load_beside", "read_reference", "refer_to_checkpoint", "checkpoint_reference"]

#: What a ``Zero1Optimizer`` hands a training loop that keeps one rank's optimizer file (the
#: Hugging Face Trainer's ``optimizer.pt``, accelerate's ``optimizer.bin``) once every rank's
#: state is in the nxd_smp checkpoint ``REFERENCE_FOLDER`` beside that file
#: (this module): a small dict naming that checkpoint by the id of its save.
REFERENCE_FORMAT = "nxd_smp.checkpoint_reference/1"
REFERENCE_FOLDER = "nxd_smp"
_REFERENCE_KEYS = {"format", "checkpoint", "id", "dp_size", "note"}


def is_reference(value: Any) -> bool:
    """Whether ``value`` claims to be a checkpoint reference (``check_reference`` says if it is one)."""
    return isinstance(value, Mapping) and value.get("format") == REFERENCE_FORMAT


def check_reference(value: Any, source: str) -> dict[str, Any]:
    """``value`` (read from ``source``) as a checkpoint reference, checked: its own keys, the
    folder name nxd_smp writes (never a path), a 32-digit hex id and a positive DP size.

    Raises:
        CheckpointError: naming what does not fit.
    """
    if not isinstance(value, Mapping) or set(value) != _REFERENCE_KEYS or value["format"] != REFERENCE_FORMAT:
        raise CheckpointError(f"{source}: not an nxd_smp checkpoint reference (keys {sorted(_REFERENCE_KEYS)}).")
    problems = []
    if value["checkpoint"] != REFERENCE_FOLDER:
        problems.append(f"checkpoint {value['checkpoint']!r} (nxd_smp writes {REFERENCE_FOLDER!r})")
    if not isinstance(value["id"], str) or not re.fullmatch(r"[0-9a-f]{32}", value["id"]):
        problems.append(f"id {describe(value['id'])} (32 hex digits)")
    if not is_size(value["dp_size"]) or value["dp_size"] < 1:
        problems.append(f"dp_size {describe(value['dp_size'])}")
    if not isinstance(value["note"], str) or len(value["note"]) > 1000:
        problems.append("note (text)")
    if problems:
        raise CheckpointError(f"{source}: the nxd_smp checkpoint reference is damaged or crafted: "
                              + "; ".join(problems) + ".")
    return dict(value)


#: How to load every rank's state from a loop's checkpoint folder, which the loops' own refusals
#: and the optimizer's (registered below) say.
HOW_TO_LOAD = ("With the Hugging Face Trainer add Zero1TrainerCallback(trainer) before train(); with accelerate call "
               "nxd_smp.interop.accelerate.register_accelerate_hooks(accelerator, model, optimizer) before "
               "load_state(); else nxd_smp.load_checkpoint(<that folder>/nxd_smp, model=..., optimizer=...).")
add_hint(f"format:{REFERENCE_FORMAT}",
         f"It is a reference to the nxd_smp checkpoint saved beside a training loop's optimizer file, which holds "
         f"every rank's optimizer state. {HOW_TO_LOAD}")
add_hint("another rank",
         "A training loop that writes one rank's optimizer file (the Hugging Face Trainer, accelerate's "
         "save_state) keeps every rank's state only with nxd_smp's hooks: Zero1TrainerCallback(trainer), "
         "nxd_smp.interop.accelerate.register_accelerate_hooks (docs/training_loops.md).")


class _ReferenceHooks:
    """The reference one optimizer's ``state_dict()`` returns from a save beside a loop's file until
    its state next changes (``Zero1Optimizer.state_generation``), and its acceptance by
    ``load_state_dict``: torch's optimizer hooks, registered once per optimizer."""

    def __init__(self, optimizer: Zero1Optimizer) -> None:
        self.reference: dict[str, Any] | None = None
        self.generation = -1
        optimizer.register_state_dict_pre_hook(self._state_dict)
        optimizer.register_load_state_dict_pre_hook(self._load_state_dict)

    def held(self, optimizer: Zero1Optimizer) -> dict[str, Any] | None:
        fresh = self.reference is not None and self.generation == optimizer.state_generation
        return dict(self.reference) if fresh else None

    def _state_dict(self, optimizer: Zero1Optimizer) -> dict[str, Any] | None:
        return self.held(optimizer)  # (a dict: the state dict, and the rank's state is not built)

    def _load_state_dict(self, optimizer: Zero1Optimizer, state_dict: Any) -> Any:
        if not is_reference(state_dict):
            return None
        reference = check_reference(state_dict, "the state dict")
        held = self.held(optimizer)
        if held is not None and held["id"] == reference["id"]:
            return STATE_LOADED  # what it names is this state: nothing to do
        loaded = "" if held is None else f" (the one loaded is save {held['id']})"
        raise CheckpointError(
            f"this state dict only refers to the nxd_smp checkpoint {reference['checkpoint']!r} saved beside the "
            f"file it came from (save {reference['id']}, DP {reference['dp_size']}), which holds every rank's "
            f"optimizer state and was not loaded{loaded}. {HOW_TO_LOAD}"
        )


_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def refer_to_checkpoint(optimizer: Any, reference: Mapping[str, Any] | None) -> None:
    """Until its state next changes (a step, a load), ``optimizer``'s ``state_dict()`` returns
    ``reference`` instead of this rank's state, and ``load_state_dict(reference)`` is accepted and
    changes nothing: every rank's state is in the nxd_smp checkpoint it names, just saved or
    loaded. None ends it.

    Raises:
        TypeError: ``optimizer`` holds no nxd_smp optimizer.
        CheckpointError: ``reference`` is not a checkpoint reference.
    """
    zero1 = require_zero1(optimizer)
    checked = None if reference is None else check_reference(reference, "refer_to_checkpoint")
    if zero1 not in _hooks:
        _hooks[zero1] = _ReferenceHooks(zero1)
    hooks = _hooks[zero1]
    hooks.reference, hooks.generation = checked, zero1.state_generation


def checkpoint_reference(optimizer: Any) -> dict[str, Any] | None:
    """The reference ``optimizer``'s ``state_dict()`` returns now (a copy), None if none."""
    zero1 = require_zero1(optimizer)
    return _hooks[zero1].held(zero1) if zero1 in _hooks else None


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
            raise CheckpointError(f"it holds save {found!r}, but the optimizer file beside it refers to save "
                             f"{self.save_id!r}: the folder mixes two saves")


def require_zero1(optimizer: Any) -> Zero1Optimizer:
    zero1 = zero1_optimizer_of(optimizer)
    if zero1 is None:
        raise TypeError(f"expected a nxd_smp Zero1Optimizer (or a wrapper holding one in .optimizer), got "
                        f"{type(optimizer).__name__}.")
    return zero1


def save_beside(folder: str | os.PathLike, model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Write ``model`` and every rank's optimizer state to the nxd_smp checkpoint
    ``folder/nxd_smp`` (every rank calls it), and make the optimizer's ``state_dict()`` the
    reference to it until its state next changes. Returns that reference.

    Raises:
        TypeError: ``optimizer`` is not a nxd_smp optimizer.
        ConfigError: ``folder`` is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: as ``nxd_smp.save_checkpoint``.
    """
    path = local_path(folder, "the loop's checkpoint folder") / REFERENCE_FOLDER
    zero1 = require_zero1(optimizer)
    save_id = zero1.backend.coordinator.broadcast(uuid.uuid4().hex)  # one id for every rank
    save_checkpoint(path, model=model, optimizer=zero1,
                    stateful={_IDENTITY: _SaveIdentity(save_id)})
    reference = {
        "format": REFERENCE_FORMAT,
        "checkpoint": REFERENCE_FOLDER,
        "id": save_id,
        "dp_size": zero1.world_size,
        "note": f"every rank's optimizer state is in the nxd_smp checkpoint '{REFERENCE_FOLDER}' beside this file "
                f"(see nxd_smp's docs/training_loops.md)",
    }
    refer_to_checkpoint(zero1, reference)
    return reference


def load_beside(folder: str | os.PathLike, model: nn.Module, optimizer: Any, reference: Any, *,
                where: str = "Copy the whole folder, hidden entries and links included (cp -a).") -> None:
    """Load the nxd_smp checkpoint that ``reference`` names in ``folder`` into ``model`` and
    ``optimizer`` at this DP size (every rank calls it), after checking it is that save; the
    optimizer then accepts ``load_state_dict(reference)`` until the next step. ``where``: the
    advice when the checkpoint is not in ``folder``.

    Raises:
        ConfigError: ``folder`` is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: the reference is damaged, the checkpoint is missing, another save, or
            refused by ``nxd_smp.load_checkpoint`` (on every rank, with nothing changed).
    """
    folder = local_path(folder, "the loop's checkpoint folder")
    zero1 = require_zero1(optimizer)
    reference = check_reference(reference, f"the optimizer file in {folder}")
    path = folder / reference["checkpoint"]
    if not os.path.lexists(path):
        raise CheckpointError(
            f"{path} is missing: the optimizer file in {folder} refers to the nxd_smp checkpoint saved there "
            f"(save {reference['id']}), which holds every rank's optimizer state. {where}"
        )
    try:
        load_checkpoint(path, model=model, optimizer=zero1, stateful={_IDENTITY: _SaveIdentity(reference["id"])})
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: {e}") from e
    refer_to_checkpoint(zero1, reference)


def read_reference(file: str | os.PathLike) -> dict[str, Any] | None:
    """The checkpoint reference a loop's optimizer file holds; None if the file is missing or
    holds something else (an optimizer state of its own). Read as a file of the loop's folder
    (``load_file``'s safe open: inside the folder, a regular file, never waiting on a FIFO).

    Raises:
        ConfigError: ``file`` is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: the file is unsafe (a link out of its folder, say), or holds a damaged
            reference.
    """
    file = local_path(file, "the loop's optimizer file")
    try:
        folder = Folder.open(file.parent)
    except (FileNotFoundError, CheckpointError):
        return None
    with folder:
        found = folder.lstat(file.name)
        if found is None or not stat.S_ISREG(found.st_mode) or found.st_size > _REFERENCE_MAX_BYTES:
            return None
        value = load_file(folder, file.name)
    return check_reference(value, str(file)) if is_reference(value) else None
