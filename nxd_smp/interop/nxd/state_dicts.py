"""NxD Training's state dicts, in NxD's tag-folder layout (``folders``).

NxD Training passes state dicts instead of objects (``save_checkpoint(dir, tag, model=<model
state dict>, optimizer=<optimizer state dict>, user_content=...)``, and on resume empty dicts that
NxD fills in place for Lightning to load). ``save_state_dicts`` writes them in NxD's layout, each
rank its own optimizer file whatever ``zero1_optimizer`` says (nxd_smp's state dict is this rank's
shard), under a hidden name renamed into place once complete (the ranks' one write-and-publish);
``load_state_dicts`` fills them back, at the DP size they were saved at (a state dict is
rank-local), or loads them into live objects, each checked by the one state-fit check first.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ...backend import Backend
from ...backend.agreement import agree, error_text
from ...backend.coordination import Coordinator
from ...checkpointing.links import DONE_FILE, MARKER_FILE
from ...checkpointing.paths import read_json
from ...checkpointing.publish import fsync_dir, place_directory, write_and_publish
from ...checkpointing.save import check_async_save
from ...checkpointing.storage import write_bytes
from ...checkpointing.writer import start_save
from ...core.errors import CheckpointError
from ...optim.state_fit import StateFit, torch_group_problems, torch_state_dict
from ...zero1_optimizer import zero1_optimizer_of
from .folders import (
    SCHEDULER_FILE,
    STATE_DICTS_FILE,
    STATE_DICTS_FORMAT,
    USER_CONTENT_FILE,
    _check_weights,
    _here,
    _load_scheduler,
    _optimizer_files,
    _rank_file,
    _read,
    _scheduler_state,
    is_nxd_checkpoint,
    nxd_tags,
    remove_tag,
)

# ---------------------------------------------------------------- NxD Training's state dicts
def _map_tensors(value: Any, fn) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it (dicts, lists, tuples); a dict keeps
    its type and attributes (a model state dict's ``_metadata``)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        out = type(value)((k, _map_tensors(v, fn)) for k, v in value.items())
        if hasattr(value, "__dict__"):  # (a plain dict has none)
            out.__dict__.update(value.__dict__)
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _serialized(value: Any, backend: Backend) -> bytes:
    """``value``'s bytes as ``torch.save`` writes them, every tensor on the host in the dtype the
    device holds it in: taken now, so an asynchronous save writes what the state was at the call."""
    tensors: list[torch.Tensor] = []
    _map_tensors(value, tensors.append)
    host = iter(backend.to_host(tensors)[0])
    buffer = io.BytesIO()
    torch.save(_map_tensors(value, lambda _: next(host)), buffer)
    return buffer.getvalue()


def save_state_dicts(
    tag: Path,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    user_content: Any,
    backend: Backend,
    async_save: bool,
    num_kept: int | None,
) -> Path:
    """Write the state dicts NxD Training passes (or ``state_dict()`` of objects given with them)
    into the tag folder ``tag``, in NxD's layout; every rank calls it.

    ``model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt`` comes from data-parallel rank 0 of each
    tensor/pipeline coordinate (the model is replicated over data parallelism), ``optim/
    dp_rank_DD_tp_rank_TT_pp_rank_PP.pt`` from every rank (a ZeRO-1 state dict is this rank's
    shard), ``scheduler.pt``, ``user_content.pt`` and ``nxd_smp_state_dicts.json`` (the DP size)
    from rank 0, ``done`` last. The folder is written under a hidden name and renamed into place
    once complete; a tag saved again replaces the old folder, whose ``done`` goes first. Returns
    ``tag``.

    Raises:
        CheckpointError: ``tag`` is something else than a tag folder, or a rank failed to write.
    """
    coordinator = backend.coordinator
    if async_save:
        check_async_save(coordinator)
    here = _here(coordinator, optimizer)
    files: dict[str, bytes] = {}
    if model is not None and here.data == 0:
        files[_rank_file("model", 0, here.tensor, here.pipeline)] = _serialized(model, backend)
    if optimizer is not None:
        files[_rank_file("optim", here.data, here.tensor, here.pipeline)] = _serialized(optimizer, backend)
    if coordinator.rank == 0:
        if scheduler is not None:
            files[SCHEDULER_FILE] = _serialized(scheduler.state_dict(), backend)
        if user_content is not None:
            files[USER_CONTENT_FILE] = _serialized(user_content, backend)
        record = {"format": STATE_DICTS_FORMAT, "data_parallel_size": here.data_size, "world_size": coordinator.size}
        files[STATE_DICTS_FILE] = json.dumps(record).encode()
    staging = tag.parent / coordinator.broadcast(f".{tag.name}.partial-{uuid.uuid4().hex[:12]}")
    refusal = None
    if coordinator.rank == 0:
        try:
            if os.path.lexists(tag) and not (is_nxd_checkpoint(tag) or (tag.is_dir() and not tag.is_symlink()
                                                                         and not any(tag.iterdir()))):
                raise CheckpointError(f"{tag} exists and is not a checkpoint tag folder; pass another tag or remove it.")
            staging.mkdir(parents=True)
            (staging / MARKER_FILE).write_text("1")
        except Exception as e:  # noqa: BLE001 - every rank learns of it below
            refusal = error_text(e)
    refusal = coordinator.broadcast(refusal)
    if refusal is not None:
        raise CheckpointError(f"the save of {tag} was refused: {refusal}")

    def work() -> None:
        _write_and_publish(tag, staging, files, coordinator, num_kept)

    if async_save:
        start_save(str(tag), work)
    else:
        work()
    return tag


def _write_and_publish(tag: Path, staging: Path, files: Mapping[str, bytes], coordinator: Coordinator,
                       num_kept: int | None) -> None:
    """Every rank writes its files into ``staging``; once all have, rank 0 writes ``done``, puts the
    folder in place of ``tag`` (an older one there loses its ``done`` first, so a tag that looks
    complete always is) and applies the retention (``publish.write_and_publish``)."""

    def write() -> None:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            write_bytes(staging / name, data)

    def publish(_: list) -> None:
        for folder in (staging / "model", staging / "optim", staging):
            if folder.is_dir():
                fsync_dir(folder)
        write_bytes(staging / DONE_FILE, b"1")
        fsync_dir(staging)
        place_directory(staging, tag, replace=True, retire=_retire)
        if num_kept is not None:
            for old in nxd_tags(tag.parent)[:-num_kept]:
                if old.name != tag.name:
                    remove_tag(old)

    write_and_publish(coordinator, write, publish, what=str(tag),
                      discard=lambda: shutil.rmtree(staging, ignore_errors=True))


def _retire(tag: Path) -> None:
    """The tag folder about to be replaced loses its ``done`` first."""
    (tag / DONE_FILE).unlink(missing_ok=True)
    fsync_dir(tag)


def load_state_dicts(
    tag: Path,
    *,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    strict: bool,
    coordinator: Coordinator,
) -> Any:
    """Read the tag folder ``tag`` into state dicts (filled in place, as NxD fills those NxD
    Training passes) or into live objects (a module, an optimizer, which get
    ``load_state_dict``); ``optimizer=None`` loads the model only. Returns the user content.
    Every rank reads its own files (an optimizer file is a data-parallel rank's shard, so the DP
    size must be the one saved), all agree, then all fill or none does.

    Raises:
        CheckpointError: incomplete, at another DP size, missing or unsafe files, or state that
            does not fit a live object, each named; nothing is changed then.
    """
    weights, optimizer_state, _, user_content = agree(coordinator, lambda: _load_scheduler(
        tag, scheduler, _read_state_dicts(tag, model, optimizer, scheduler, strict, coordinator)))
    for target, value in ((model, weights), (optimizer, optimizer_state)):
        if value is None:
            continue
        if isinstance(target, MutableMapping):
            target.update(value)  # NxD's way: every saved entry set, in place
        elif isinstance(target, nn.Module):
            with torch.no_grad():
                target.load_state_dict(value, strict=strict)
        elif zero1_optimizer_of(target) is None and isinstance(_torch_optimizer(target), torch.optim.Optimizer):
            # a plain torch optimizer (ZeRO-1 off): the checked state, with the live kernel options
            live = _torch_optimizer(target)
            target.load_state_dict(torch_state_dict(live.param_groups, value["param_groups"], value["state"]))
        else:
            target.load_state_dict(value)
    return user_content


def _saved_data_parallel_size(tag: Path) -> int | None:
    """The DP size a tag saved from state dicts by nxd_smp was saved at (None: not such a tag),
    from its record, read by the one safe read of a small file (``checkpointing.paths``).

    Raises:
        CheckpointError: the record is unsafe (a link out of the tag, a FIFO, too large) or damaged.
    """
    record = tag / STATE_DICTS_FILE
    if not os.path.lexists(record):
        return None
    value = read_json(tag, STATE_DICTS_FILE)  # (inside the tag, a regular file, bounded: never a FIFO's wait)
    size = value.get("data_parallel_size") if isinstance(value, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise CheckpointError(f"{record} is damaged (no data_parallel_size); the tag cannot be read.")
    return size


def _read_state_dicts(tag: Path, model: Any, optimizer: Any, scheduler: Any, strict: bool, coordinator: Coordinator):
    """This rank's files of ``tag``, read and checked: (model state, optimizer state or None,
    scheduler state or None, user content)."""
    if not (tag / DONE_FILE).is_file():
        raise CheckpointError(f"{tag} is not a complete checkpoint tag (no '{DONE_FILE}' file).")
    here = _here(coordinator, optimizer)
    weights = optimizer_state = scheduler_state = None
    if model is not None:
        model_file = tag / _rank_file("model", 0, here.tensor, here.pipeline)
        weights = _read(tag, _rank_file("model", 0, here.tensor, here.pipeline))
        if isinstance(model, nn.Module):
            _check_weights(weights, model, strict, model_file)
        elif not isinstance(weights, Mapping):
            raise CheckpointError(f"{model_file} is not a state dict.")
    if optimizer is not None:
        files = _optimizer_files(tag, here.tensor, here.pipeline)
        if not files:
            raise CheckpointError(f"{tag} holds no optimizer files for tp {here.tensor} pp {here.pipeline}; load it "
                                  f"with optimizer=None.")
        # Saved from state dicts by nxd_smp: at the DP size its record says. By NxD itself: one file per
        # DP rank for ZeRO-1, or a single replicated one (a plain optimizer), which any DP size reads.
        saved_size = _saved_data_parallel_size(tag) or len(files)
        if saved_size != here.data_size and not (len(files) == 1 and not (tag / STATE_DICTS_FILE).is_file()):
            raise CheckpointError(
                f"{tag} was saved from state dicts at DP size {saved_size}; a state dict is a data-parallel rank's "
                f"own, so it loads at DP size {saved_size} only (this run: {here.data_size}). Resume at DP size "
                f"{saved_size}, or save with the model and optimizer objects, whose checkpoints load at any DP size."
            )
        source = files[here.data if len(files) > 1 else 0]
        optimizer_state = _read(tag, f"optim/{source.name}")
        if not isinstance(optimizer_state, Mapping):
            raise CheckpointError(f"{source} is not an optimizer state dict.")
        zero1 = zero1_optimizer_of(optimizer) if not isinstance(optimizer, Mapping) else None
        if zero1 is not None:
            try:
                zero1.check_state_dict(optimizer_state)
            except ValueError as e:
                raise CheckpointError(f"{source}: {e}") from None
        elif isinstance(_torch_optimizer(optimizer), torch.optim.Optimizer):  # ZeRO-1 off
            _check_torch_optimizer_state(optimizer_state, _torch_optimizer(optimizer), str(source))
    scheduler_state = _scheduler_state(tag, scheduler)
    user_content = _read(tag, USER_CONTENT_FILE) if os.path.lexists(tag / USER_CONTENT_FILE) else None
    return weights, optimizer_state, scheduler_state, user_content


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside NxD's wrapper (or ``optimizer`` itself)."""
    return getattr(optimizer, "optimizer", optimizer)


