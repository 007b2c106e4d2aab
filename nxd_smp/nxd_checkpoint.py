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

from .checkpoint_format import CheckpointError, load_small_file, param_group_names
from .checkpoint_load import check_full_optimizer_state, install_full_optimizer_state
from .xla_state_dict import full_state
from .zero1_optimizer import Zero1Optimizer

__all__ = ["is_nxd_checkpoint", "nxd_tags", "load_nxd"]

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
            t = load_small_file(tensors / f"tensor_{value.tid}.pt") if (tensors / f"tensor_{value.tid}.pt").is_file() \
                else None
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{path} refers to tensor {value.tid}, which {tensors} does not hold.")
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


def _full_state(records: list[Any], order: list[str], files: list[Path]):
    """Whole per-parameter optimizer state by name, param groups and masters (or None):
    torch_xla's ZeRO-1 layout (``xla_state_dict.full_state``), or a plain torch optimizer's
    ``state_dict()`` (NxD without ZeRO-1: one replicated file, state by parameter id)."""
    first = records[0]
    if not isinstance(first, Mapping) or "param_groups" not in first:
        raise CheckpointError(f"{files[0]} is not an optimizer state dict (no param_groups).")
    ids = [i for g in first["param_groups"] for i in g["params"]]
    if len(ids) != len(order):
        raise CheckpointError(
            f"{files[0]} holds {len(ids)} parameters in its param groups, the optimizer manages {len(order)}."
        )
    if "base_state" in first:
        return full_state(records, order, files)
    by_id = dict(zip(ids, order))
    state: dict[str, dict[str, torch.Tensor]] = {name: {} for name in order}
    for i, entry in first.get("state", {}).items():
        state[by_id[i]] = dict(entry)
    return state, first["param_groups"], None


def load_nxd(
    tag: Path,
    *,
    model: nn.Module,
    optimizer: Zero1Optimizer | None,
    scheduler: Any,
    strict: bool,
) -> Any:
    """Load the NxD checkpoint folder ``tag`` into ``model`` and ``optimizer`` (at the
    optimizer's own DP size) and ``scheduler``; return its user content (None without).

    Raises:
        CheckpointError: an incomplete tag, missing or unsafe files, or state that does not
            fit the model or the optimizer, each named; nothing is changed then.
    """
    if not (tag / DONE_FILE).is_file():
        raise CheckpointError(f"the NxD checkpoint {tag} is incomplete (no '{DONE_FILE}' file): its save was cut off.")
    tp, pp = _coordinate()
    model_file = tag / "model" / f"dp_rank_00_tp_rank_{tp:02d}_pp_rank_{pp:02d}.pt"
    weights = _read(model_file)
    if not isinstance(weights, Mapping):
        raise CheckpointError(f"{model_file} is not a state dict.")
    live = model.state_dict()
    problems = []
    if strict:
        lacking, surplus = sorted(set(live) - set(weights)), sorted(set(weights) - set(live))
        problems += [f"missing from the checkpoint: {lacking}"] if lacking else []
        problems += [f"in the checkpoint but not in the model: {surplus}"] if surplus else []
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
        order = [name for names in param_group_names(model, optimizer) for name in names]
        full = _full_state([_read(f) for f in files], order, files)
        check_full_optimizer_state(model, optimizer, *full)
    scheduler_state = None
    if scheduler is not None:
        if not callable(getattr(scheduler, "load_state_dict", None)):
            raise TypeError(f"scheduler must have load_state_dict(), got {type(scheduler).__name__}.")
        scheduler_state = _read(tag / SCHEDULER_FILE)
    user_content = _read(tag / USER_CONTENT_FILE) if (tag / USER_CONTENT_FILE).is_file() else None

    with torch.no_grad():
        model.load_state_dict({k: v for k, v in weights.items() if k in live}, strict=strict)
    if full is not None:
        install_full_optimizer_state(model, optimizer, *full)
    if scheduler_state is not None:
        scheduler.load_state_dict(scheduler_state)
    return user_content
