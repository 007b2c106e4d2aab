"""NxD's own checkpoint folders, read into nxd_smp: the way in for an NxD training run.

``neuronx_distributed.trainer.save_checkpoint(dir, tag, ...)`` writes one folder per tag::

    dir/<tag>/checkpoint                                  marker: a checkpoint folder
    dir/<tag>/model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt   model.state_dict() (DP rank 0 only)
    dir/<tag>/optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt   optimizer.state_dict(), per DP rank
                                                          for ZeRO-1 (torch_xla's layout)
    dir/<tag>/scheduler.pt, dir/<tag>/user_content.pt
    dir/<tag>/done                                        written last: the tag is complete

With ``use_xser=True`` each ``.pt`` holds ``torch_xla.utils.serialization.TensorReference``
objects in place of its tensors, which are files of their own in ``<name>.pt.tensors/
tensor_<id>.pt``. The newest complete tag is the one whose ``done`` is newest (NxD's rule).

``load_nxd`` reads a tag into a live model and ``Zero1Optimizer`` at the optimizer's own DP
size: the live model gives the parameter names and the param-group order, which NxD's files
hold only as integer ids. Every file goes through the strict reader; xser's reference class is
admitted by its name and becomes a plain record, nothing from the files runs. Everything is read
and checked before the model or the optimizer changes. With tensor or pipeline parallelism each
(TP, PP) coordinate reads its own files (its coordinate from NxD's parallel state, or else the
optimizer's topology); resharding is over DP only, and expert-parallel files (``ep_rank``) are
refused.

NxD Training's state dicts in the same layout are ``state_dicts``'; ``NxdTagFolders``
(``checkpoint_format``, a ``checkpointing.formats.FolderFormat``) is the format both make, which
nxd_smp's checkpoint entry points take.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ...backend.agreement import agree
from ...backend.coordination import Coordinator
from ...checkpointing.format import SCHEDULER, param_group_names
from ...checkpointing.links import DONE_FILE, MARKER_FILE
from ...checkpointing.load import check_full_optimizer_state, install_full_optimizer_state, name_differences
from ...checkpointing.paths import inside
from ...checkpointing.publish import fsync_dir
from ...checkpointing.reader import XserReference, load_file
from ...checkpointing.values import check_cast, check_scheduler_state, load_objects
from ...core.errors import CheckpointError
from ...optim.topology import Coordinate
from ...zero1_optimizer import Zero1Optimizer, zero1_optimizer_of
from ..torch_xla import full_state
from .parallel_state import nxd_coordinate

USER_CONTENT_FILE = "user_content.pt"
SCHEDULER_FILE = "scheduler.pt"
#: Written into a tag saved from state dicts: the format and the sizes it was saved at.
STATE_DICTS_FILE = "nxd_smp_state_dicts.json"
STATE_DICTS_FORMAT = "nxd_smp.state_dicts/1"
_RANK_FILE = re.compile(r"dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt")


def is_nxd_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a tag folder written by NxD's ``save_checkpoint``, or from state dicts
    by nxd_smp (complete or not; not one being written under a hidden name)."""
    if not path.is_dir() or path.is_symlink() or path.name.startswith("."):
        return False
    return (path / MARKER_FILE).is_file() or any(
        (path / sub).is_dir() and any(f.name.startswith("dp_rank_") for f in (path / sub).iterdir())
        for sub in ("model", "optim")
    )


def nxd_tags(directory: Path) -> list[Path]:
    """The complete NxD tag folders in ``directory``, oldest first (by their ``done``)."""
    if not directory.is_dir():
        return []
    done = [p for p in directory.iterdir() if is_nxd_checkpoint(p) and (p / DONE_FILE).is_file()]
    return sorted(done, key=lambda p: ((p / DONE_FILE).stat().st_mtime_ns, p.name))


