"""Sharded, reshardable, atomic checkpoints of a model, its ``Zero1Optimizer``, and the
caller's scheduler and other stateful objects; saved synchronously or in the background.

Format: a PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``) directory,
keyed by parameter name:

* ``model/<state_dict key>``: the full model tensors (replicated, written once);
* ``optim/<param>/<state key>/<start>``: elements ``[start, end)`` of the flattened
  parameter's optimizer state (``exp_avg``, ``momentum_buffer``, ...), one entry per
  contiguous piece a rank owned; ``optim/<param>/<state key>`` for 0-dim state (``step``);
* ``master/<param>/<start>``: the same for fp32 master weights, when they are saved;

stored as raw bytes by ``checkpoint_storage`` (a few large files per rank, CRC-32 of every
tensor and file computed while writing; DCP's ``Metadata`` as the index), plus ``nxd_smp_meta.pt`` (shapes, dtypes, param
groups, which pieces exist, the DP size written at), ``extra.pt`` (the caller's ``extra``
and the state dicts of the scheduler and other stateful objects) and, written last,
``COMPLETE.json`` (size and CRC-32 of every file, when it was saved). Because every piece is
addressed by parameter name and element range, a checkpoint written at DP size N loads at
any DP size M. Checkpoints of format 1 (DCP's own file writer) still load.

Atomicity: ``path`` is a symbolic link to a sibling directory ``.<name>.v-<id>``. A save
writes a new sibling, fsyncs it, then swaps the link with ``os.replace`` and removes the
old sibling, so ``path`` always resolves to a complete checkpoint. A save cut off before
the swap leaves a sibling without ``COMPLETE.json``, which ``load_checkpoint`` reports.
With ``async_save=True`` the call returns once the state is copied to host memory and the
rest happens in the background (``finalize_checkpoint()`` waits for it); with
``num_kept_ckpts`` only the newest checkpoints of the directory are kept.

Loading reads and checks everything into staging buffers before it changes the model or
the optimizer; a refused load changes nothing. Loading never runs code from the files:
``torch.load(weights_only=True)`` for the small files, a restricted unpickler for the index.

Ranks agree (on a version, on the outcome) through the optimizer's backend's coordinator
(``nxd_smp.backend``): a gloo group under torch.distributed, memory shared by the replica
threads of the XLA CPU device, ``xm.rendezvous`` on Neuron without torch.distributed. The
offline tools (``inspect_checkpoint``, ``read_checkpoint``, ``consolidate``) read files and
never communicate.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import os
import shutil
import threading
import time
import uuid
import warnings
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .backend import Backend, Coordinator, select_backend, this_replica
from .checkpoint_storage import (
    ChecksumError,
    UnsafeFileError,
    read_index,
    read_tensors,
    safe_load,
    write_metadata,
    write_tensors,
)
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

FORMAT = "nxd_smp.checkpoint/2"
FORMAT_V1 = "nxd_smp.checkpoint/1"  # tensors in DCP's own FileSystemWriter files; still loaded
META_FILE = "nxd_smp_meta.pt"
EXTRA_FILE = "extra.pt"
COMPLETE_FILE = "COMPLETE.json"
_CRC_BLOCK = 16 << 20
# Files (and threads) per rank: two overlap one file's checksum with the other's writes.
_WRITE_THREADS = max(1, min(4, os.cpu_count() or 1))
_SCHEDULER = "scheduler"

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, damaged, or does not fit the model/optimizer."""


# ---------------------------------------------------------------------------- helpers
def _version_prefix(path: Path) -> str:
    return f".{path.name}.v-"


def _backend(model: nn.Module, optimizer: Zero1Optimizer | None) -> Backend:
    """The optimizer's backend, or (a model alone) the default one for the model's device:
    where rank, world and coordination come from."""
    if optimizer is not None:
        return optimizer.backend
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return select_backend(first.device if first is not None else torch.device("cpu"))


def _safe_load(path: Path) -> Any:
    try:
        return safe_load(path)
    except UnsafeFileError as e:
        raise CheckpointError(str(e)) from None


def _error_text(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


@contextmanager
def _phases(enabled: bool | None, rank: int, names: list[str], desc: str) -> Iterator[Any]:
    """Yields ``advance(name)``, which logs each phase and, on rank 0 when ``enabled`` (None:
    this module's logger is at INFO), moves a tqdm bar."""
    if enabled is None:
        enabled = log.isEnabledFor(logging.INFO)
    bar = None
    if enabled and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(names), desc=desc, unit="step")

    def advance(name: str) -> None:
        log.info("%s: %s", desc, name)
        if bar is not None:
            bar.set_postfix_str(name)
            bar.update(1)

    try:
        yield advance
    finally:
        if bar is not None:
            bar.close()


def managed_param_names(model: nn.Module, optimizer: Zero1Optimizer) -> list[str]:
    """The model name of each parameter ``optimizer`` manages, in its layout order
    (``optimizer.managed_params``).

    Raises:
        CheckpointError: a managed parameter is not a parameter of ``model``.
    """
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for i, p in enumerate(optimizer.managed_params):
        if id(p) not in names:
            raise CheckpointError(
                f"the optimizer's parameter {i} (shape {tuple(p.shape)}) is not a parameter "
                f"of the model; pass the model the optimizer was built for."
            )
        out.append(names[id(p)])
    return out


