"""Saving: this rank's tensors of a checkpoint, the small files, and how they are written
and published.

Every rank writes the pieces of the state it owns and its share of the (replicated) model
tensors, straight from memory (``storage``); then, through the ranks' one write-and-publish
(``publish.write_and_publish``), rank 0 writes the index, the small files and the completion
record, swaps the link and applies the retention (``links``). A failure anywhere is a
``CheckpointError`` on every rank. With ``async_save`` the tensors are staged into host buffers
and the rest happens on the background writer (``writer``).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..backend import Backend
from ..backend.coordination import Coordinator
from ..core.dtensors import local_shape, local_state_dict, tensor_parallel_layout
from ..core.errors import CheckpointError
from ..zero1_optimizer import Zero1Optimizer
from .format import (
    COMPLETE_FILE,
    FORMAT,
    group_records,
    managed_param_names,
    master_key,
    model_key,
    scaler_key,
    small_files,
    state_key,
)
from .links import clear_folder, is_link_name, publish_version, replaceable_folder, retain, version_prefix
from .progress import phases
from .publish import fsync_dir, write_and_publish
from .resharding import named_pieces, saved_pieces
from .storage import INDEX_FILE, IO_THREADS, write_bytes, write_index, write_tensors
from .writer import stage, start_save

log = logging.getLogger("nxd_smp.checkpoint")


def save(
    path: Path,
    model: nn.Module,
    optimizer: Zero1Optimizer | None,
    backend: Backend,
    *,
    objects: Mapping[str, Any],
    extra: Any,
    save_master_weights: bool,
    async_save: bool,
    num_kept_ckpts: int | None,
    progress: bool | None,
) -> Path:
    """``save_checkpoint`` once its arguments are checked and no save of this rank is in
    flight: agree on a new version, write this rank's part (now, or staged and in the
    background), publish. Returns the version directory."""
    coordinator = backend.coordinator
    if async_save:
        check_async_save(coordinator)
    if not is_link_name(path.name):
        raise CheckpointError(f"{path}: a checkpoint's name must be a plain name, not hidden (names starting "
                              f"with '.' are its versions' and the record of saves'); pick another.")
    rank = coordinator.rank

    # The state first, and the small files encoded on rank 0, before anything is written: a value
    # nxd_smp's format cannot hold is refused on every rank with nothing on disk touched.
    state, meta, copied = state_to_save(model, optimizer, bool(save_master_weights), backend)
    small, refused = {}, None
    if rank == 0:
        try:
            small, tensors = small_files(meta, extra, objects)
            state.update(tensors)
        except Exception as e:  # noqa: BLE001 - every rank learns why the save cannot be made
            refused = f"{type(e).__name__}: {e}"
    refused = coordinator.broadcast(refused)
    if refused is not None:
        raise (TypeError if refused.startswith("TypeError: ") else CheckpointError)(
            f"nothing was saved to {path}: {refused.removeprefix('TypeError: ')}")

    version = coordinator.broadcast(f"{version_prefix(path)}{uuid.uuid4().hex[:12]}")
    target = path.parent / version
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if replaceable_folder(path):
            clear_folder(path)  # an empty folder made for us (or with NxD's markers only): the link takes its place
        target.mkdir()
    coordinator.barrier()
    job = dict(path=path, target=target, version=version, num_kept=num_kept_ckpts)
    if not async_save:
        with phases(progress, rank, ["write", "publish"], f"save {path.name}", log) as advance:
            _write_and_publish(state, small, coordinator, advance=advance, **job)
        return target

    with phases(progress, rank, ["stage"], f"stage {path.name}", log) as advance:
        if not copied:  # the live tensors may change while they are written
            state = stage(state)
        advance("stage")

    def work() -> None:
        _write_and_publish(state, small, coordinator,
                           advance=lambda name: log.info("save %s: %s", path.name, name), **job)

    start_save(str(path), work)
    return target


def check_async_save(coordinator: Coordinator) -> None:
    """Refuse an asynchronous save that the background writer could not coordinate.

    Raises:
        CheckpointError: naming the fix.
    """
    if not coordinator.works_off_thread:
        raise CheckpointError(
            "async_save=True needs a coordination that a background thread can use, and these XLA "
            "replicas coordinate through xm.rendezvous, which only their own threads may call. Launch "
            "with torchrun and init_process_group('xla') (a gloo group then coordinates), or save "
            "with async_save=False."
        )


def _write_and_publish(
    state: Mapping[str, torch.Tensor],
    small_files: Mapping[str, bytes],
    coordinator: Coordinator,
    *,
    path: Path,
    target: Path,
    version: str,
    num_kept: int | None,
    advance,
) -> None:
    """Every rank writes its tensors; then rank 0 writes the index, the small files, the
    completion record, swaps ``path`` and applies the retention (``publish.write_and_publish``)."""

    def publish(written: list) -> None:
        entries = {}
        for part_entries, _ in written:  # replicated scalars (a bucket's step) come from several ranks
            for key, entry in part_entries.items():
                entries.setdefault(key, entry)
        files = {name: v for _, part_files in written for name, v in part_files.items()}
        files[INDEX_FILE] = write_index(target, entries)
        complete_and_publish(path, target, version, files, small_files, num_kept)

    write_and_publish(coordinator, lambda: write_tensors(target, f"__{coordinator.rank}_", state, threads=IO_THREADS),
                      publish, what=str(path), advance=advance)


def complete_and_publish(
    path: Path, target: Path, version: str, files: dict[str, list[int]], small_files: Mapping[str, bytes],
    num_kept: int | None,
) -> None:
    for name, data in small_files.items():
        write_bytes(target / name, data)
        files[name] = [len(data), zlib.crc32(data)]
    with open(target / COMPLETE_FILE, "w") as f:
        json.dump({"format": FORMAT, "files": files, "saved_at_ns": time.time_ns()}, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(target)
    publish_version(path, version)
    if num_kept is not None:
        retain(path.parent, num_kept, newest=path)


def model_keys_of(rank: int, world_size: int, model_state: Mapping[str, torch.Tensor]) -> list[str]:
    """The model tensors ``rank`` writes: each one by one rank (they are replicated), the
    largest first to the rank with the fewest bytes so far, the same split on every rank."""
    load = [0] * world_size
    mine = []
    for key in sorted(model_state, key=lambda k: (-model_state[k].numel() * model_state[k].element_size(), k)):
        r = load.index(min(load))
        load[r] += model_state[key].numel() * model_state[key].element_size()
        if r == rank:
            mine.append(key)
    return mine


def state_to_save(
    model: nn.Module, optimizer: Zero1Optimizer | None, with_masters: bool, backend: Backend
) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool]:
    """This rank's tensors of the checkpoint (on the host), the metadata, and whether the
    tensors are copies (False: some are the live ones, which an asynchronous save stages)."""
    model_state = local_state_dict(model)  # (a DTensor's part on this rank: one checkpoint per TP coordinate)
    model_keys = {}
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"model state '{key}' is not a tensor; nxd_smp saves tensors only.")
        model_keys[key] = {"shape": tuple(value.shape), "dtype": str(backend.device_dtype(value.dtype))}
    mine = model_keys_of(backend.rank, backend.world_size, model_state)
    host, copied = backend.to_host([model_state[key] for key in mine])
    state: dict[str, torch.Tensor] = {model_key(key): value for key, value in zip(mine, host)}
    meta: dict[str, Any] = {"format": FORMAT, "model": model_keys, "optimizer": None}
    layout = tensor_parallel_layout(model)
    if layout is not None:
        meta["tensor_parallel"] = layout
    if optimizer is None:
        return state, meta, copied

    optimizer.adopt_param_changes()  # weights changed in place since the last step are the truth
    names = managed_param_names(model, optimizer)
    inner = optimizer.inner_optimizer
    layouts, shards = optimizer.bucket_layouts, optimizer.inner_shards
    tensor_keys: set[str] = set()
    scalar_keys: set[str] = set()
    for layout, shard in zip(layouts, shards):
        for key, value in inner.state.get(shard, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"inner optimizer state '{key}' is not a tensor; it cannot be sharded.")
            if value.dim() == 0:
                scalar_keys.add(key)
            elif tuple(value.shape) == (layout.shard_numel,):
                tensor_keys.add(key)
            else:
                raise CheckpointError(
                    f"inner optimizer state '{key}' has shape {tuple(value.shape)}, neither a "
                    f"scalar nor the shard's ({layout.shard_numel},); it cannot be resharded."
                )
    # Whole shards to the host at once (one transfer each on XLA), cut into pieces there.
    live = [(b, key, value) for b, shard in enumerate(shards) for key, value in inner.state.get(shard, {}).items()]
    live += [(b, None, master) for b, master in enumerate(optimizer.master_shards)] if with_masters else []
    host, copied_shards = backend.to_host([value for _, _, value in live])
    shard_state: list[dict[Any, torch.Tensor]] = [{} for _ in shards]
    for (b, key, _), value in zip(live, host):
        shard_state[b][key] = value
    for b, name, piece in named_pieces(layouts, optimizer.rank, names):
        span = slice(piece.shard_start, piece.shard_start + piece.numel)
        for key, value in shard_state[b].items():
            if key is None:
                state[master_key(name, piece.param_start)] = value[span]
            elif value.dim() == 0:
                state[state_key(name, key)] = value
            else:
                state[state_key(name, key, piece.param_start)] = value[span]

    scaler = optimizer.loss_scaler
    if scaler is not None:
        scaler_state = scaler.state_dict()
        values, copied_scaler = backend.to_host(list(scaler_state.values()))
        copied_shards = copied_shards and copied_scaler
        state.update({scaler_key(key): value for key, value in zip(scaler_state, values)})

    params = {
        name: {"shape": tuple(local_shape(p)), "dtype": str(backend.device_dtype(p.dtype))}
        for name, p in zip(names, optimizer.managed_params)
    }
    meta["optimizer"] = {
        "world_size": optimizer.world_size,
        "mixed_precision": optimizer.mixed_precision.to_dict(),
        "master_weights": with_masters,
        "params": params,
        "pieces": saved_pieces(layouts, optimizer.world_size, names),
        "groups": group_records(optimizer, names),
        "tensor_keys": sorted(tensor_keys),
        "scalar_keys": sorted(scalar_keys),
        "inner_class": type(inner).__name__,
        "loss_scaler": scaler is not None,
    }
    return state, meta, copied and copied_shards