def _here(coordinator: Coordinator, optimizer: Any = None) -> Coordinate:
    """This rank's place among NxD's rank files: NxD's parallel state where it is initialised, else
    the optimizer's topology (its data-, tensor- and pipeline-parallel ranks), else a rank of one
    data-parallel group."""
    here = nxd_coordinate()
    if here is not None:
        return here
    zero1 = zero1_optimizer_of(optimizer) if not isinstance(optimizer, Mapping) else None
    return zero1.topology.coordinate if zero1 is not None else Coordinate(coordinator.rank, coordinator.size, 0, 0)


def _rank_file(kind: str, dp: int, tp: int, pp: int) -> str:
    return f"{kind}/dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def _read(tag: Path, name: str) -> Any:
    """The file ``name`` of NxD's tag folder ``tag``, its xser tensors put back in place; every
    file resolved inside the folder, a regular file, loaded by ``checkpointing.reader.load_file``."""
    path = tag / name
    if not os.path.lexists(path):
        raise CheckpointError(f"the NxD checkpoint has no {path}.")
    tensors_name = f"{name}.tensors"
    if not os.path.lexists(tag / tensors_name):
        return load_file(path, folder=tag, name=name)
    tensors = inside(tag, tensors_name, source=str(path))
    data = load_file(path, folder=tag, name=name, kind="xser")  # its references read as XserReference

    tensors_by_id: dict[int, torch.Tensor] = {}  # a tensor referred to twice is loaded once
    containers: dict[int, tuple[Any, Any]] = {}  # by id(): a container referred to twice is rebuilt once

    def tensor(reference: XserReference) -> torch.Tensor:
        tid = reference.tid
        if not 0 <= tid < 1 << 62:  # (the reader checked its type; -1: a reference without one)
            raise CheckpointError(f"{path} holds a tensor reference without an integer id.")
        if tid not in tensors_by_id:
            file = tensors / f"tensor_{tid}.pt"
            if not os.path.lexists(file):
                raise CheckpointError(
                    f"{path} refers to tensor {tid}, which {tensors} does not hold (NxD leaves the model's "
                    f"tensors out under avoid_saving_lower_precision_weights=True; nxd_smp needs them)."
                )
            t = load_file(file, folder=tag, name=f"{tensors_name}/tensor_{tid}.pt")
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{file} does not hold a tensor.")
            tensors_by_id[tid] = t
        return tensors_by_id[tid]

    def restore(value: Any) -> Any:
        if isinstance(value, XserReference):
            return tensor(value)
        if not isinstance(value, (dict, list, tuple)):
            return value
        if id(value) not in containers:  # (the original kept alive with it, so its id is not reused)
            rebuilt = (type(value)((k, restore(v)) for k, v in value.items()) if isinstance(value, dict)
                       else type(value)(restore(v) for v in value))
            containers[id(value)] = (value, rebuilt)
        return containers[id(value)][1]

    return restore(data)


def _optimizer_files(tag: Path, tp: int, pp: int) -> list[Path]:
    """This (TP, PP) coordinate's optimizer files, in DP rank order."""
    folder = tag / "optim"
    if not folder.is_dir():
        return []
    if (folder / ".metadata").is_file():
        raise CheckpointError(
            f"{folder} is NxD's use_zero1_dcp layout (a torch.distributed.checkpoint directory of NxD's "
            f"own), which nxd_smp does not read; save that run again with use_zero1_dcp=False."
        )
    if any("ep_rank" in f.name for f in folder.iterdir()):
        raise CheckpointError(f"{folder} holds expert-parallel files (ep_rank); nxd_smp does not read those.")
    ranks = {}
    for f in folder.iterdir():
        m = _RANK_FILE.fullmatch(f.name)
        if m and (int(m.group(2)), int(m.group(3))) == (tp, pp):
            ranks[int(m.group(1))] = f
    if sorted(ranks) != list(range(len(ranks))):
        raise CheckpointError(f"{folder} has the DP ranks {sorted(ranks)} for tp {tp} pp {pp}; some are missing.")
    return [ranks[d] for d in range(len(ranks))]