def _check_torch_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, source: str) -> None:
    """``saved`` is a ``state_dict()`` of ``optimizer`` (a plain torch optimizer: NxD's with ZeRO-1
    off): its groups as torch's ``load_state_dict`` checks them, numbering the parameters as the
    optimizer does (``torch_group_problems``), and the one state-fit check (hyperparameters of the
    groups' kinds and of values the class accepts; per parameter id the state the installed group
    keeps, moments shaped like the parameter). What is installed after it is ``torch_state_dict``'s:
    torch's ``load_state_dict`` cannot refuse it, and the kernel options stay the live ones.

    Raises:
        CheckpointError: naming ``source`` and every field that does not fit.
    """
    groups, state = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, Mapping) else (None, None)
    if not isinstance(groups, list) or not isinstance(state, Mapping) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{source} is not a torch optimizer state dict ('state' and 'param_groups').")
    problems = torch_group_problems(groups, optimizer.param_groups, "param_groups")
    if problems:
        raise CheckpointError(f"{source}: the optimizer state does not fit: " + "; ".join(problems) + ".")
    where = {i: (g, tuple(p.shape)) for g, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups))
             for i, p in zip(saved_group["params"], group["params"])}
    problems = [f"state for parameter {i!r}, which the param groups do not list" for i in state
                if isinstance(i, bool) or i not in where]
    hypers = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    problems += StateFit(type(optimizer), optimizer.param_groups, hypers).problems(
        (where[i][0], f"parameter {i}", entry, where[i][1]) for i, entry in state.items() if i in where)
    if problems:
        raise CheckpointError(f"{source}: the optimizer state does not fit: " + "; ".join(problems) + ".")
