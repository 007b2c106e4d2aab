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
hold only as integer ids. Every file is read with ``torch.load(weights_only=True)``; xser's
reference class is admitted by its name and becomes a plain record, nothing from the files
runs. Everything is read and checked before the model or the optimizer changes. With tensor
or pipeline parallelism each (TP, PP) coordinate reads its own files (its coordinate comes
from NxD's parallel state); resharding is over DP only, and expert-parallel files
(``ep_rank``) are refused.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .backend import Coordinator
from .checkpoint_format import CheckpointError, load_small_file, param_group_names
from .checkpoint_load import agree, check_full_optimizer_state, install_full_optimizer_state, name_differences
from .xla_state_dict import full_state
from .zero1_optimizer import Zero1Optimizer

__all__ = ["is_nxd_checkpoint", "nxd_tags", "load_nxd", "DONE_FILE"]

DONE_FILE = "done"
MARKER_FILE = "checkpoint"
USER_CONTENT_FILE = "user_content.pt"
SCHEDULER_FILE = "scheduler.pt"
XSER_REFERENCE = "torch_xla.utils.serialization.TensorReference"
_RANK_FILE = re.compile(r"dp_rank_(\d+)_tp_rank_(\d+)_pp_rank_(\d+)\.pt")
_XSER_ADMISSION = threading.Lock()


class _TensorReference:
    """What an xser ``TensorReference`` unpickles to: only its tensor id."""

    tid: int


def is_nxd_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a tag folder written by NxD's ``save_checkpoint`` (complete or not)."""
    if not path.is_dir():
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


def _coordinate() -> tuple[int, int]:
    """This process's (TP rank, PP rank) in NxD's parallel state; (0, 0) without it."""
    try:
        ps = importlib.import_module("neuronx_distributed.parallel_layers.parallel_state")
    except ImportError:
        return 0, 0
    if not ps.model_parallel_is_initialized():
        return 0, 0
    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


def _read(path: Path) -> Any:
    """One of NxD's ``.pt`` files, its xser tensors put back in place."""
    if not path.is_file():
        raise CheckpointError(f"the NxD checkpoint has no {path}.")
    tensors = Path(f"{path}.tensors")
    if not tensors.is_dir():
        return load_small_file(path)
    # torch's allow-list is process-wide and its context manager restores it on exit, so
    # threads loading at once (XLA replicas) take turns: one thread's exit must not end
    # another's admission.
    with _XSER_ADMISSION, torch.serialization.safe_globals([(_TensorReference, XSER_REFERENCE)]):
        data = load_small_file(path)

    def restore(value: Any) -> Any:
        if isinstance(value, _TensorReference):
            if not isinstance(getattr(value, "tid", None), int):
                raise CheckpointError(f"{path} holds a tensor reference without an integer id.")
            file = tensors / f"tensor_{value.tid}.pt"
            if not file.is_file():
                raise CheckpointError(
                    f"{path} refers to tensor {value.tid}, which {tensors} does not hold (NxD leaves the model's "
                    f"tensors out under avoid_saving_lower_precision_weights=True; nxd_smp needs them)."
                )
            t = load_small_file(file)
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{file} does not hold a tensor.")
            return t
        if isinstance(value, dict):
            return type(value)((k, restore(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(restore(v) for v in value)
        return value

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
    torch_xla's ZeRO-1 layout (``xla_state_dict.full_state``), or a plain torch optimizer's
    ``state_dict()`` (NxD without ZeRO-1: one replicated file, state by parameter id).
    ``groups``: the live optimizer's parameter names per group, which name NxD's ids."""
    first = records[0]
    if not isinstance(first, Mapping) or not isinstance(first.get("param_groups"), list):
        raise CheckpointError(f"{files[0]} is not an optimizer state dict (no param_groups).")
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
    for i, entry in first.get("state", {}).items():
        if i not in by_id:
            raise CheckpointError(f"{files[0]} holds state for parameter {i!r}, which its param groups do not list.")
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
    error, read = None, None
    try:
        read = _read_and_check(tag, model, optimizer, scheduler, strict)
    except (CheckpointError, OSError) as e:
        error = e
    agree(coordinator, error)
    weights, full, scheduler_state, user_content = read
    live = model.state_dict()
    with torch.no_grad():
        model.load_state_dict({k: v for k, v in weights.items() if k in live}, strict=strict)
    if full is not None:
        install_full_optimizer_state(model, optimizer, *full)
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    return user_content


def _read_and_check(tag: Path, model: nn.Module, optimizer: Zero1Optimizer | None, scheduler: Any, strict: bool):
    """This rank's files of ``tag``, read and checked against the live objects: (model
    weights, whole optimizer state or None, scheduler state or None, user content)."""
    if (tag / MARKER_FILE).is_file() and not (tag / DONE_FILE).is_file():
        raise CheckpointError(f"the NxD checkpoint {tag} is incomplete (no '{DONE_FILE}' file): its save was cut off.")
    tp, pp = _coordinate()
    model_file = tag / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
    weights = _read(model_file)
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{model_file} is not a state dict.")
    live = model.state_dict()
    problems = name_differences(live, weights, "missing from the checkpoint",
                                "in the checkpoint but not in the model") if strict else []
    for key in sorted(set(live) & set(weights)):
        if not isinstance(weights[key], torch.Tensor) or weights[key].shape != live[key].shape:
            problems.append(f"{key}: {getattr(weights[key], 'shape', type(weights[key]).__name__)} in the "
                            f"checkpoint, {tuple(live[key].shape)} in the model")
    if problems:
        raise CheckpointError(f"{model_file} does not fit the model: " + "; ".join(problems) + ".")

    full = None
    if optimizer is not None:
        files = _optimizer_files(tag, tp, pp)
        if not files:
            raise CheckpointError(f"{tag} holds no optimizer files for tp {tp} pp {pp}; load it with optimizer=None.")
        groups = param_group_names(model, optimizer)
        full = _full_state([_read(f) for f in files], groups, files)
        check_full_optimizer_state(model, optimizer, *full)
        _check_masters_match_weights(full[2], weights, files[0])
    scheduler_state = _read(tag / SCHEDULER_FILE) if scheduler is not None else None
    user_content = _read(tag / USER_CONTENT_FILE) if (tag / USER_CONTENT_FILE).is_file() else None
    return weights, full, scheduler_state, user_content


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
