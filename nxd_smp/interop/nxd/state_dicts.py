"""NxD Training's state dicts, in NxD's tag-folder layout (``folders``).

NxD Training passes state dicts instead of objects (``save_checkpoint(dir, tag, model=<model state
dict>, optimizer=<optimizer state dict>, user_content=...)``, and on resume empty dicts that NxD fills
in place for Lightning to load). ``save_state_dicts`` writes them in NxD's layout, each rank its own
optimizer file whatever ``zero1_optimizer`` says (nxd_smp's state dict is this rank's shard), into a
new hidden folder of the root renamed into place once complete (the ranks' one write-and-publish),
every file created relative to that folder's descriptor. ``read_state_dicts`` stages them for nxd_smp's
load pipeline: into the dicts to fill (NxD's way), or into live objects (a ``Zero1Optimizer``'s
rank-local state dict through its own reader; a plain torch optimizer's, NxD's with ZeRO-1 off), at
the DP size they were saved at (a state dict is a data-parallel rank's own).
"""

from __future__ import annotations

import io
import json
import secrets
import zlib
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, Hashable

import torch
import torch.nn as nn

from ...backend import Backend
from ...backend.agreement import decide
from ...backend.coordination import Coordinator
from ...checkpointing.files import Folder, after_publish, place_directory
from ...checkpointing.reader import check_distinct, load_bytes
from ...checkpointing.object_io import S3Path
from ...checkpointing.room import Room
from ...checkpointing.save import (
    begin_version,
    check_async_save,
    close_opened,
    discard_version,
    open_made,
    write_and_publish,
)
from ...checkpointing.typed_json import loads
from ...checkpointing.unpickler import MAX_DEPTH
from ...checkpointing.versions import DONE_FILE, LEFT, MARKER_FILE
from ...checkpointing.writer import start_save
from ...core.errors import CheckpointError
from ...optim.loading.run import read_rank_state
from ...optim.loading.staged import Request, Staged, StagedTorchOptimizer, Targets
from .folders import (
    SCHEDULER_FILE,
    STATE_DICTS_FILE,
    STATE_DICTS_FORMAT,
    STORE_COMPLETE_FORMAT,
    USER_CONTENT_FILE,
    check_complete,
    here,
    is_nxd_checkpoint,
    nxd_tags,
    optimizer_files,
    rank_file,
    read_file,
    remove_tag,
    stage_model,
    stage_objects,
)


