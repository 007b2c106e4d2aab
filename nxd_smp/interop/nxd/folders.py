"""NxD's own checkpoint folders, read into the staged state of nxd_smp's load pipeline: the way in for an
NxD training run.

``neuronx_distributed.trainer.save_checkpoint(dir, tag, ...)`` writes one folder per tag::

    dir/<tag>/checkpoint                                  marker: a checkpoint folder
    dir/<tag>/model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt   model.state_dict() (DP rank 0 only)
    dir/<tag>/optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt   optimizer.state_dict(), per DP rank
                                                          for ZeRO-1 (torch_xla's layout)
    dir/<tag>/scheduler.pt, dir/<tag>/user_content.pt
    dir/<tag>/done                                        written last: the tag is complete

With ``use_xser=True`` each ``.pt`` holds ``torch_xla.utils.serialization.TensorReference`` objects in
place of its tensors, which are files of their own in ``<name>.pt.tensors/tensor_<id>.pt``. The newest
complete tag is the one whose ``done`` is newest (NxD's rule).

``read_tag`` reads a tag for a live model and ``Zero1Optimizer`` at the optimizer's own DP size: the
live model gives the parameter names and the param-group order, which NxD's files hold only as integer
ids. Every file is opened below the tag's folder without following a link (``checkpointing.files``) and
read by the strict reader; xser's reference class is admitted by its name and becomes a plain record,
nothing from the files runs. With tensor or pipeline parallelism each (TP, PP) coordinate reads its own
files (its coordinate from NxD's parallel state, or else the optimizer's topology); resharding is over
DP only, and expert-parallel files (``ep_rank``) are refused. The check, the agreement and the install
are the pipeline's (``optim.loading``).
"""

from __future__ import annotations

import re
import stat
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Hashable

import torch

from ...checkpointing.files import Folder, check_name
from ...checkpointing.object_io import S3Path, objects_below
from ...checkpointing.room import Room
from ...checkpointing.reader import check_distinct, load_file
from ...checkpointing.unpickler import XserReference
from ...checkpointing.typed_json import loads
from ...checkpointing.versions import COMPLETE_FILE, DONE_FILE, MARKER_FILE
from ...core.errors import CheckpointError
from ...optim.loading.check import SCHEDULER
from ...optim.loading.run import full_state
from ...optim.loading.staged import Request, Staged, StagedModel, Targets
from ...optim.state_fit import numbered_names
from ...optim.topology import Coordinate
from ...zero1_optimizer import zero1_optimizer_of
from ..torch_xla import full_state_of
from .parallel_state import nxd_coordinate

USER_CONTENT_FILE = "user_content.pt"
SCHEDULER_FILE = "scheduler.pt"
#: Written into a tag saved from state dicts: the format and the sizes it was saved at.
STATE_DICTS_FILE = "nxd_smp_state_dicts.json"
STATE_DICTS_FORMAT = "nxd_smp.state_dicts/1"
#: The completion record of a tag saved from state dicts to object storage (``COMPLETE.json``, which its commit
#: record pins): per file its size and CRC-32.
STORE_COMPLETE_FORMAT = "nxd_smp.state_dicts.complete/1"
_RANK_FILE = re.compile(r"dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt")