def _check_args(model: Any, optimizer: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, Zero1Optimizer):
        raise TypeError(
            f"optimizer must be a nxd_smp Zero1Optimizer (or None), got {type(optimizer).__name__}; "
            f"save a plain torch optimizer with torch.save(optimizer.state_dict())."
        )


# How the inner optimizer computes, not what: chosen per device by whoever loads.
_IMPLEMENTATION_KEYS = frozenset({"params", "fused", "foreach", "capturable", "differentiable"})


def _group_records(optimizer: Zero1Optimizer, names: list[str]) -> list[dict[str, Any]]:
    """Per param group: its hyperparameters (lr, betas, ... but not kernel choices such as
    ``fused``, which belong to the device that loads) and its parameters' names."""
    index = {id(p): i for i, p in enumerate(optimizer.managed_params)}
    records = []
    for group in optimizer.param_groups:
        records.append({"hyper": group_hyperparameters(group), "params": [names[index[id(p)]] for p in group["params"]]})
    return records


def group_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters: everything but its parameters and the kernel choices
    (``fused``, ``foreach``, ...), which belong to whoever loads."""
    return {k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS}


def param_group_names(model: nn.Module, optimizer: Zero1Optimizer) -> list[list[str]]:
    """The names of each param group's managed parameters, group by group, in the order the
    optimizer was given them (the order torch.optim state dicts number them in)."""
    return [record["params"] for record in _group_records(optimizer, managed_param_names(model, optimizer))]


# ---------------------------------------------------------------------------- stateful objects
def _stateful_objects(scheduler: Any, stateful: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{name: object}`` for the scheduler and the caller's other stateful objects, each
    checked to have ``state_dict()`` and ``load_state_dict()``."""
    objects: dict[str, Any] = {}
    if stateful is not None:
        if not isinstance(stateful, Mapping):
            raise TypeError(f"stateful must be a dict of name -> object, got {type(stateful).__name__}.")
        for name, obj in stateful.items():
            if not isinstance(name, str) or name == _SCHEDULER:
                raise ValueError(
                    f"stateful names must be strings other than {_SCHEDULER!r} (pass the scheduler as "
                    f"scheduler=...), got {name!r}."
                )
            objects[name] = obj
    if scheduler is not None:
        objects[_SCHEDULER] = scheduler
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict(); pass objects that "
                f"do (an LR scheduler, a data loader's sampler, ...), or put plain values in extra=."
            )
    return objects


# ---------------------------------------------------------------------------- saves in flight
class _SaveInFlight:
    """The background part of an asynchronous save: its thread and how it ended."""

    def __init__(self, name: str, work) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.raised = False
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"nxd_smp save {name}")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - kept for finalize_checkpoint / the next save
            self.error = e
            log.error("nxd_smp: the asynchronous save of %s failed: %s", self.name, e)

    def wait(self) -> None:
        self._thread.join()


# Per rank of this process: XLA replicas of the XLA CPU device are threads of one process,
# each with a save of its own in flight (and its own staging buffers). Keyed by
# ``this_replica()`` (None in a process that is one rank).
_in_flight: dict[Any, _SaveInFlight] = {}
_in_flight_lock = threading.Lock()


def finalize_checkpoint() -> None:
    """Wait for this rank's asynchronous save in flight (if any) to finish; raise its error.
    Every rank calls it, e.g. before the end of training. A failure is raised once: by this
    call, or else by the next ``save_checkpoint``."""
    _finish_save_in_flight(raise_error=True)


def _finish_save_in_flight(raise_error: bool) -> None:
    """Wait for this rank's save in flight. Its failure stays pending until raised once
    (here when ``raise_error``); then the next save starts afresh."""
    key = this_replica()
    with _in_flight_lock:
        save = _in_flight.get(key)
    if save is None:
        return
    save.wait()
    if save.error is not None and not raise_error:
        return
    with _in_flight_lock:
        if _in_flight.get(key) is save:
            del _in_flight[key]
    if save.error is not None and not save.raised:
        save.raised = True
        raise CheckpointError(f"the asynchronous save of {save.name} failed: {save.error}") from save.error


# ---------------------------------------------------------------------------- save
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
    _check_args(model, optimizer)
    objects = _stateful_objects(scheduler, stateful)
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
    _finish_save_in_flight(raise_error=True)  # at most one in flight; its failure surfaces here
    if path.exists() and not path.is_symlink() and not (path.is_dir() and not any(path.iterdir())):
        raise CheckpointError(
            f"{path} exists and is not an nxd_smp checkpoint link; pass a new path or remove it."
        )
    backend = _backend(model, optimizer)
    coordinator = backend.coordinator
    if async_save and not coordinator.works_off_thread:
        raise CheckpointError(
            "async_save=True needs a coordination that a background thread can use, and these XLA "
            "replicas coordinate through xm.rendezvous, which only their own threads may call. Launch "
            "with torchrun and init_process_group('xla') (a gloo group then coordinates), or save "
            "with async_save=False."
        )
    rank = coordinator.rank

    version = coordinator.broadcast(f"{_version_prefix(path)}{uuid.uuid4().hex[:12]}")
    target = path.parent / version
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir() and not path.is_symlink():
            path.rmdir()  # an empty directory made for us: the link takes its place
        target.mkdir()
    coordinator.barrier()

    state, meta, copied = _state_to_save(model, optimizer, bool(save_master_weights), backend)
    small_files = _serialize_small_files(meta, extra, objects) if rank == 0 else {}
    job = dict(path=path, target=target, version=version, num_kept=num_kept_ckpts)
    if not async_save:
        with _phases(progress, rank, ["write", "publish"], f"save {path.name}") as advance:
            _write_and_publish(state, small_files, coordinator, advance=advance, **job)
        return target

    with _phases(progress, rank, ["stage"], f"stage {path.name}") as advance:
        if not copied:  # the live tensors may change while they are written
            state = _stage(state)
        advance("stage")

    def work() -> None:
        _write_and_publish(state, small_files, coordinator,
                           advance=lambda name: log.info("save %s: %s", path.name, name), **job)

    with _in_flight_lock:
        _in_flight[this_replica()] = _SaveInFlight(str(path), work)
    return target