# ---------------------------------------------------------------- writing
def _map_tensors(value: Any, fn, at: tuple = ()) -> Any:
    """``value`` with ``fn`` applied to every tensor inside it (dicts, lists, tuples); a dict keeps its
    type and attributes (a model state dict's ``_metadata``). ``at``: the keys on the way here.

    Raises:
        TypeError: containers nested deeper than the strict reader reads back (``unpickler.MAX_DEPTH``),
            naming where; nothing is saved.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (dict, list, tuple)) and len(at) > MAX_DEPTH:
        where = "".join(f"[{k!r}]" if isinstance(k, (str, int)) else f"[<{type(k).__name__}>]" for k in at[:4])
        raise TypeError(f"the state dict{where}... nests containers more than {MAX_DEPTH} deep, which nxd_smp's "
                        f"reader does not read back; nothing was saved. Keep it as plain data.")
    if isinstance(value, dict):
        out = type(value)((k, _map_tensors(v, fn, (*at, k))) for k, v in value.items())
        if hasattr(value, "__dict__"):  # (a plain dict has none)
            out.__dict__.update(value.__dict__)
        return out
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_tensors(v, fn, (*at, i)) for i, v in enumerate(value))
    return value


def _serialized(value: Any, backend: Backend) -> bytes:
    """``value``'s bytes as ``torch.save`` writes them, every tensor on the host in the dtype the device
    holds it in: taken now, so an asynchronous save writes what the state was at the call."""
    tensors: list[torch.Tensor] = []
    _map_tensors(value, tensors.append)
    host = iter(backend.to_host(tensors)[0])
    buffer = io.BytesIO()
    torch.save(_map_tensors(value, lambda _: next(host)), buffer)
    return buffer.getvalue()


def _readable(data: bytes, what: str) -> bytes:
    """``data`` (a ``torch.save`` file's bytes) if nxd_smp's strict reader reads it back; else refused now,
    before anything is written, rather than at the load (a class of the caller's own, say).

    Raises:
        TypeError: naming ``what`` and why, and the fix.
    """
    try:
        load_bytes(data, what)
    except CheckpointError as e:
        raise TypeError(f"{what} holds what nxd_smp's checkpoints do not read back: {e} Keep it as plain data "
                        f"(numbers, strings, containers, tensors).") from None
    return data


def save_state_dicts(tag: Path | S3Path, *, model: Any, optimizer: Any, scheduler: Any, user_content: Any,
                     backend: Backend, async_save: bool, num_kept: int | None) -> Path | S3Path:
    """Write the state dicts NxD Training passes (or ``state_dict()`` of objects given with them) into the
    tag folder ``tag``, in NxD's layout; every rank calls it.

    ``model/dp_rank_00_tp_rank_TT_pp_rank_PP.pt`` comes from data-parallel rank 0 of each tensor/pipeline
    coordinate (the model is replicated over data parallelism), ``optim/dp_rank_DD_tp_rank_TT_pp_rank_PP.pt``
    from every rank (a ZeRO-1 state dict is this rank's shard), ``scheduler.pt``, ``user_content.pt`` and
    ``nxd_smp_state_dicts.json`` (the DP size) from rank 0, ``done`` last. Rank 0 makes a new hidden folder
    in the root and every rank checks it opened that folder (device and inode) before writing into it;
    it is renamed into place once complete; a tag saved again replaces the old folder, whose ``done`` goes
    first. On S3 (``tag`` an ``S3Path``) the same files go into a version committed as the tag
    (``_save_to_store``). Returns ``tag``.

    Raises:
        CheckpointError: ``tag`` is something else than a tag folder, or a rank failed to write.
    """
    coordinator = backend.coordinator
    if async_save:
        check_async_save(coordinator)
    coordinate = here(Targets(model=None, optimizer=optimizer, objects={}, backend=backend))
    files: dict[str, bytes] = {}
    if model is not None and coordinate.data == 0:
        files[rank_file("model", 0, coordinate.tensor, coordinate.pipeline)] = _serialized(model, backend)
    if optimizer is not None:
        files[rank_file("optim", coordinate.data, coordinate.tensor, coordinate.pipeline)] = _serialized(optimizer,
                                                                                                        backend)
    refusal: TypeError | None = None  # (raised by rank 0's decision below: every rank learns of it)
    if coordinator.rank == 0:
        try:
            if scheduler is not None:
                files[SCHEDULER_FILE] = _readable(_serialized(scheduler.state_dict(), backend),
                                                  "the scheduler's state")
            if user_content is not None:
                files[USER_CONTENT_FILE] = _readable(_serialized(user_content, backend), "user_content")
        except TypeError as e:
            refusal = e
        record = {"format": STATE_DICTS_FORMAT, "data_parallel_size": coordinate.data_size,
                  "world_size": coordinator.size}
        files[STATE_DICTS_FILE] = json.dumps(record).encode()
    if isinstance(tag, S3Path):
        return _save_to_store(tag, files, refusal, coordinator, async_save=async_save, num_kept=num_kept)
    root: Folder | None = None

    def begin() -> list:
        nonlocal root
        if refusal is not None:
            raise TypeError(f"nothing was saved to {tag}: {refusal}")
        root = Folder.open(tag.parent, create=True)
        if root.exists(tag.name) and not (is_nxd_checkpoint(tag) or (root.is_dir(tag.name) and _empty(root, tag.name))):
            raise CheckpointError(f"{tag} exists and is not a checkpoint tag folder; pass another tag or remove it.")
        name = f".{tag.name}.partial-{secrets.token_hex(6)}"
        with root.mkdir(name) as staging:
            staging.write_bytes(MARKER_FILE, b"1")
            return [name, *staging.identity()]

    try:
        name, *identity = decide(coordinator, begin)
    except (CheckpointError, FileNotFoundError) as e:
        raise CheckpointError(f"the save of {tag} was refused: {e}") from None
    opened = open_made(root, tag.parent, name, identity, "folder")  # (a failure: told to every rank by the write)
    job = dict(opened=opened, tag=tag, name=name, files=files, coordinator=coordinator, num_kept=num_kept)
    if not async_save:
        try:
            _write_and_publish(**job)
        finally:
            close_opened(opened)
        return tag
    if not isinstance(opened, BaseException):  # the writer thread's own descriptors
        job["opened"] = (opened[0].dup(), opened[1].dup())
        close_opened(opened)

    def work() -> None:
        try:
            _write_and_publish(**job)
        finally:
            close_opened(job["opened"])

    start_save(str(tag), work)
    return tag


def _save_to_store(tag: S3Path, files: Mapping[str, bytes], refusal: TypeError | None, coordinator: Coordinator, *,
                   async_save: bool, num_kept: int | None) -> S3Path:
    """``save_state_dicts`` into object storage: the same files into a new version of the store at the tag's
    parent, committed as the tag with ``done`` in it (``checkpointing.object_store``: no rename there);
    the retention counts the store's tags."""
    def check() -> None:
        if refusal is not None:
            raise TypeError(f"nothing was saved to {tag}: {refusal}")

    begun, opened = begin_version(coordinator, tag, check, refused=f"the save of {tag} was refused")

    def write() -> dict[str, list[int]]:
        if isinstance(opened, BaseException):
            raise opened
        for file, data in files.items():
            opened[1].write_bytes(file, data)
        return {file: [len(data), zlib.crc32(data)] for file, data in files.items()}

    def publish(written: list) -> None:
        store, version = opened
        version.write_bytes(DONE_FILE, b"1")
        listed = {file: entry for part in written for file, entry in part.items()}  # (every rank's files)
        listed[DONE_FILE] = [1, zlib.crc32(b"1")]
        store.publish(tag.name, begun, version, json.dumps({"format": STORE_COMPLETE_FORMAT, "files": listed}).encode())
        if num_kept is not None:  # (published: the retention warns, never fails the save)
            store.retain(num_kept, newest=tag.name)

    def work() -> None:
        try:
            write_and_publish(coordinator, write, publish, what=str(tag),
                              discard=lambda: discard_version(opened, begun))
        finally:
            close_opened(opened)

    if async_save:
        start_save(str(tag), work)
    else:
        work()
    return tag


def _empty(root: Folder, name: str) -> bool:
    with root.sub(name) as folder:
        return not folder.names()


def _write_and_publish(*, opened: tuple[Folder, Folder] | Exception, tag: Path, name: str,
                       files: Mapping[str, bytes], coordinator: Coordinator, num_kept: int | None) -> None:
    """Every rank writes its files into the staging folder it opened (``opened``: the root and that folder, or
    why it could not); once all have, rank 0 writes ``done``, puts the folder in place of ``tag`` (an older
    one there loses its ``done`` first, so a tag that looks complete always is) and applies the retention."""
    root, staging = (None, None) if isinstance(opened, BaseException) else opened

    def write() -> None:
        if isinstance(opened, BaseException):
            raise opened
        for file, data in files.items():
            folder, _, base = file.rpartition("/")
            if folder:
                with staging.makedirs(folder) as sub:
                    sub.write_bytes(base, data)
            else:
                staging.write_bytes(base, data)

    def publish(_: list) -> None:
        for sub in ("model", "optim"):
            if staging.is_dir(sub):
                with staging.sub(sub) as folder:
                    folder.fsync()
        staging.write_bytes(DONE_FILE, b"1")
        staging.fsync()
        place_directory(root, name, tag.name, replace=True, retire=_retire, identity=staging.identity())
        if num_kept is None:
            return
        # published: the retention warns, never fails the save
        with after_publish(f"the retention in {tag.parent} (num_kept_ckpts={num_kept})"):
            for old in nxd_tags(tag.parent)[:-num_kept]:
                if old.name != tag.name:
                    with after_publish(f"removing the tag folder {old} (num_kept_ckpts={num_kept})", LEFT):
                        remove_tag(old)

    def discard() -> None:  # (rank 0's staging folder, if its name still means it: never a folder swapped in)
        if root is not None and root.lstat(name) is not None and root.identity(name) == staging.identity():
            root.remove_tree(name)

    write_and_publish(coordinator, write, publish, what=str(tag), discard=discard)


def _retire(tag: Folder) -> None:
    """The tag folder about to be replaced loses its ``done`` first."""
    tag.unlink(DONE_FILE)
    tag.fsync()


# ---------------------------------------------------------------- reading
def _saved_data_parallel_size(tag: Room) -> int | None:
    """The DP size a tag saved from state dicts by nxd_smp was saved at (None: not such a tag).

    Raises:
        CheckpointError: the record is unsafe (a link, a FIFO, too large) or damaged.
    """
    if not tag.exists(STATE_DICTS_FILE):
        return None
    value = loads(tag.read_bytes(STATE_DICTS_FILE, limit=1 << 16), str(tag.where(STATE_DICTS_FILE)))
    size = value.get("data_parallel_size") if isinstance(value, dict) else None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise CheckpointError(f"{tag.where(STATE_DICTS_FILE)} is damaged (no data_parallel_size); the tag cannot be read.")
    return size


def read_state_dicts(tag: Room, targets: Targets, request: Request) -> Staged:
    """This rank's files of the tag ``tag`` staged for the targets NxD Training's call shape passes:
    dicts to fill (as read), a module (its weights), a ``Zero1Optimizer`` (its rank-local state dict, read
    by its own reader), a plain torch optimizer (its ``state_dict()``); the scheduler's state, the user
    content.

    Raises:
        CheckpointError: incomplete, at another DP size, missing or unsafe files, each named.
    """
    coordinate = here(targets)
    if not tag.is_file(DONE_FILE):
        raise CheckpointError(f"{tag.where()} is not a complete checkpoint tag (no '{DONE_FILE}' file).")
    check_complete(tag)
    staged = Staged(source=str(tag.where()), fill={})
    once: dict[Hashable, str] = {}  # every file read once
    model, optimizer = targets.model, targets.optimizer
    if model is not None:
        model_file = rank_file("model", 0, coordinate.tensor, coordinate.pipeline)
        weights = read_file(tag, model_file, staged.replicated, once)
        if isinstance(model, nn.Module):
            stage_model(staged, weights, str(tag.where(model_file)))
        elif not isinstance(weights, Mapping):
            raise CheckpointError(f"{tag.where(model_file)} is not a state dict.")
        else:
            staged.fill["model"] = weights
    if optimizer is not None:
        files = optimizer_files(tag, coordinate.tensor, coordinate.pipeline)
        if not files:
            raise CheckpointError(f"{tag.where()} holds no optimizer files for tp {coordinate.tensor} pp "
                                  f"{coordinate.pipeline}; load it with optimizer=None.")
        # Saved from state dicts by nxd_smp: at the DP size its record says. By NxD itself: one file per DP
        # rank for ZeRO-1, or a single replicated one (a plain optimizer), which any DP size reads.
        recorded = _saved_data_parallel_size(tag)
        saved_size = recorded or len(files)
        if saved_size != coordinate.data_size and not (len(files) == 1 and recorded is None):
            raise CheckpointError(
                f"{tag.where()} was saved from state dicts at DP size {saved_size}; a state dict is a data-parallel "
                f"rank's own, so it loads at DP size {saved_size} only (this run: {coordinate.data_size}). Resume at "
                f"DP size {saved_size}, or save with the model and optimizer objects, whose checkpoints load at any "
                f"DP size.")
        source = files[coordinate.data if len(files) > 1 else 0]
        value = read_file(tag, source, once=once)
        if not isinstance(value, Mapping):
            raise CheckpointError(f"{tag.where(source)} is not an optimizer state dict.")
        if not isinstance(optimizer, MutableMapping):  # (installed: each moment and master its own record)
            entries = value.get("state") if isinstance(value.get("state"), Mapping) else {}
            check_distinct([(f"state/{i}/{key}", v) for i, entry in entries.items() if isinstance(entry, Mapping)
                            for key, v in entry.items() if isinstance(v, torch.Tensor) and v.dim() > 0],
                           str(tag.where(source)), "each moment and master is a tensor of its own")
        if targets.rank_state is not None:
            try:
                staged.optimizer = read_rank_state(targets, dict(value), request).optimizer
            except CheckpointError as e:
                raise CheckpointError(f"{tag.where(source)}: {e}") from None
            staged.optimizer.source = str(tag.where(source))
        elif isinstance(optimizer, torch.optim.Optimizer):
            staged.torch_optimizer = StagedTorchOptimizer(dict(value), str(tag.where(source)))
        elif isinstance(optimizer, MutableMapping):
            staged.fill["optimizer"] = value
    stage_objects(staged, tag, request, once)
    return staged