# ---------------------------------------------------------------------------- the folders
def is_nxd_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a tag folder written by NxD's ``save_checkpoint``, or from state dicts by
    nxd_smp (complete or not; not a link, not one being written under a hidden name)."""
    if path.name.startswith(".") or not path.name:
        return False
    try:
        with Folder.open(path.parent) as parent:
            if not parent.is_dir(path.name):
                return False
            with parent.sub(path.name) as tag:
                return tag.is_file(MARKER_FILE) or any(_has_rank_files(tag, sub) for sub in ("model", "optim"))
    except (OSError, CheckpointError):
        return False


def _has_rank_files(tag: Room, sub: str) -> bool:
    if not tag.is_dir(sub):
        return False
    with tag.sub(sub) as folder:
        return any(name.startswith("dp_rank_") for name in folder.names())


def nxd_tags(directory: Path) -> list[Path]:
    """The complete NxD tag folders in ``directory``, oldest first (by their ``done``)."""
    try:
        root = Folder.open(directory)
    except (OSError, CheckpointError):
        return []
    with root:
        found = []
        for name in root.names():
            if name.startswith(".") or not root.is_dir(name) or not is_nxd_checkpoint(directory / name):
                continue
            done = root.lstat(f"{name}/{DONE_FILE}")
            if done is not None and stat.S_ISREG(done.st_mode):
                found.append((done.st_mtime_ns, name))
    return [directory / name for _, name in sorted(found)]


def is_complete(path: Path) -> bool:
    try:
        with Folder.open(path) as tag:
            return tag.is_file(DONE_FILE)
    except (OSError, CheckpointError):
        return False


def remove_tag(tag: Path) -> None:
    """Remove an NxD tag folder: its ``done`` first (an interrupted removal leaves a tag that looks
    incomplete, never one that looks complete), then the rest. Only a folder itself: a link is never
    followed (what it points to may be another run's), nor is one inside the folder.

    Raises:
        CheckpointError: ``tag`` is a link or not a folder; nothing is removed.
    """
    with Folder.open(tag.parent) as parent:
        if parent.is_link(tag.name) or not parent.is_dir(tag.name):
            raise CheckpointError(f"{tag} is not an NxD tag folder (a link, or not a folder); nothing was removed.")
        with parent.sub(tag.name) as folder:
            folder.unlink(DONE_FILE)
            folder.fsync()
        parent.remove_tree(tag.name)


def here(targets: Targets) -> Coordinate:
    """This rank's place among NxD's rank files: NxD's parallel state where it is initialised, else the
    optimizer's topology (its data-, tensor- and pipeline-parallel ranks), else a rank of one
    data-parallel group."""
    found = nxd_coordinate()
    if found is not None:
        return found
    zero1 = zero1_optimizer_of(targets.optimizer) if not isinstance(targets.optimizer, Mapping) else None
    if zero1 is not None:
        return zero1.topology.coordinate
    coordinator = targets.backend.coordinator
    return Coordinate(coordinator.rank, coordinator.size, 0, 0)


def rank_file(kind: str, dp: int, tp: int, pp: int) -> str:
    return f"{kind}/dp_rank_{dp:02d}_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"


def read_file(tag: Room, name: str, replicated: dict[str, int] | None = None,
              once: dict[Hashable, str] | None = None) -> Any:
    """The file ``name`` of NxD's tag folder ``tag``, its xser tensors put back in place; every file
    opened below the tag without following a link, loaded by the strict reader. ``replicated``: where
    the checksums of the files read go (from their zip records' CRC-32s), by name, for a file every rank
    of a data-parallel group reads alike. ``once``: the files this load has read (``reader.load_file``),
    so that no file is read twice under two names (a hard link).

    An xser tensor id met twice is loaded once: torch_xla's ``save`` writes one reference per tensor and
    NxD's one per place a tensor is (both number the tensors by instance), so one id at two places is
    one tensor that was at both; as a parameter's moment or master, which is a tensor of its own, that is
    refused (``torch_xla.full_state_of``, ``_full_state``)."""
    if not tag.exists(name):
        raise CheckpointError(f"the NxD checkpoint has no {tag.where(name)}.")
    checksums: list[int] = []
    tensors_name = f"{name}.tensors"
    if not tag.exists(tensors_name):
        value = load_file(tag, name, checksums=checksums, once=once)
        if replicated is not None:
            replicated[name] = checksums[0]
        return value
    data = load_file(tag, name, kind="xser", checksums=checksums, once=once)  # its references: XserReference
    tensors_by_id: dict[int, torch.Tensor] = {}  # a tensor referred to twice is loaded once
    containers: dict[int, tuple[Any, Any]] = {}  # by id(): a container referred to twice is rebuilt once

    with tag.sub(tensors_name) as tensors:
        def tensor(reference: XserReference) -> torch.Tensor:
            tid = reference.tid
            if not 0 <= tid < 1 << 62:  # (the reader checked its type; -1: a reference without one)
                raise CheckpointError(f"{tag.where(name)} holds a tensor reference without an integer id.")
            if tid not in tensors_by_id:
                if not tensors.exists(f"tensor_{tid}.pt"):
                    raise CheckpointError(
                        f"{tag.where(name)} refers to tensor {tid}, which {tensors.where()} does not hold (NxD leaves "
                        f"the model's tensors out under avoid_saving_lower_precision_weights=True; nxd_smp needs them).")
                t = load_file(tensors, f"tensor_{tid}.pt", checksums=checksums, once=once)
                if not isinstance(t, torch.Tensor):
                    raise CheckpointError(f"{tensors.where(f'tensor_{tid}.pt')} does not hold a tensor.")
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

        value = restore(data)
    if replicated is not None:
        replicated[name] = zlib.crc32(b"".join(c.to_bytes(4, "little") for c in checksums))
    return value


def optimizer_files(tag: Room, tp: int, pp: int) -> list[str]:
    """This (TP, PP) coordinate's optimizer files (names in the tag), in DP rank order."""
    if not tag.is_dir("optim"):
        return []
    with tag.sub("optim") as folder:
        names = folder.names()
    if ".metadata" in names:
        raise CheckpointError(f"{tag.where('optim')} is NxD's use_zero1_dcp layout (a torch.distributed.checkpoint "
                              f"directory of NxD's own), which nxd_smp does not read; save that run again with "
                              f"use_zero1_dcp=False.")
    if any("ep_rank" in name for name in names):
        raise CheckpointError(f"{tag.where('optim')} holds expert-parallel files (ep_rank); nxd_smp does not read those.")
    ranks = {}
    for name in names:
        m = _RANK_FILE.fullmatch(name)
        if m and (int(m.group(2)), int(m.group(3))) == (tp, pp):
            ranks[int(m.group(1))] = f"optim/{name}"
    if sorted(ranks) != list(range(len(ranks))):
        raise CheckpointError(f"{tag.where('optim')} has the DP ranks {sorted(ranks)} for tp {tp} pp {pp}; some are "
                              f"missing.")
    return [ranks[d] for d in range(len(ranks))]


def _is_tag_listing(names: Iterable[str]) -> bool:
    """Whether the files ``names`` (relative to a folder) are an NxD tag's: ``done`` and rank files."""
    names = set(names)
    return DONE_FILE in names and any(name.split("/")[0] in ("model", "optim") and "/dp_rank_" in name
                                      for name in names)


def newest_tag_in_bucket(path: S3Path) -> S3Path | None:
    """NxD's own tag folder at ``path`` in a bucket (as NxD's S3 storage writes it: the files under the tag's
    prefix, ``done`` last), or the newest complete one directly under it by its ``done``'s time (NxD's own
    rule, as on disk); None if there is none. A tag without ``done`` (being written, or cut off) is none.

    Raises:
        CheckpointError: the bucket cannot be listed.
    """
    objects = objects_below(path)
    if _is_tag_listing(objects):
        return path
    done = {name.split("/")[0]: mtime for name, (_, mtime) in objects.items()
            if name.count("/") == 1 and name.endswith(f"/{DONE_FILE}") and not name.startswith(".")}
    tags = [tag for tag in done if _is_tag_listing(name[len(tag) + 1:] for name in objects
                                                   if name.startswith(f"{tag}/"))]
    return path / max(tags, key=lambda tag: (done[tag], tag)) if tags else None


def store_completion(version: Room) -> dict[str, tuple[int, int]]:
    """The files a tag saved from state dicts to object storage holds, from its ``COMPLETE.json`` (which the
    commit record pins): name -> (size, CRC-32).

    Raises:
        CheckpointError: the record is missing or not one ``save_state_dicts`` writes.
    """
    source = str(version.where(COMPLETE_FILE))
    value = loads(version.read_bytes(COMPLETE_FILE, limit=1 << 24), source)
    files = value.get("files") if isinstance(value, dict) and value.get("format") == STORE_COMPLETE_FORMAT else None
    if not (isinstance(files, dict) and set(value) == {"format", "files"} and all(
            isinstance(name, str) and isinstance(entry, list) and len(entry) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63 for v in entry)
            for name, entry in files.items())):
        raise CheckpointError(f"{source} is not the completion record of a tag saved from state dicts "
                              f"({{'format': {STORE_COMPLETE_FORMAT!r}, 'files': {{name: [size, CRC-32]}}}}).")
    for name in files:
        check_name(name, source)
    return {name: (size, crc) for name, (size, crc) in files.items()}


def check_complete(tag: Room) -> None:
    if tag.is_file(MARKER_FILE) and not tag.is_file(DONE_FILE):
        raise CheckpointError(f"the NxD checkpoint {tag.where()} is incomplete (no '{DONE_FILE}' file): its save was cut "
                              f"off.")


def stage_model(staged: Staged, weights: Any, source: str) -> None:
    """A model state dict read from ``source`` into ``staged`` (its tensors; anything else refused)."""
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{source} is not a state dict.")
    odd = [key for key, value in weights.items() if not isinstance(key, str) or not isinstance(value, torch.Tensor)]
    if odd:
        raise CheckpointError(f"{source} holds entries that are not tensors: {odd[:8]}.")
    staged.model = StagedModel({key: (tuple(value.shape), value.dtype) for key, value in weights.items()},
                               dict(weights), source)


def stage_objects(staged: Staged, tag: Room, request: Request, once: dict[Hashable, str] | None = None
                  ) -> None:
    """The scheduler's state (when asked for) and the user content of ``tag`` into ``staged``."""
    if SCHEDULER in request.objects:
        staged.objects.states[SCHEDULER] = read_file(tag, SCHEDULER_FILE, staged.replicated, once)
        staged.objects.source = str(tag.where(SCHEDULER_FILE))
    if tag.exists(USER_CONTENT_FILE):
        staged.extra = read_file(tag, USER_CONTENT_FILE, staged.replicated, once)


# ---------------------------------------------------------------------------- NxD's own tags
def read_tag(tag: Room, targets: Targets, request: Request) -> Staged:
    """This rank's files of NxD's tag folder ``tag`` (at its coordinate), staged for a live model
    and ``Zero1Optimizer``: the model's weights, the whole per-parameter optimizer state (torch_xla's
    ZeRO-1 layout over every DP rank's file, or a plain optimizer's replicated one), the master weights
    where NxD saved them, the scheduler's state and the user content.

    Raises:
        CheckpointError: an incomplete tag, missing or unsafe files, or files that do not belong together.
    """
    coordinate = here(targets)
    check_complete(tag)
    staged = Staged(source=str(tag.where()))
    once: dict[Hashable, str] = {}  # every file read once
    model_file = rank_file("model", 0, coordinate.tensor, coordinate.pipeline)
    weights = read_file(tag, model_file, staged.replicated, once)
    stage_model(staged, weights, str(tag.where(model_file)))
    if targets.rank_state is not None:
        files = optimizer_files(tag, coordinate.tensor, coordinate.pipeline)
        if not files:
            raise CheckpointError(f"{tag.where()} holds no optimizer files for tp {coordinate.tensor} pp "
                                  f"{coordinate.pipeline}; load it with optimizer=None.")
        groups = targets.groups
        source = str(tag.where(files[0])) + (f" (and {len(files) - 1} more)" if len(files) > 1 else "")
        state, hypers, masters = _full_state([read_file(tag, f, staged.replicated, once) for f in files], groups,
                                             [tag.where(f) for f in files])
        _check_masters_match_weights(masters, weights, source)
        staged.optimizer = full_state(state, hypers, masters, source=source)
    stage_objects(staged, tag, request, once)
    return staged


def _full_state(records: list[Any], groups: list[list[str]], files: list[Path]):
    """Whole per-parameter optimizer state by name, param groups and masters (or None): torch_xla's ZeRO-1
    layout (``interop.torch_xla.full_state_of``), or a plain torch optimizer's ``state_dict()`` (NxD without
    ZeRO-1: one replicated file, state by parameter id). ``groups``: the live optimizer's parameter names
    per group, which name NxD's ids."""
    first = records[0]
    if not isinstance(first, Mapping) or not isinstance(first.get("param_groups"), list) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in first["param_groups"]):
        raise CheckpointError(f"{files[0]} is not an optimizer state dict (no param_groups of parameters).")
    by_id = numbered_names(first["param_groups"], groups, str(files[0]))
    order = [name for names in groups for name in names]
    if "base_state" in first:
        return full_state_of(records, order, files)
    state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in order}
    if not isinstance(first.get("state", {}), Mapping):
        raise CheckpointError(f"{files[0]}: its state is not {{parameter id: state}}.")
    check_distinct([(f"state/{i}/{key}", v) for i, entry in first.get("state", {}).items() if isinstance(entry, Mapping)
                    for key, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0], str(files[0]),
                   "each moment is a tensor of its own")
    for i, entry in first.get("state", {}).items():
        if isinstance(i, bool) or i not in by_id:
            raise CheckpointError(f"{files[0]} holds state for parameter {i!r}, which its param groups do not list.")
        if not isinstance(entry, Mapping):
            raise CheckpointError(f"{files[0]}: the state of parameter {i!r} is not a dict.")
        state[by_id[i]] = dict(entry)
    return state, first["param_groups"], None


def _check_masters_match_weights(masters: Mapping[str, torch.Tensor] | None, weights: Mapping[str, Any],
                                 source: str) -> None:
    """NxD saved the weights and the master weights at the same step, so each master rounds to its
    parameter. NxD's files number the parameters; a live optimizer whose groups list them in another order
    than the saving run's would name them wrongly: refuse that."""
    if masters is None:
        return
    wrong = [name for name, master in masters.items()
             if isinstance(weights.get(name), torch.Tensor) and isinstance(master, torch.Tensor)
             and master.shape == weights[name].shape and not torch.equal(master.to(weights[name].dtype), weights[name])]
    if wrong:
        raise CheckpointError(
            f"the master weights in {source} do not round to the model's weights of {wrong[:8]}: NxD's files number "
            f"the parameters in param-group order, and this optimizer's groups list them in another order than the run "
            f"that saved them. Build the param groups as that run did.")
