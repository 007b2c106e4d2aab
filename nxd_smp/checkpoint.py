"""Sharded, reshardable, atomic checkpoints of a model, its ``Zero1Optimizer``, and the
caller's scheduler and other stateful objects; saved synchronously or in the background.
The public entry points; the work is done in ``nxd_smp.checkpointing``:

* every load, whatever its format, runs one pipeline (``nxd_smp.optim.loading``): read (a format's
  reader, the formats registered in ``pipeline``: ``smp_format`` for nxd_smp's own, NxD's by
  ``nxd_smp.interop``) -> check -> agree (``nxd_smp.backend.agreement``) -> install;
* a save (``save``) writes nxd_smp's format into a version folder and swaps the checkpoint's link
  (``versions``), now or in the background (``writer``);
* every file operation goes through one filesystem room (``files``: directory descriptors, no link
  followed below the root), every pickled file through one strict reader (``reader``, its pickle
  read by ``unpickler``), every JSON file through ``typed_json``, each parse charged to a budget
  linear in its input (``budget``);
* ``tools``: the offline tools (process-local: they never communicate).

A checkpoint saved at DP size N loads at any DP size M; ``path`` always names a complete
checkpoint (the old one or the new one); a refused load changes nothing; loading never runs
code from the files. Rank, world and the ranks' agreement come from the optimizer's backend
(``nxd_smp.backend``): under torch.distributed a gloo group made for checkpoints, the shared
memory of the XLA CPU device's replica threads, or ``xm.rendezvous`` on Neuron.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .backend import Backend, select_backend, this_replica
from .backend.agreement import decide
from .checkpointing.files import entry_kind
from .checkpointing.locations import location_of, open_store
from .checkpointing.object_io import S3Path
from .checkpointing.pipeline import (
    SmpFormat,
    format_named,
    locate_checkpoint,
    registered_formats,
    state_dict_format,
)
from .checkpointing.save import save
from .checkpointing.tools import consolidate, inspect_checkpoint, read_checkpoint
from .checkpointing.writer import finalize_checkpoint, finish_save_in_flight, save_in_flight
from .core.errors import CheckpointError, ConfigError, NotCommittedError
from .optim.loading.check import SCHEDULER
from .optim.loading.run import full_state, run
from .optim.loading.staged import Staged, Targets
from .zero1_optimizer import Zero1Optimizer, zero1_optimizer_of

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "finalize_checkpoint",
    "has_checkpoint",
    "remove_checkpoint",
    "inspect_checkpoint",
    "consolidate",
    "read_checkpoint",
    "load_full_optimizer_state",
]


# A model saved or loaded without its optimizer: the default backend of its device, made once
# per device, rank of this process (XLA CPU replicas are its threads) and default process
# group (its coordinator may make a gloo group at first use).
_model_backends: dict[tuple[str, object, int], Backend] = {}
# The directory of each rank's last save in NxD's call shape (a folder per tag), for callers that
# remove tags by name (NxD Training, through NxD's io state: ``interop.nxd.patch``).
_tag_directories: dict[Any, Path] = {}


def check_args(model: Any, optimizer: Any) -> Zero1Optimizer | None:
    """The ``Zero1Optimizer`` that ``optimizer`` is or holds (NxD's trainer wrapper, accelerate's and
    optimum-neuron's keep it in ``.optimizer``), None for None; ``model`` checked.

    Raises:
        TypeError: ``model`` is not a module, or ``optimizer`` holds no nxd_smp optimizer.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    if optimizer is None:
        return None
    zero1 = zero1_optimizer_of(optimizer)
    if zero1 is None:
        raise TypeError(
            f"optimizer must be a nxd_smp Zero1Optimizer, or hold one in .optimizer (NxD's wrapper, accelerate's), "
            f"got {type(optimizer).__name__}; a plain torch optimizer (ZeRO-1 off) is replicated: save its "
            f"state_dict() with torch.save, or pass the state dicts in NxD's call shape, save_checkpoint(dir, tag, "
            f"model=model.state_dict(), optimizer=optimizer.state_dict()).")
    return zero1


def stateful_objects(scheduler: Any, stateful: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{name: object}`` for the scheduler and the caller's other stateful objects, each checked to have
    ``state_dict()`` and ``load_state_dict()``."""
    objects: dict[str, Any] = {}
    if stateful is not None:
        if not isinstance(stateful, Mapping):
            raise TypeError(f"stateful must be a dict of name -> object, got {type(stateful).__name__}.")
        for name, obj in stateful.items():
            if not isinstance(name, str) or name == SCHEDULER:
                raise ConfigError(f"stateful names must be strings other than {SCHEDULER!r} (pass the scheduler as "
                                 f"scheduler=...), got {name!r}.")
            objects[name] = obj
    if scheduler is not None:
        objects[SCHEDULER] = scheduler
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict(); pass objects that do "
                            f"(an LR scheduler, a data loader's sampler, ...), or put plain values in extra=.")
    return objects


def _device_backend(device: torch.device) -> Backend:
    """The default backend of ``device``, made once per device, rank of this process and default
    process group."""
    world = id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else 0
    key = (str(device), this_replica(), world)
    if key not in _model_backends:
        _model_backends[key] = select_backend(device)
    return _model_backends[key]


def _backend(model: nn.Module, optimizer: Zero1Optimizer | None) -> Backend:
    """The optimizer's backend, or (a model alone) the default one for the model's device:
    where rank, world and coordination come from."""
    if optimizer is not None:
        return optimizer.backend
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return _device_backend(first.device if first is not None else torch.device("cpu"))


def _state_dicts_backend(*values: Any) -> Backend:
    """Where rank, world and coordination come from for state dicts (NxD Training's call shape):
    the default backend of the device of their first tensor; with none (the empty dicts of a
    load), the XLA device of a replica thread, else the CPU."""
    for value in values:
        zero1 = zero1_optimizer_of(value) if not isinstance(value, (Mapping, nn.Module)) else None
        if zero1 is not None:
            return zero1.backend
        tensors = (value.values() if isinstance(value, Mapping)
                   else itertools.chain(value.parameters(), value.buffers()) if isinstance(value, nn.Module) else ())
        first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if first is not None:
            return _device_backend(first.device)
    if this_replica() is not None:
        import torch_xla

        return _device_backend(torch_xla.device())
    return _device_backend(torch.device("cpu"))


def _tagged(path: str | os.PathLike, tag: Any, what: str = "path") -> Path | S3Path:
    """``path / tag`` (NxD's call shape: a folder per tag under ``path``), or ``path``: the door every
    entry point here takes its path through, before anything is read or made (``locations.location_of``:
    a local path, or ``s3://bucket/prefix``).

    Raises:
        TypeError: ``path`` is not a path, or ``tag`` not a str or int.
        ConfigError: ``path`` is a URL of another scheme than ``s3``, or ``tag`` is not a plain folder name.
    """
    path = location_of(path, what)
    if tag is None:
        return path
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(f"tag must be a str (or an int step), got {type(tag).__name__}.")
    tag = str(tag)
    if not tag or tag.startswith(".") or os.sep in tag or (os.altsep and os.altsep in tag):
        raise ConfigError(f"tag must be a plain folder name (no path separator, not starting with '.'), got {tag!r}.")
    return path / tag


def _check_nxd_only_args(num_workers: Any, **flags: Any) -> None:
    """NxD's arguments that have no effect here, still checked to be what NxD takes."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ConfigError(f"num_workers must be a positive int, got {num_workers!r}.")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}.")


def save_checkpoint(
    path: str | os.PathLike | None = None,
    tag: str | int | None = None,
    model: nn.Module | None = None,
    optimizer: Zero1Optimizer | None = None,
    scheduler: Any = None,
    user_content: Any = None,
    num_workers: int = 8,
    use_xser: bool = False,
    num_kept_ckpts: int | None = None,
    async_save: bool = False,
    zero1_optimizer: bool = False,
    use_zero1_dcp: bool = False,
    avoid_saving_lower_precision_weights: bool = False,
    *,
    stateful: Mapping[str, Any] | None = None,
    extra: Any = None,
    save_master_weights: bool | None = None,
    progress: bool | None = None,
    checkpoint_dir_str: str | os.PathLike | None = None,
) -> Path:
    """Write ``model`` (and ``optimizer``'s sharded state) to ``path``; every rank calls it.

    Two call shapes write the same format: nxd_smp's ``save_checkpoint(path, model=...,
    optimizer=...)`` and NxD's ``save_checkpoint(checkpoint_dir, tag, model, optimizer,
    scheduler, user_content, ...)``, which saves into the folder ``checkpoint_dir/tag``. With
    state dicts (NxD Training's ``model=<state dict>, optimizer=<state dict>``) the tag folder is
    written in NxD's layout, each rank's dicts as they are (the registered format for state dicts:
    ``nxd_smp.interop.nxd.state_dicts``).

    Args:
        path: the checkpoint's name: a symbolic link that is swapped atomically to the
            new version once it is complete. Missing parent directories are created; an
            existing empty directory at ``path`` is replaced, anything else is refused.
            With ``tag``: the directory that holds one checkpoint per tag. Or
            ``s3://bucket/prefix`` (the ``s3`` extra; boto3's credentials and endpoint): the
            version is uploaded under the prefix and committed by a conditional write of its
            manifest (``checkpointing.object_store``).
        tag: NxD's tag (``"step_100"``, or an int): the checkpoint is ``path/tag``.
        model: the model; its ``state_dict()`` is written once (it is replicated). Or its state
            dict (NxD Training's call shape).
        optimizer: a ``Zero1Optimizer``, or anything holding one in ``.optimizer`` (NxD's
            wrapper, accelerate's, optimum-neuron's); each rank writes only the pieces it owns.
            Or this rank's optimizer state dict (NxD Training's call shape).
        scheduler: an LR scheduler (anything with ``state_dict``/``load_state_dict``), saved
            with the optimizer and restored by ``load_checkpoint(..., scheduler=...)``.
        user_content: JSON values, tuples, dtypes and plain tensors (step counter, RNG state,
            ...; ``extra``'s rule), returned by ``load_checkpoint`` (NxD's name for ``extra``).
        num_workers, use_xser: NxD's I/O settings, accepted and checked but without effect:
            every rank writes its own tensors as raw bytes with a few threads, NxD's xser
            layout is never written (NxD's xser checkpoints are read, see ``load_checkpoint``).
        num_kept_ckpts: keep only the newest this many complete checkpoints in ``path``'s
            directory (with ``tag``: this many tags in ``path``); the new one and the newest
            complete one are never removed. None or -1 (NxD's "all"): keep every one.
        async_save: return once the state is copied to host memory; writing, fsync and the
            swap of ``path`` happen in the background. At most one save is in flight: the
            next save (or ``finalize_checkpoint()``) waits for it and raises its error.
        zero1_optimizer: NxD's hint for an optimizer passed as a dict; accepted, without
            effect (every rank writes its own optimizer state dict whatever it says).
        use_zero1_dcp, avoid_saving_lower_precision_weights: NxD 2.28's options, accepted
            without effect: the optimizer's shards are always written as raw tensors under a
            JSON index, and the model's weights are always written too.
        stateful: more objects with ``state_dict``/``load_state_dict`` by name (a sampler,
            a data loader, ...).
        extra: the same as ``user_content`` (pass one of them).
        save_master_weights: write the fp32 master weights (default: the optimizer's
            ``use_master_weights_in_ckpt``).
        progress: show a progress bar on rank 0 (default: when this module's logger is
            at INFO or below).
        checkpoint_dir_str: ``path`` under NxD's keyword name (pass one of them).

    Returns:
        The path of the version directory behind the checkpoint (for an asynchronous save,
        the one it will be once the background part is done).

    Raises:
        ConfigError: ``path`` (``checkpoint_dir_str``) is a URL of another scheme than ``s3://``; or an
            ``s3://`` path without boto3 installed (``pip install 'nxd_smp[s3]'``); nothing is written.
        CheckpointError: bad arguments, or the error of a previous asynchronous save that
            nothing raised yet (that save is then over, and this one is not started).
        TypeError: ``extra``/``user_content`` or a stateful object's state holds a value that is
            neither a JSON value, a tuple, a dtype nor a plain tensor (nothing is saved; nxd_smp's
            format holds no pickle).
    """
    if (path is None) == (checkpoint_dir_str is None):
        raise TypeError("pass the checkpoint's path once: as path (the first argument) or as NxD's checkpoint_dir_str=.")
    if checkpoint_dir_str is not None:
        path = _tagged(checkpoint_dir_str, tag, "checkpoint_dir_str")
    else:
        path = _tagged(path, tag)
    state_dicts = isinstance(model, Mapping) or isinstance(optimizer, Mapping)
    if model is None and not state_dicts:
        raise TypeError("save_checkpoint needs model=...: nxd_smp names the optimizer's state by the model's "
                        "parameters.")
    if not state_dicts:
        optimizer = check_args(model, optimizer)
    objects = stateful_objects(scheduler, stateful)
    _check_nxd_only_args(num_workers, use_xser=use_xser, async_save=async_save, zero1_optimizer=zero1_optimizer,
                         use_zero1_dcp=use_zero1_dcp,
                         avoid_saving_lower_precision_weights=avoid_saving_lower_precision_weights)
    if user_content is not None and extra is not None:
        raise ConfigError("pass user_content= or extra= (the same thing under NxD's and nxd_smp's names), not both.")
    extra = user_content if user_content is not None else extra
    if num_kept_ckpts == -1:
        num_kept_ckpts = None
    if num_kept_ckpts is not None and (isinstance(num_kept_ckpts, bool) or not isinstance(num_kept_ckpts, int)
                                       or num_kept_ckpts < 1):
        raise ConfigError(f"num_kept_ckpts must be a positive int, -1 or None, got {num_kept_ckpts!r}.")
    if tag is not None:
        _tag_directories[this_replica()] = path.parent
    if state_dicts:
        return _save_state_dicts(path, model, optimizer, scheduler, extra, stateful=stateful,
                                 save_master_weights=save_master_weights, async_save=async_save,
                                 num_kept_ckpts=num_kept_ckpts)
    masters_on = optimizer is not None and optimizer.mixed_precision.use_master_weights
    if save_master_weights is None:
        save_master_weights = optimizer is not None and optimizer.mixed_precision.use_master_weights_in_ckpt
    if save_master_weights and not masters_on:
        raise CheckpointError(
            "save_master_weights=True, but the optimizer keeps no master weights "
            "(use_master_weights=False); pass save_master_weights=None or False."
        )
    finish_save_in_flight(raise_error=True)  # at most one in flight; its failure surfaces here
    return save(path, model, optimizer, _backend(model, optimizer), objects=objects, extra=extra,
                save_master_weights=bool(save_master_weights), async_save=async_save,
                num_kept_ckpts=num_kept_ckpts, progress=progress)


def _save_state_dicts(path: Path, model: Any, optimizer: Any, scheduler: Any, extra: Any, *, stateful: Any,
                      save_master_weights: Any, async_save: bool, num_kept_ckpts: int | None) -> Path:
    """``save_checkpoint`` with state dicts (NxD Training's call shape); arguments already checked."""
    if stateful or save_master_weights is not None:
        raise TypeError("with state dicts, the dicts hold everything: stateful= and save_master_weights= do not apply.")
    values = {}
    for name, value in (("model", model), ("optimizer", optimizer)):
        if value is not None and not isinstance(value, Mapping) and not callable(getattr(value, "state_dict", None)):
            raise TypeError(f"{name} must be a state dict, an object with state_dict(), or None; got "
                            f"{type(value).__name__}.")
        values[name] = value if value is None or isinstance(value, Mapping) else value.state_dict()
    finish_save_in_flight(raise_error=True)  # at most one in flight; its failure surfaces here
    return state_dict_format().save_state_dicts(
        path, model=values["model"], optimizer=values["optimizer"], scheduler=scheduler, user_content=extra,
        backend=_state_dicts_backend(model, optimizer), async_save=async_save, num_kept=num_kept_ckpts)


def load_checkpoint(
    path: str | os.PathLike,
    tag: str | int | None = None,
    model: nn.Module | None = None,
    optimizer: Zero1Optimizer | None = None,
    scheduler: Any = None,
    num_workers: int = 8,
    strict: bool = True,
    use_zero1_dcp: bool = False,
    *,
    stateful: Mapping[str, Any] | None = None,
    verify_checksums: bool = True,
    progress: bool | None = None,
) -> Any:
    """Load a checkpoint at any DP size; every process of the job calls it (its verdict is world-wide).
    Returns the saved user content (``extra``), None if there was none.

    ``path`` is a checkpoint, or a directory of them (the newest complete one is loaded);
    with ``tag`` (NxD's call shape) the checkpoint ``path/tag``. Besides nxd_smp's
    checkpoints this reads NxD's own tag folders (``neuronx_distributed.trainer.
    save_checkpoint``, plain or ``use_xser``, written by NxD's ``NeuronZero1Optimizer`` at any
    DP size; ``nxd_smp.interop.nxd.folders`` says what they hold). The model gets the saved
    weights; the optimizer its states, hyperparameters and, when the checkpoint has them,
    master weights (the parameters then equal ``master.to(param dtype)``). Without saved
    master weights the masters are rebuilt from the loaded parameters, with a warning that
    precision was lost. ``scheduler`` and the ``stateful`` objects get their saved state.
    Pending ``main_grad`` is cleared. Everything is read and checked (sizes of all files,
    CRC-32 of every tensor read) before anything changes. An asynchronous save of this
    process still in flight is waited for first.

    NxD Training's call shape passes dicts to fill, ``model={}, optimizer={} or None``: an NxD
    tag folder's files are read into them in place, at the DP size they were saved at
    (``nxd_smp.interop.nxd.state_dicts``); ``optimizer=None`` reads the model only.

    Args:
        model: the model (or, in NxD Training's call shape, a dict to fill).
        optimizer: a ``Zero1Optimizer``, anything holding one in ``.optimizer``, a dict to fill,
            or None (the model only).
        strict: as ``nn.Module.load_state_dict``: with False, model entries that only the
            checkpoint or only the model has are left alone (the optimizer must still fit).
        num_workers, use_zero1_dcp: NxD's settings, accepted and checked but without effect
            (an NxD folder whose optimizer NxD saved with ``use_zero1_dcp=True`` is refused).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ConfigError: ``path`` is a URL of another scheme than ``s3://``, or an ``s3://`` path without
            boto3 installed (``pip install 'nxd_smp[s3]'``).
        CheckpointError: incomplete, truncated, corrupted or unsafe files, or names, shapes,
            dtypes or saved objects that do not fit, each named.
    """
    path = _tagged(path, tag)
    state_dicts = isinstance(model, MutableMapping) or isinstance(optimizer, MutableMapping)
    if model is None:
        raise TypeError("load_checkpoint needs model=...: the optimizer's state is named by the model's parameters "
                        "(or, in NxD Training's call shape, a dict to fill).")
    if not state_dicts:
        optimizer = check_args(model, optimizer)
    elif stateful:
        raise TypeError("with state dicts to fill, stateful= does not apply.")
    objects = stateful_objects(scheduler, stateful)
    _check_nxd_only_args(num_workers, strict=strict, use_zero1_dcp=use_zero1_dcp)
    finish_save_in_flight(raise_error=False)
    backend = _state_dicts_backend(model, optimizer) if state_dicts else _backend(model, optimizer)
    name, location = decide(backend.coordinator, locate_checkpoint, path)  # rank 0's choice for all
    folder_format = format_named(name)
    if isinstance(folder_format, SmpFormat) and state_dicts:
        raise CheckpointError(f"{path} holds nxd_smp's own format, which loads into the model and optimizer themselves, "
                              f"not into state dicts: pass model=<module> and optimizer=<optimizer>.")
    if not isinstance(folder_format, SmpFormat) and stateful:
        raise CheckpointError(f"{path} is an {folder_format.name} checkpoint, which holds no stateful objects; pass "
                              f"none.")
    zero1 = zero1_optimizer_of(optimizer) if optimizer is not None and not isinstance(optimizer, Mapping) else None
    targets = Targets(model=model, optimizer=zero1 or getattr(optimizer, "optimizer", optimizer), objects=objects,
                      backend=backend, strict=strict)
    read = folder_format.reader(location, targets, verify=verify_checksums)
    return run(read, targets, what=str(path), progress=progress).extra


def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``load_checkpoint(path, ...)`` finds a complete checkpoint there (NxD's
    ``has_checkpoint``): ``path`` is one (an nxd_smp checkpoint, or an NxD tag folder with
    its ``done`` file), or a directory holding one. A directory of complete nxd_smp checkpoints
    among which ``load_checkpoint`` refuses to choose (none its record holds, or several and no
    record: ``checkpointing.versions.newest_checkpoint``) has one too: the load then says why,
    rather than a resume starting over. A link elsewhere than its own version is none.

    On S3, ``path`` is a checkpoint with a commit record, or a prefix holding one
    (``checkpointing.object_store``), or NxD's own tag folder there (with ``done``); a failure to find out (the server away, a damaged commit
    record) is raised rather than answered False, which would have a resume start over.

    Raises:
        ConfigError: ``path`` is a URL of another scheme than ``s3://`` (rather than False, which would
            have a resume start over).
    """
    path = _tagged(path, None)
    if isinstance(path, S3Path):  # (an outage, throttling or a damaged record is raised: never "start over")
        with open_store(path.parent) as store:
            try:
                store.locate(path.name)
                return True
            except (FileNotFoundError, NotCommittedError):  # (or a folder NxD itself wrote to the bucket)
                return any(f.locate_in_bucket(path) is not None for f in registered_formats()[:-1])
    for folder_format in registered_formats():
        if folder_format.is_folder(path):
            return folder_format.is_complete(path)
    return entry_kind(path) == "directory" and any(f.newest(path) is not None for f in registered_formats())


def last_tag_directory() -> Path | S3Path | None:
    """The directory this rank last saved a tag into (``save_checkpoint(dir, tag, ...)``), or None."""
    return _tag_directories.get(this_replica())


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Remove the checkpoint at ``path``: an nxd_smp checkpoint (its link first, then its version
    directory) or an NxD tag folder (its ``done`` first): an interrupted removal never leaves
    something that looks complete. A checkpoint link to anything but its own version beside it
    (``checkpointing.versions.version_of``: another run's, say) is removed alone, never what it
    points to. Nothing there: nothing to do. Process-local (no collective):
    call it from one rank. This rank's background save of ``path``, if one is in flight, is
    waited for first.

    On S3 its commit records go first (oldest first), then its versions' objects.

    Raises:
        ConfigError: ``path`` is a URL of another scheme than ``s3://``.
        CheckpointError: ``path`` is something else than a checkpoint; it is left alone.
    """
    path = _tagged(path, None)
    if save_in_flight() == str(path):
        finish_save_in_flight(raise_error=False)
    # another tool's folder (a directory, never a checkpoint link), else the store's own (``Store.remove``)
    foreign = None if isinstance(path, S3Path) else next(
        (f for f in registered_formats()[:-1] if f.is_folder(path)), None)
    if foreign is not None:
        foreign.remove(path)
        return
    try:
        with open_store(path.parent) as store:
            store.remove(path.name)
    except FileNotFoundError:
        return


def load_full_optimizer_state(
    model: nn.Module,
    optimizer: Zero1Optimizer,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    hyperparameters: list[Mapping[str, Any]],
    master_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    source: str | os.PathLike | None = None,
) -> None:
    """Install unsharded, per-parameter optimizer state into ``optimizer`` at its own DP size; every
    process of the job calls it (the ranks agree world-wide), with the same full tensors, and each keeps
    its own shard. It runs the one pipeline as a
    checkpoint's load does: checked against the optimizer class and the hyperparameters installed,
    agreed on by every rank (the ranks of a data-parallel group must pass the same hyperparameters
    and step counts), installed as one transaction.

    Args:
        state: ``{parameter name: {key: tensor shaped like the parameter, or 0-dim}}`` (the layout
            ``read_checkpoint`` returns; ``{}`` for a parameter without state yet, which then starts
            from zero moments with its bucket's step count, or, where the other parameters' counts
            differ, from a fresh state as torch.optim's does).
        hyperparameters: one dict per param group (lr, betas, ...), in group order; kernel choices such
            as ``fused`` are ignored.
        master_weights: ``{parameter name: tensor shaped like the parameter}``, or None to rebuild the
            masters from the current parameters (with a warning that precision below the parameter
            dtype is lost).
        source: the file(s) they were read from, named in errors.

    Raises:
        CheckpointError: names, shapes, keys or groups that do not fit, each named; nothing is
            changed then.
    """
    zero1 = check_args(model, optimizer)
    if zero1 is None:
        raise TypeError("load_full_optimizer_state needs the optimizer to load into.")
    where = str(source) if source is not None else "the optimizer state"
    targets = Targets(model=model, optimizer=zero1, objects={}, backend=zero1.backend)
    run(lambda request: Staged(source=where, optimizer=full_state(state, hyperparameters, master_weights,
                                                                 source=where)), targets, what=where)