def _full_state(records: list[Any], groups: list[list[str]], files: list[Path]):
    """Whole per-parameter optimizer state by name, param groups and masters (or None):
    torch_xla's ZeRO-1 layout (``interop.torch_xla.full_state``), or a plain torch optimizer's
    ``state_dict()`` (NxD without ZeRO-1: one replicated file, state by parameter id).
    ``groups``: the live optimizer's parameter names per group, which name NxD's ids."""
    first = records[0]
    if not isinstance(first, Mapping) or not isinstance(first.get("param_groups"), list) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in first["param_groups"]):
        raise CheckpointError(f"{files[0]} is not an optimizer state dict (no param_groups of parameters).")
    sizes = [len(g["params"]) for g in first["param_groups"]]
    if sizes != [len(g) for g in groups]:
        raise CheckpointError(
            f"{files[0]} holds param groups of {sizes} parameters, the optimizer's groups have "
            f"{[len(g) for g in groups]}: build the param groups as the run that saved it did."
        )
    order = [name for names in groups for name in names]
    if "base_state" in first:
        return full_state(records, order, files)
    by_id = dict(zip((i for g in first["param_groups"] for i in g["params"]), order))
    state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in order}
    if not isinstance(first.get("state", {}), Mapping):
        raise CheckpointError(f"{files[0]}: its state is not {{parameter id: state}}.")
    for i, entry in first.get("state", {}).items():
        if i not in by_id:
            raise CheckpointError(f"{files[0]} holds state for parameter {i!r}, which its param groups do not list.")
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"{files[0]}: the state of parameter {i!r} is not a dict.")
        state[by_id[i]] = dict(entry)
    return state, first["param_groups"], None


def load_nxd(
    tag: Path,
    *,
    model: nn.Module,
    optimizer: Zero1Optimizer | None,
    scheduler: Any,
    strict: bool,
    coordinator: Coordinator,
) -> Any:
    """Load the NxD checkpoint folder ``tag`` into ``model`` and ``optimizer`` (at the
    optimizer's own DP size) and ``scheduler``; return its user content (None without).
    Every rank calls it with the same ``tag``; each reads and checks its files, all agree
    (through ``coordinator``), then all commit or none does.

    A folder NxD's ``save_checkpoint`` began (its ``checkpoint`` marker) must be complete (its
    ``done``); a folder without either, such as NxD's checkpoint converter writes for
    pretrained weights, loads when named.

    Raises:
        CheckpointError: an incomplete tag, missing or unsafe files, or state that does not
            fit the model or the optimizer, each named; nothing is changed then.
    """
    weights, full, _, user_content = agree(coordinator, lambda: _load_scheduler(
        tag, scheduler, _read_and_check(tag, model, optimizer, scheduler, strict, _here(coordinator, optimizer))))
    live = model.state_dict()
    with torch.no_grad():
        model.load_state_dict({k: v for k, v in weights.items() if k in live}, strict=strict)
    if full is not None:
        install_full_optimizer_state(model, optimizer, *full)
    return user_content


def _load_scheduler(tag: Path, scheduler: Any, read: tuple) -> tuple[tuple, Any]:
    """Load the checked scheduler state (``read[2]``) before the ranks agree: ``read`` and the
    undo, as ``agree`` takes them."""
    if scheduler is None:
        return read, None
    return read, load_objects({SCHEDULER: scheduler}, {SCHEDULER: read[2]}, str(tag / SCHEDULER_FILE))