def _serialize_small_files(meta: dict[str, Any], extra: Any, objects: Mapping[str, Any]) -> dict[str, bytes]:
    """The metadata and the caller's state as bytes, taken now (an asynchronous save writes
    what the state was at the call, whatever happens to the objects afterwards)."""
    files = {}
    for name, value in (
        (META_FILE, meta),
        (EXTRA_FILE, {"extra": extra, "objects": {k: obj.state_dict() for k, obj in objects.items()}}),
    ):
        buffer = io.BytesIO()
        torch.save(value, buffer)
        files[name] = buffer.getvalue()
    return files


# Host buffers of the last asynchronous save of each rank of this process, reused by its
# next one: copying into memory already paged in is ~6x faster than into fresh memory (0.09 s
# against 0.6 s for 1.3 GB here), and that copy is all an asynchronous save holds training
# up for. They cost this rank's part of a checkpoint in host memory, as DCP's cached staging
# does.
_staging: dict[Any, dict[str, torch.Tensor]] = {}


def _stage(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host-memory copies of every tensor, in this rank's previous asynchronous save's buffers
    where they fit. Only called once that save has finished with them."""
    previous = _staging.get(this_replica(), {})
    staged = {}
    for key, t in state.items():
        buffer = previous.get(key)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype)
        staged[key] = buffer.copy_(t.detach())
    _staging[this_replica()] = staged
    return staged


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
    completion record, swaps ``path`` and applies the retention. Every rank ends with the
    same outcome: a failure anywhere is a CheckpointError everywhere."""
    written = {"entries": {}, "files": {}, "error": None}
    try:
        written["entries"], written["files"] = write_tensors(
            target, f"__{coordinator.rank}_", state, threads=_WRITE_THREADS)
    except Exception as e:  # noqa: BLE001 - every rank learns of it below
        written["error"] = f"rank {coordinator.rank}: {_error_text(e)}"
    gathered = coordinator.all_gather(written)
    failures = [part["error"] for part in gathered if part["error"]]
    if failures:
        raise CheckpointError(f"the save of {path} failed: " + "; ".join(failures))
    advance("write")
    outcome = None
    if coordinator.rank == 0:
        try:
            entries = {}
            for part in gathered:  # replicated scalars (a bucket's step) come from several ranks
                for key, entry in part["entries"].items():
                    entries.setdefault(key, entry)
            write_metadata(target, entries)
            files = {name: v for part in gathered for name, v in part["files"].items()}
            _complete_and_publish(path, target, version, files, small_files, num_kept)
        except Exception as e:  # noqa: BLE001 - every rank raises it below
            outcome = _error_text(e)
    outcome = coordinator.broadcast(outcome)
    if outcome is not None:
        raise CheckpointError(f"the save of {path} failed: {outcome}")
    advance("publish")


def _complete_and_publish(
    path: Path, target: Path, version: str, files: dict[str, list[int]], small_files: Mapping[str, bytes],
    num_kept: int | None,
) -> None:
    for name, data in small_files.items():
        with open(target / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        files[name] = [len(data), zlib.crc32(data)]
    metadata = target / ".metadata"
    files[".metadata"] = [metadata.stat().st_size, _crc32(metadata)]
    with open(target / COMPLETE_FILE, "w") as f:
        json.dump({"format": FORMAT, "files": files, "saved_at_ns": time.time_ns()}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(target)
    _publish(path, version)
    if num_kept is not None:
        _retain(path.parent, num_kept, newest=path)


def _publish(path: Path, version: str) -> None:
    """Point ``path`` at ``version`` atomically and remove the version it replaced."""
    old = os.readlink(path) if path.is_symlink() else None
    link = path.parent / f".{path.name}.link-{uuid.uuid4().hex[:12]}"
    os.symlink(version, link)
    os.replace(link, path)
    _fsync_dir(path.parent)
    if old is not None and Path(old).name.startswith(_version_prefix(path)) and old != version:
        shutil.rmtree(path.parent / old, ignore_errors=True)
    # versions left by saves that were cut off before their swap
    for stale in path.parent.glob(f"{_version_prefix(path)}*"):
        if stale.name != version and not (stale / COMPLETE_FILE).exists():
            shutil.rmtree(stale, ignore_errors=True)


def _checkpoint_links(directory: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``directory`` (links to a version with a completion
    record), with when they were saved, newest first."""
    found = []
    for entry in directory.iterdir():
        if not entry.is_symlink() or entry.name.startswith("."):
            continue
        target = directory / os.readlink(entry)
        if not target.name.startswith(_version_prefix(entry)) or not (target / COMPLETE_FILE).is_file():
            continue
        try:
            with open(target / COMPLETE_FILE) as f:
                saved_at = int(json.load(f).get("saved_at_ns") or 0)
        except (OSError, ValueError):
            continue
        found.append((saved_at or int((target / COMPLETE_FILE).stat().st_mtime_ns), entry))
    return sorted(found, key=lambda item: (item[0], item[1].name), reverse=True)


def _retain(directory: Path, keep: int, newest: Path) -> None:
    """Remove all but the newest ``keep`` complete checkpoints of ``directory`` (never
    ``newest``, the one just written), then every version directory no link points to: those
    of saves killed before their swap, or after an unlink here. Only this save is in flight."""
    for _, link in _checkpoint_links(directory)[keep:]:
        if link != newest:
            version = directory / os.readlink(link)
            link.unlink()
            shutil.rmtree(version, ignore_errors=True)
    pointed = {os.readlink(entry) for entry in directory.iterdir() if entry.is_symlink()}
    for entry in directory.iterdir():
        if entry.name.startswith(".") and ".v-" in entry.name and entry.is_dir() and entry.name not in pointed:
            shutil.rmtree(entry, ignore_errors=True)
    _fsync_dir(directory)


def _model_keys_of(rank: int, world_size: int, model_state: Mapping[str, torch.Tensor]) -> list[str]:
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


def _state_to_save(
    model: nn.Module, optimizer: Zero1Optimizer | None, with_masters: bool, backend: Backend
) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool]:
    """This rank's tensors of the checkpoint (on the host), the metadata, and whether the
    tensors are copies (False: some are the live ones, which an asynchronous save stages)."""
    model_state = model.state_dict()
    model_keys = {}
    for key, value in model_state.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(f"model state '{key}' is not a tensor; nxd_smp saves tensors only.")
        model_keys[key] = {"shape": tuple(value.shape), "dtype": str(value.dtype)}
    mine = _model_keys_of(backend.rank, backend.world_size, model_state)
    host, copied = backend.to_host([model_state[key] for key in mine])
    state: dict[str, torch.Tensor] = {f"model/{key}": value for key, value in zip(mine, host)}
    meta: dict[str, Any] = {"format": FORMAT, "model": model_keys, "optimizer": None}
    if optimizer is None:
        return state, meta, copied

    optimizer.adopt_param_changes()  # weights changed in place since the last step are the truth
    names = managed_param_names(model, optimizer)
    inner = optimizer.inner_optimizer
    layouts, masters = optimizer.bucket_layouts, optimizer.master_shards
    tensor_keys: set[str] = set()
    scalar_keys: set[str] = set()
    for master in masters:
        for key, value in inner.state.get(master, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"inner optimizer state '{key}' is not a tensor; it cannot be sharded.")
            if value.dim() == 0:
                scalar_keys.add(key)
            elif tuple(value.shape) == tuple(master.shape):
                tensor_keys.add(key)
            else:
                raise CheckpointError(
                    f"inner optimizer state '{key}' has shape {tuple(value.shape)}, neither a "
                    f"scalar nor the shard's {tuple(master.shape)}; it cannot be resharded."
                )
    # Whole shards to the host at once (one transfer each on XLA), cut into pieces there.
    live = [(b, key, value) for b, master in enumerate(masters) for key, value in inner.state.get(master, {}).items()]
    live += [(b, None, master) for b, master in enumerate(masters)] if with_masters else []
    host, copied_shards = backend.to_host([value for _, _, value in live])
    shard_state: list[dict[Any, torch.Tensor]] = [{} for _ in masters]
    for (b, key, _), value in zip(live, host):
        shard_state[b][key] = value
    for b, layout in enumerate(layouts):
        for piece in layout.pieces(optimizer.rank):
            name = names[layout.param_indices[piece.index]]
            span = slice(piece.shard_start, piece.shard_start + piece.numel)
            for key, value in shard_state[b].items():
                if key is None:
                    state[f"master/{name}/{piece.param_start}"] = value[span]
                elif value.dim() == 0:
                    state[f"optim/{name}/{key}"] = value
                else:
                    state[f"optim/{name}/{key}/{piece.param_start}"] = value[span]

    scaler = optimizer.loss_scaler
    if scaler is not None:
        scaler_state = scaler.state_dict()
        values, _ = backend.to_host(list(scaler_state.values()))
        state.update({f"loss_scaler/{key}": value for key, value in zip(scaler_state, values)})

    pieces: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
    for layout in layouts:
        for r in range(optimizer.world_size):
            for piece in layout.pieces(r):
                pieces[names[layout.param_indices[piece.index]]].append((piece.param_start, piece.param_end))
    params = {
        name: {"shape": tuple(p.shape), "dtype": str(p.dtype)}
        for name, p in zip(names, optimizer.managed_params)
    }
    meta["optimizer"] = {
        "world_size": optimizer.world_size,
        "mixed_precision": optimizer.mixed_precision.to_dict(),
        "master_weights": with_masters,
        "params": params,
        "pieces": {name: sorted(v) for name, v in pieces.items()},
        "groups": _group_records(optimizer, names),
        "tensor_keys": sorted(tensor_keys),
        "scalar_keys": sorted(scalar_keys),
        "inner_class": type(inner).__name__,
        "loss_scaler": scaler is not None,
    }
    return state, meta, copied and copied_shards


# ---------------------------------------------------------------------------- load
def _resolve(path: Path) -> Path:
    """The complete version directory behind ``path`` (a checkpoint link, a version directory,
    or a directory of checkpoints: its newest complete one), or an error that says why not."""
    if not os.path.lexists(path):
        partial = [p for p in path.parent.glob(f"{_version_prefix(path)}*") if not (p / COMPLETE_FILE).exists()]
        if partial:
            raise CheckpointError(
                f"no complete checkpoint at {path}: the save into {partial[0]} was cut off before "
                f"it finished (incomplete: it has no {COMPLETE_FILE}). Resume from an earlier checkpoint."
            )
        raise FileNotFoundError(f"no checkpoint at {path}: the path does not exist.")
    if path.is_dir() and not path.is_symlink() and not (path / COMPLETE_FILE).exists() \
            and not path.name.startswith("."):
        links = _checkpoint_links(path)
        if not links:
            raise CheckpointError(f"{path} is a directory without a complete checkpoint in it.")
        return links[0][1].resolve()
    target = path.resolve()
    if not target.is_dir():
        raise CheckpointError(f"{path} is not a checkpoint directory.")
    if not (target / COMPLETE_FILE).exists():
        raise CheckpointError(
            f"the checkpoint at {target} is incomplete (no {COMPLETE_FILE}): its save was cut off. "
            f"Resume from an earlier checkpoint."
        )
    return target


def _completion_record(target: Path) -> dict[str, Any]:
    with open(target / COMPLETE_FILE) as f:
        record = json.load(f)
    if record.get("format") not in (FORMAT, FORMAT_V1):
        raise CheckpointError(
            f"{target} has format {record.get('format')!r}; this nxd_smp reads {FORMAT!r} and {FORMAT_V1!r}."
        )
    return record


def _verify_files(target: Path, record: Mapping[str, Any], checksums: bool) -> None:
    """Every file the completion record lists is there with its size; with ``checksums``
    also its CRC-32 (a second read of every byte: the loader checks the format-2 tensors it
    reads as it reads them, so only format 1 and ``inspect --verify`` need this)."""
    problems = []
    for name, (size, crc) in sorted(record["files"].items()):
        f = target / name
        if not f.exists():
            problems.append(f"{name} is missing")
        elif f.stat().st_size != size:
            problems.append(f"{name} is truncated or altered ({f.stat().st_size} bytes, expected {size})")
        elif checksums and _crc32(f) != crc:
            problems.append(f"{name} is corrupted (CRC-32 mismatch)")
    if problems:
        raise CheckpointError(f"the checkpoint at {target} is damaged: " + "; ".join(problems) + ".")


def _read_tensors(staging: dict[str, torch.Tensor], target: Path, verify: bool) -> None:
    """Read every staging tensor from the checkpoint at ``target`` (this process only)."""
    try:
        index = read_index(target)
        missing = sorted(set(staging) - set(index))
        if missing:
            raise CheckpointError(f"the checkpoint at {target} lacks the tensors {missing[:8]}"
                                  + (f" and {len(missing) - 8} more" if len(missing) > 8 else "") + ".")
        read_tensors(target, index, staging, verify=verify, threads=_WRITE_THREADS)
    except (ChecksumError, ValueError) as e:  # damaged bytes, a refused index, a bad entry
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"the checkpoint at {target} is damaged or refused: {e}") from e


def _agree(coordinator: Coordinator, error: BaseException | None) -> None:
    """Every rank learns whether any rank failed; if one did, all raise (so either all ranks
    commit or none)."""
    failures = [f for f in coordinator.all_gather(None if error is None else _error_text(error)) if f]
    if error is not None:
        raise error
    if failures:
        raise CheckpointError("another rank could not load the checkpoint: " + "; ".join(failures))


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
    _check_args(model, optimizer)
    objects = _stateful_objects(scheduler, stateful)
    _finish_save_in_flight(raise_error=False)
    path = Path(path)
    coordinator = _backend(model, optimizer).coordinator
    rank = coordinator.rank
    with _phases(progress, rank, ["verify", "read", "commit"], f"load {path.name}") as advance:
        found: Any = None
        if rank == 0:
            try:
                target = _resolve(path)
                record = _completion_record(target)
                _verify_files(target, record, checksums=verify_checksums and record["format"] == FORMAT_V1)
                found = [str(target), record]
            except FileNotFoundError as e:
                found = {"missing": str(e)}
            except CheckpointError as e:
                found = {"refused": str(e)}
        found = coordinator.broadcast(found)
        if isinstance(found, dict):
            raise FileNotFoundError(found["missing"]) if "missing" in found else CheckpointError(found["refused"])
        target, record = Path(found[0]), found[1]
        error = None
        try:
            meta = _safe_load(target / META_FILE)
            saved = _safe_load(target / EXTRA_FILE)
            if record["format"] == FORMAT_V1:
                saved = {"extra": saved, "objects": {}}
            missing = sorted(set(objects) - set(saved["objects"]))
            if missing:
                raise CheckpointError(
                    f"the checkpoint holds no state for {missing}; it has {sorted(saved['objects']) or 'none'}. "
                    f"Load without them, or from a checkpoint saved with them."
                )
            advance("verify")
            staging, plan = _plan_load(meta, model, optimizer)
            _read_tensors(staging, target, verify_checksums)
            shards = _assemble(staging, plan, optimizer)
        except (CheckpointError, OSError) as e:
            error = e
        _agree(coordinator, error)
        advance("read")
        _commit(staging, shards, meta, model, optimizer)
        for name, obj in objects.items():
            obj.load_state_dict(saved["objects"][name])
        advance("commit")
    return saved["extra"]


def _plan_load(meta: Mapping[str, Any], model: nn.Module, optimizer: Zero1Optimizer | None):
    """Check the checkpoint against the live objects; allocate staging buffers."""
    if meta.get("format") not in (FORMAT, FORMAT_V1):
        raise CheckpointError(f"unknown checkpoint format {meta.get('format')!r}; expected {FORMAT!r}.")
    live = model.state_dict()
    saved = meta["model"]
    problems = []
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    if missing:
        problems.append(f"missing from the checkpoint: {missing}")
    if unexpected:
        problems.append(f"in the checkpoint but not in the model: {unexpected}")
    for key in sorted(set(live) & set(saved)):
        shape, dtype = tuple(live[key].shape), str(live[key].dtype)
        if tuple(saved[key]["shape"]) != shape:
            problems.append(f"{key}: shape {tuple(saved[key]['shape'])} in the checkpoint, {shape} in the model")
        elif saved[key]["dtype"] != dtype:
            problems.append(f"{key}: dtype {saved[key]['dtype']} in the checkpoint, {dtype} in the model")
    if problems:
        raise CheckpointError("the checkpoint does not fit the model: " + "; ".join(problems) + ".")
    staging: dict[str, torch.Tensor] = {
        f"model/{key}": torch.empty(info["shape"], dtype=getattr(torch, info["dtype"].split(".")[-1]))
        for key, info in saved.items()
    }
    if optimizer is None:
        return staging, None

    saved_opt = meta["optimizer"]
    if saved_opt is None:
        raise CheckpointError(
            "the checkpoint holds no optimizer state; load it with optimizer=None and build "
            "the optimizer afresh."
        )
    names = managed_param_names(model, optimizer)
    mine = _group_records(optimizer, names)
    theirs = saved_opt["groups"]
    if [g["params"] for g in mine] != [g["params"] for g in theirs]:
        live_names, saved_names = set(names), set(saved_opt["params"])
        raise CheckpointError(
            "the checkpoint's optimizer does not fit: "
            f"parameters missing from it {sorted(live_names - saved_names)}, "
            f"extra in it {sorted(saved_names - live_names)}"
            + ("" if live_names != saved_names else "; the param groups are arranged differently")
            + "."
        )
    # Each saved state tensor becomes, per bucket, a buffer of this rank's new shard
    # (shard dtype; masters fp32). A saved piece that lies inside one of this rank's
    # pieces is read straight into a view of that buffer; one that straddles a shard
    # boundary is read into its own staging tensor and the overlap copied afterwards.
    # plan["scalar"][bucket]: {key: staging key} from the bucket's first parameter (a
    # shard of only padding still needs ``step``).
    plan: dict[str, Any] = {"shards": {}, "copies": [], "scalar": {}}
    kinds = [("optim", key) for key in saved_opt["tensor_keys"]]
    if saved_opt["master_weights"]:
        kinds.append(("master", None))
    layouts, masters = optimizer.bucket_layouts, optimizer.master_shards
    for kind, key in kinds:
        buffers = []
        for layout, master in zip(layouts, masters):
            buffer = torch.empty(layout.shard_numel, dtype=torch.float32 if kind == "master" else master.dtype)
            covered = sum(piece.numel for piece in layout.pieces(optimizer.rank))
            buffer[covered:].zero_()  # padding: the pieces fill a prefix of the shard
            buffers.append(buffer)
        plan["shards"][(kind, key)] = buffers
    if saved_opt.get("loss_scaler") and optimizer.loss_scaler is not None:
        for key, value in optimizer.loss_scaler.state_dict().items():
            staging[f"loss_scaler/{key}"] = torch.empty((), dtype=value.dtype)
    for b, layout in enumerate(layouts):
        first = names[layout.param_indices[0]]
        for key in saved_opt["scalar_keys"]:
            entry = f"optim/{first}/{key}"
            staging[entry] = torch.empty((), dtype=torch.float32)
            plan["scalar"].setdefault(b, {})[key] = entry
        for piece in layout.pieces(optimizer.rank):
            name = names[layout.param_indices[piece.index]]
            for lo, hi in saved_opt["pieces"][name]:
                start, end = max(lo, piece.param_start), min(hi, piece.param_end)
                if start >= end:
                    continue
                dst = piece.shard_start + (start - piece.param_start)
                inside = lo >= piece.param_start and hi <= piece.param_end
                for kind, key in kinds:
                    entry = f"optim/{name}/{key}/{lo}" if kind == "optim" else f"master/{name}/{lo}"
                    buffer = plan["shards"][(kind, key)][b]
                    if inside:
                        staging[entry] = buffer[dst : dst + hi - lo]
                    else:
                        if entry not in staging:
                            staging[entry] = torch.empty(hi - lo, dtype=buffer.dtype)
                        plan["copies"].append((entry, buffer, dst, start - lo, end - start))
    return staging, plan


def _assemble(staging: dict[str, torch.Tensor], plan, optimizer: Zero1Optimizer | None):
    """Finish this rank's shard buffers from the pieces that straddled shard boundaries."""
    if optimizer is None:
        return None
    for entry, buffer, dst, src, n in plan["copies"]:
        buffer[dst : dst + n].copy_(staging[entry][src : src + n])
    scalars = [
        {key: staging[entry] for key, entry in plan["scalar"].get(b, {}).items()}
        for b in range(len(optimizer.bucket_layouts))
    ]
    return {"tensors": plan["shards"], "scalars": scalars}


def _commit(staging, shards, meta, model: nn.Module, optimizer: Zero1Optimizer | None) -> None:
    model_state = {key[len("model/"):]: value for key, value in staging.items() if key.startswith("model/")}
    with torch.no_grad():
        model.load_state_dict(model_state, strict=True)  # copies in place: views stay views
    if optimizer is None:
        return
    scaler_state = {k[len("loss_scaler/"):]: v for k, v in staging.items() if k.startswith("loss_scaler/")}
    if scaler_state:
        optimizer.loss_scaler.load_state_dict(scaler_state)
    tensors = {key: bufs for (kind, key), bufs in shards["tensors"].items() if kind == "optim"}
    _commit_optimizer(
        optimizer,
        tensors,
        shards["scalars"],
        [record["hyper"] for record in meta["optimizer"]["groups"]],
        shards["tensors"].get(("master", None)),
    )


def _commit_optimizer(
    optimizer: Zero1Optimizer,
    tensors: Mapping[str, list[torch.Tensor]],
    scalars: list[Mapping[str, torch.Tensor]],
    hypers: list[Mapping[str, Any]],
    masters: list[torch.Tensor] | None,
) -> None:
    """Install checked shard states (``tensors[key][bucket]``), per-bucket scalar state,
    per-group hyperparameters and, if given, master shards; else rebuild the masters from
    the current parameters with a warning."""
    inner = optimizer.inner_optimizer
    state = {}
    for b in range(len(optimizer.master_shards)):
        entry = {key: value.clone() for key, value in scalars[b].items()}
        entry.update({key: bufs[b] for key, bufs in tensors.items()})
        if entry:
            state[b] = entry
    groups, start = [], 0
    for group, hyper in zip(inner.param_groups, hypers):
        n = len(group["params"])
        groups.append({**group, **hyper, "params": list(range(start, start + n))})
        start += n
    inner.load_state_dict({"state": state, "param_groups": groups})
    for group, hyper in zip(optimizer.param_groups, hypers):
        group.update(hyper)
    optimizer.zero_grad()
    if not optimizer.mixed_precision.use_master_weights:
        return
    if masters is not None:
        optimizer.load_master_shards(masters)
    else:
        optimizer.rebuild_master_from_params()
        warnings.warn(
            "the checkpoint has no master weights: they were rebuilt from the loaded "
            "parameters, so precision below the parameter dtype is lost. Save with "
            "use_master_weights_in_ckpt=True to keep it.",
            stacklevel=3,
        )


def load_full_optimizer_state(
    model: nn.Module,
    optimizer: Zero1Optimizer,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    hyperparameters: list[Mapping[str, Any]],
    master_weights: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Install unsharded, per-parameter optimizer state into ``optimizer`` at its own DP
    size; every rank calls it with the same full tensors and keeps its own shard.

    Args:
        state: ``{parameter name: {key: tensor shaped like the parameter, or 0-dim}}`` (the
            layout ``read_checkpoint`` returns; ``{}`` for a parameter without state yet).
        hyperparameters: one dict per param group (lr, betas, ...), in group order; kernel
            choices such as ``fused`` are ignored.
        master_weights: ``{parameter name: tensor shaped like the parameter}``, or None to
            rebuild the masters from the current parameters (with a warning that precision
            below the parameter dtype is lost).

    Raises:
        CheckpointError: names, shapes or groups that do not fit, each named; nothing is
            changed then.
    """
    _check_args(model, optimizer)
    names = managed_param_names(model, optimizer)
    live = dict(zip(names, optimizer.managed_params))
    problems = []
    if len(hyperparameters) != len(optimizer.param_groups):
        problems.append(f"{len(hyperparameters)} param groups given, the optimizer has {len(optimizer.param_groups)}")
    missing = sorted(set(names) - set(state))
    extra = sorted(set(state) - set(names))
    if missing:
        problems.append(f"no state for {missing}")
    if extra:
        problems.append(f"state for parameters the optimizer does not manage: {extra}")
    tensor_keys = sorted({k for entry in state.values() for k, v in entry.items() if v.dim() > 0})
    for name in sorted(set(names) & set(state)):
        entry, shape = state[name], tuple(live[name].shape)
        if entry and sorted(k for k, v in entry.items() if v.dim() > 0) != tensor_keys:
            problems.append(f"{name}: state keys {sorted(entry)}, others have {tensor_keys}")
        for key, value in entry.items():
            if value.dim() > 0 and tuple(value.shape) != shape:
                problems.append(f"{name}/{key}: shape {tuple(value.shape)}, the parameter is {shape}")
        if master_weights is not None and tuple(master_weights[name].shape) != shape:
            problems.append(f"master weight {name}: shape {tuple(master_weights[name].shape)}, the parameter is {shape}")
    if problems:
        raise CheckpointError("the optimizer state does not fit: " + "; ".join(problems) + ".")

    scalars, tensors = [], {key: [] for key in tensor_keys}
    masters = None if master_weights is None else []
    for layout, master in zip(optimizer.bucket_layouts, optimizer.master_shards):
        bucket_names = [names[i] for i in layout.param_indices]
        pieces = layout.pieces(optimizer.rank)

        def shard_of(source: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
            buffer = torch.zeros(layout.shard_numel, dtype=dtype)
            for piece in pieces:
                flat = source[bucket_names[piece.index]].reshape(-1)
                buffer[piece.shard_start : piece.shard_start + piece.numel].copy_(flat[piece.param_start : piece.param_end])
            return buffer

        scalars.append({k: v for k, v in state[bucket_names[0]].items() if v.dim() == 0})
        for key in tensor_keys:
            tensors[key].append(shard_of({n: state[n][key] for n in bucket_names}, master.dtype))
        if masters is not None:
            masters.append(shard_of(master_weights, torch.float32))
    _commit_optimizer(optimizer, tensors, scalars, [group_hyperparameters(h) for h in hyperparameters], masters)


# ---------------------------------------------------------------------------- offline tools
def inspect_checkpoint(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """What a checkpoint holds: per tensor its shape, dtype and bytes; master weights or
    not; the DP size it was written at; the saved stateful objects; total bytes on disk.
    ``verify``: also check the size and CRC-32 of every file (CheckpointError if damaged)."""
    target = _resolve(Path(path))
    record = _completion_record(target)
    _verify_files(target, record, checksums=verify)
    meta = _safe_load(target / META_FILE)
    try:
        index = read_index(target)
    except ValueError as e:
        raise CheckpointError(f"the checkpoint at {target} is damaged or refused: {e}") from e
    tensors = {key: {"shape": info.shape, "dtype": str(info.dtype), "bytes": info.nbytes}
               for key, info in sorted(index.items())}
    opt = meta["optimizer"]
    saved = _safe_load(target / EXTRA_FILE)
    return {
        "path": str(target),
        "format": record["format"],
        "saved_at_ns": record.get("saved_at_ns"),
        "stateful": sorted(saved["objects"]) if record["format"] == FORMAT else [],
        "model": meta["model"],
        "optimizer": None if opt is None else {
            "dp_size_written_at": opt["world_size"],
            "master_weights": opt["master_weights"],
            "mixed_precision": opt["mixed_precision"],
            "state_keys": opt["tensor_keys"] + opt["scalar_keys"],
            "inner_class": opt["inner_class"],
            "groups": [{"params": g["params"], **{k: v for k, v in g["hyper"].items()}} for g in opt["groups"]],
        },
        "tensors": tensors,
        "bytes_on_disk": sum(f.stat().st_size for f in target.iterdir() if f.is_file()),
    }


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of a checkpoint, whole: {"model": state_dict, "optimizer": None or
    {"groups": [{"hyper", "params": names}], "state": {name: {key: tensor shaped like the
    parameter (or 0-dim)}}, "master_weights": {name: fp32 tensor} or None}, "extra",
    "stateful": {name: state dict}}."""
    target = _resolve(Path(path))
    record = _completion_record(target)
    _verify_files(target, record, checksums=record["format"] == FORMAT_V1)
    meta = _safe_load(target / META_FILE)
    saved = _safe_load(target / EXTRA_FILE)
    try:
        index = read_index(target)
    except ValueError as e:
        raise CheckpointError(f"the checkpoint at {target} is damaged or refused: {e}") from e
    staging = {key: torch.empty(info.shape, dtype=info.dtype) for key, info in index.items()}
    _read_tensors(staging, target, verify=True)
    result: dict[str, Any] = {
        "model": {k[len("model/"):]: v for k, v in staging.items() if k.startswith("model/")},
        "optimizer": None,
        "extra": saved if record["format"] == FORMAT_V1 else saved["extra"],
        "stateful": {} if record["format"] == FORMAT_V1 else saved["objects"],
    }
    opt = meta["optimizer"]
    if opt is None:
        return result

    def whole(prefix: str, shape) -> torch.Tensor:
        parts = sorted(
            (int(k[len(prefix):]), v) for k, v in staging.items()
            if k.startswith(prefix) and "/" not in k[len(prefix):]
        )
        return torch.cat([v for _, v in parts]).view(shape)

    state = {}
    for name, info in opt["params"].items():
        shape = tuple(info["shape"])
        entry = {key: whole(f"optim/{name}/{key}/", shape) for key in opt["tensor_keys"]}
        entry.update({key: staging[f"optim/{name}/{key}"] for key in opt["scalar_keys"]})
        state[name] = entry
    result["optimizer"] = {
        "groups": opt["groups"],
        "state": state,
        "master_weights": {
            name: whole(f"master/{name}/", tuple(info["shape"])) for name, info in opt["params"].items()
        } if opt["master_weights"] else None,
    }
    return result


def consolidate(path: str | os.PathLike, out: str | os.PathLike) -> None:
    """Write one plain ``torch.save`` file: ``{"model": state_dict, "optimizer":
    torch.optim-style state dict (param ids in the saved group order; each group also lists
    its ``param_names``), "master_weights": {name: fp32 tensor} or None, "extra": ...,
    "stateful": {name: state dict} (the scheduler's under "scheduler")}``. Runs in one process."""
    full = read_checkpoint(path)
    result = {"model": full["model"], "optimizer": None, "master_weights": None, "extra": full["extra"],
              "stateful": full["stateful"]}
    opt = full["optimizer"]
    if opt is not None:
        state, groups, index = {}, [], 0
        for g in opt["groups"]:
            ids = []
            for name in g["params"]:
                if opt["state"][name]:
                    state[index] = opt["state"][name]
                ids.append(index)
                index += 1
            groups.append({**g["hyper"], "params": ids, "param_names": list(g["params"])})
        result["optimizer"] = {"state": state, "param_groups": groups}
        result["master_weights"] = opt["master_weights"]
    torch.save(result, out)


if __name__ == "__main__":  # ``python -m nxd_smp.checkpoint ...``: the CLI under its old name
    import sys

    from .cli import main

    sys.exit(main(prog="python -m nxd_smp.checkpoint"))