def _read_and_check(tag: Path, model: nn.Module, optimizer: Zero1Optimizer | None, scheduler: Any, strict: bool,
                    here: Coordinate):
    """This rank's files of ``tag`` (at its coordinate ``here``), read and checked against the live
    objects: (model weights, whole optimizer state or None, scheduler state or None, user content)."""
    _check_complete(tag)
    tp, pp = here.tensor, here.pipeline
    model_file = tag / _rank_file("model", 0, tp, pp)
    weights = _read(tag, _rank_file("model", 0, tp, pp))
    _check_weights(weights, model, strict, model_file)

    full = None
    if optimizer is not None:
        files = _optimizer_files(tag, tp, pp)
        if not files:
            raise CheckpointError(f"{tag} holds no optimizer files for tp {tp} pp {pp}; load it with optimizer=None.")
        groups = param_group_names(model, optimizer)
        full = _full_state([_read(tag, f"optim/{f.name}") for f in files], groups, files)
        check_full_optimizer_state(model, optimizer, *full,
                                   source=str(files[0]) + (f" (and {len(files) - 1} more)" if len(files) > 1 else ""))
        _check_masters_match_weights(full[2], weights, files[0])
    scheduler_state = _scheduler_state(tag, scheduler)
    user_content = _read(tag, USER_CONTENT_FILE) if os.path.lexists(tag / USER_CONTENT_FILE) else None
    return weights, full, scheduler_state, user_content


def _scheduler_state(tag: Path, scheduler: Any) -> Any:
    """The tag's ``scheduler.pt``, checked to fit ``scheduler`` (None: not asked for)."""
    if scheduler is None:
        return None
    state = _read(tag, SCHEDULER_FILE)
    check_scheduler_state(state, scheduler, str(tag / SCHEDULER_FILE))
    return state


def _check_complete(tag: Path) -> None:
    if (tag / MARKER_FILE).is_file() and not (tag / DONE_FILE).is_file():
        raise CheckpointError(f"the NxD checkpoint {tag} is incomplete (no '{DONE_FILE}' file): its save was cut off.")


def _check_weights(weights: Any, model: nn.Module, strict: bool, source: Path) -> None:
    """Raise unless ``weights`` (read from ``source``) is a state dict that fits ``model``."""
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{source} is not a state dict.")
    live = model.state_dict()
    problems = name_differences(live, weights, "missing from the checkpoint",
                                "in the checkpoint but not in the model") if strict else []
    for key in sorted(set(live) & set(weights), key=str):
        if not isinstance(weights[key], torch.Tensor) or weights[key].shape != live[key].shape:
            problems.append(f"{key}: {getattr(weights[key], 'shape', type(weights[key]).__name__)} in the "
                            f"checkpoint, {tuple(live[key].shape)} in the model")
            continue
        try:
            check_cast(weights[key], live[key].dtype, key)
        except CheckpointError as e:
            problems.append(str(e).rstrip("."))
    if problems:
        raise CheckpointError(f"{source} does not fit the model: " + "; ".join(problems) + ".")


def _check_masters_match_weights(masters: Mapping[str, torch.Tensor] | None, weights: Mapping[str, Any],
                                 source: Path) -> None:
    """NxD saved the weights and the master weights at the same step, so each master rounds
    to its parameter. NxD's files number the parameters; a live optimizer whose groups list
    them in another order than the saving run's would name them wrongly: refuse that."""
    if masters is None:
        return
    wrong = [name for name, master in masters.items()
             if isinstance(weights.get(name), torch.Tensor) and not torch.equal(master.to(weights[name].dtype), weights[name])]
    if wrong:
        raise CheckpointError(
            f"the master weights in {source} do not round to the model's weights of {wrong[:8]}: NxD's files "
            f"number the parameters in param-group order, and this optimizer's groups list them in another "
            f"order than the run that saved them. Build the param groups as that run did."
        )


def remove_tag(tag: Path) -> None:
    """Remove an NxD tag folder: its ``done`` first (an interrupted removal leaves a tag that
    looks incomplete, never one that looks complete), then the rest. Only a folder itself: a link
    is never followed (what it points to may be another run's), nor is one inside the folder.

    Raises:
        CheckpointError: ``tag`` is a link or not a folder; nothing is removed.
    """
    if tag.is_symlink() or not tag.is_dir():
        raise CheckpointError(f"{tag} is not an NxD tag folder (a link, or not a folder); nothing was removed.")
    (tag / DONE_FILE).unlink(missing_ok=True)
    fsync_dir(tag)
    shutil.rmtree(tag, ignore_errors=True)
