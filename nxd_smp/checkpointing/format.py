"""What an nxd_smp checkpoint is: its files and keys, the records that describe the
optimizer, the completion record that says it is whole, and the safe reading of its small
files.

A checkpoint is a directory (a version, named by a link; ``links``) holding

* ``model/<state_dict key>``: the full model tensors (replicated: each written by one rank);
* ``optim/<param>/<state key>/<start>``: elements ``[start, end)`` of the flattened
  parameter's optimizer state (``exp_avg``, ``momentum_buffer``, ...), one entry per
  contiguous piece a rank owned; ``optim/<param>/<state key>`` for 0-dim state (``step``);
* ``master/<param>/<start>``: the same for fp32 master weights, when they are saved;
* ``loss_scaler/<key>``: the fp16 loss scaler's state;

as raw bytes (``storage``: a few files per rank, and the JSON index ``nxd_smp_index.json``),
plus ``nxd_smp_meta.json`` (shapes, dtypes, param groups, which pieces exist, the DP size
written at), ``extra.json`` (the caller's ``extra`` and the state dicts of the scheduler and
other stateful objects; their tensors are raw entries ``small/<n>``) and, written last,
``COMPLETE.json`` (size and CRC-32 of every file). Because every piece is addressed by parameter
name and element range, a checkpoint written at DP size N loads at any DP size M. The links that
name a version are ``links``'.

This is format 3: nothing in it is a pickle. The small files are typed JSON (``typed_json``:
JSON values, tuples, non-string keys, dtypes, tensors); anything else is refused when it is
saved. Checkpoints of formats 2 (the same tensor files, DCP's pickled ``Metadata`` as the index,
``nxd_smp_meta.pt`` and ``extra.pt``) and 1 (DCP's own file writer) still load, their pickled
files through the strict reader (``reader.load_file``), which admits what a state dict is and
nothing else.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.nn as nn

from ..core.errors import CheckpointError
from ..optim.param_groups import KERNEL_OPTIONS, index_groups
from ..optim.state_fit import describe
from ..zero1_optimizer import Zero1Optimizer, zero1_optimizer_of
from .paths import inside, open_regular, read_json, read_small
from .reader import load_file
from .storage import IO_THREADS, JSON_LIMIT, StoredTensor, read_tensors
from .storage import read_index as storage_index
from .typed_json import decode, dtype_named, dumps, encode, loads
from .values import is_shape, is_size

FORMAT = "nxd_smp.checkpoint/3"  # no pickle: raw tensors, a JSON index, typed JSON small files
FORMAT_V2 = "nxd_smp.checkpoint/2"  # raw tensors under DCP's pickled index, torch.save small files; still loaded
FORMAT_V1 = "nxd_smp.checkpoint/1"  # tensors in DCP's own FileSystemWriter files; still loaded
READABLE = (FORMAT, FORMAT_V2, FORMAT_V1)
META_FILE = "nxd_smp_meta.json"
EXTRA_FILE = "extra.json"
META_FILE_V2, EXTRA_FILE_V2 = "nxd_smp_meta.pt", "extra.pt"  # (formats 1 and 2)
COMPLETE_FILE = "COMPLETE.json"
SMALL_PREFIX = "small/"  # the index keys of the tensors in the small files (an RNG state, ...)
SCHEDULER = "scheduler"  # the name the scheduler's state is saved under
_CRC_BLOCK = 16 << 20


# ---------------------------------------------------------------------------- keys
def model_key(name: str) -> str:
    return f"model/{name}"


def state_key(param: str, key: str, start: int | None = None) -> str:
    """A piece of ``param``'s optimizer state ``key`` from element ``start``; None: 0-dim."""
    return f"optim/{param}/{key}" if start is None else f"optim/{param}/{key}/{start}"


def master_key(param: str, start: int) -> str:
    return f"master/{param}/{start}"


def scaler_key(key: str) -> str:
    return f"loss_scaler/{key}"


# ---------------------------------------------------------------------------- records
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


# How the inner optimizer computes, not what: chosen per device by whoever loads.
_IMPLEMENTATION_KEYS = frozenset({"params", *KERNEL_OPTIONS})


def group_records(optimizer: Zero1Optimizer, names: list[str]) -> list[dict[str, Any]]:
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
    return [record["params"] for record in group_records(optimizer, managed_param_names(model, optimizer))]


def torch_optim_groups(groups: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Group records (``{"hyper", "params": names}``) as torch.optim state dicts write param
    groups: the hyperparameters, consecutive integer ``params``, and the names beside them."""
    ids = index_groups([len(g["params"]) for g in groups])
    return [{**g["hyper"], "params": i, "param_names": list(g["params"])} for g, i in zip(groups, ids)]


def check_args(model: Any, optimizer: Any) -> Zero1Optimizer | None:
    """The ``Zero1Optimizer`` that ``optimizer`` is or holds (NxD's trainer wrapper, accelerate's
    and optimum-neuron's keep it in ``.optimizer``), None for None; ``model`` checked.

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
            f"optimizer must be a nxd_smp Zero1Optimizer, or hold one in .optimizer (NxD's wrapper, "
            f"accelerate's), got {type(optimizer).__name__}; a plain torch optimizer (ZeRO-1 off) is "
            f"replicated: save its state_dict() with torch.save, or pass the state dicts in NxD's call "
            f"shape, save_checkpoint(dir, tag, model=model.state_dict(), optimizer=optimizer.state_dict())."
        )
    return zero1


def stateful_objects(scheduler: Any, stateful: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{name: object}`` for the scheduler and the caller's other stateful objects, each
    checked to have ``state_dict()`` and ``load_state_dict()``."""
    objects: dict[str, Any] = {}
    if stateful is not None:
        if not isinstance(stateful, Mapping):
            raise TypeError(f"stateful must be a dict of name -> object, got {type(stateful).__name__}.")
        for name, obj in stateful.items():
            if not isinstance(name, str) or name == SCHEDULER:
                raise ValueError(
                    f"stateful names must be strings other than {SCHEDULER!r} (pass the scheduler as "
                    f"scheduler=...), got {name!r}."
                )
            objects[name] = obj
    if scheduler is not None:
        objects[SCHEDULER] = scheduler
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(
                f"{name}: {type(obj).__name__} has no state_dict()/load_state_dict(); pass objects that "
                f"do (an LR scheduler, a data loader's sampler, ...), or put plain values in extra=."
            )
    return objects


# ---------------------------------------------------------------------------- files
def crc32(path: Path) -> int:
    crc = 0
    with open_regular(path) as f:
        while block := f.read(_CRC_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc


def completion_record(target: Path) -> dict[str, Any]:
    """The completion record of the checkpoint version ``target``, checked to be one: its
    format, and per file a name inside ``target`` with its size and CRC-32.

    Raises:
        FileNotFoundError: there is none (the save did not complete).
        CheckpointError: it is damaged or refused.
    """
    path = target / COMPLETE_FILE
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete (its save was cut off).")
    record = read_json(target, COMPLETE_FILE)
    if not isinstance(record, dict) or record.get("format") not in READABLE:
        found = record.get("format") if isinstance(record, dict) else record
        raise CheckpointError(f"{target} has format {describe(found)}; this nxd_smp reads {', '.join(READABLE)}.")
    files = record.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(entry, list) and len(entry) == 2 and all(is_size(v) for v in entry)
        for entry in files.values()
    ):
        raise CheckpointError(f"{path} is damaged: its 'files' are not name -> [size, CRC-32].")
    for name in files:
        inside(target, name, source=str(path))
    return record


def verify_files(target: Path, record: Mapping[str, Any], checksums: bool) -> None:
    """Every file the completion record lists is there with its size; with ``checksums``
    also its CRC-32 (a second read of every byte: the loader checks the format-2 tensors it
    reads as it reads them, so only format 1 and ``inspect --verify`` need this)."""
    problems = []
    for name, (size, crc) in sorted(record["files"].items()):
        f = inside(target, name, source=str(target / COMPLETE_FILE))
        if not f.exists():
            problems.append(f"{name} is missing")
        elif not f.is_file():
            problems.append(f"{name} is not a regular file")
        elif f.stat().st_size != size:
            problems.append(f"{name} is truncated or altered ({f.stat().st_size} bytes, expected {size})")
        elif checksums and crc32(f) != crc:
            problems.append(f"{name} is corrupted (CRC-32 mismatch)")
    if problems:
        raise CheckpointError(f"the checkpoint at {target} is damaged: " + "; ".join(problems) + ".")


def _dtype_name(value: Any) -> bool:
    return dtype_named(value) is not None


def check_meta(meta: Any, source: Path) -> None:
    """The checkpoint's metadata (read from ``source``) is what nxd_smp writes: every
    field of the type it has, every shape a tuple of sizes, every dtype a torch dtype's name,
    every parameter's pieces ``[start, end)`` tiling its elements exactly (so a reader
    allocates no more than the parameters hold). Checked before anything is allocated.

    Raises:
        CheckpointError: naming ``source`` and the field.
    """
    def refuse(what: str) -> NoReturn:
        raise CheckpointError(f"{source} is damaged or crafted: {what}; refused.")

    if not isinstance(meta, Mapping) or meta.get("format") not in READABLE:
        refuse(f"format {describe(meta.get('format')) if isinstance(meta, Mapping) else type(meta).__name__}")
    model = meta.get("model")
    if not isinstance(model, Mapping):
        refuse("'model' is not a dict")
    for key, info in model.items():
        if not isinstance(key, str) or not isinstance(info, Mapping) or not is_shape(info.get("shape")) \
                or not _dtype_name(info.get("dtype")):
            refuse(f"the model entry {key!r} is not {{'shape': sizes, 'dtype': a torch dtype}}")
    tp = meta.get("tensor_parallel")
    if tp is not None and not (
            isinstance(tp, Mapping) and set(tp) == {"size", "rank", "split"} and is_shape((tp["size"], tp["rank"]))
            and 0 <= tp["rank"] < tp["size"] and isinstance(tp["split"], Mapping)
            and all(k in model and is_shape((d,)) and d < len(model[k]["shape"]) for k, d in tp["split"].items())):
        refuse("'tensor_parallel' is not {'size', 'rank' below it, 'split': {model key: one of its dimensions}}")
    opt = meta.get("optimizer")
    if opt is None:
        return
    if not isinstance(opt, Mapping):
        refuse("'optimizer' is not a dict")
    for field, kind in (("groups", list), ("params", Mapping), ("pieces", Mapping), ("tensor_keys", list),
                        ("scalar_keys", list), ("master_weights", bool), ("world_size", int)):
        if not isinstance(opt.get(field), kind):
            refuse(f"the optimizer's {field!r} is a {type(opt.get(field)).__name__}, not a {kind.__name__}")
    if not all(isinstance(k, str) for k in (*opt["tensor_keys"], *opt["scalar_keys"])) \
            or set(opt["tensor_keys"]) & set(opt["scalar_keys"]):
        refuse("the optimizer's state keys are not distinct strings")
    for i, group in enumerate(opt["groups"]):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), list) \
                or not all(isinstance(n, str) and n in opt["params"] for n in group["params"]):
            refuse(f"param group {i} does not list parameters by name")
        if not isinstance(group.get("hyper"), Mapping):
            refuse(f"param group {i}'s hyperparameters are a {type(group.get('hyper')).__name__}, not a dict")
    for name, info in opt["params"].items():
        if not isinstance(info, Mapping) or not is_shape(info.get("shape")) or not _dtype_name(info.get("dtype")):
            refuse(f"the optimizer's parameter {name!r} is not {{'shape': sizes, 'dtype': a torch dtype}}")
        numel = 1
        for d in info["shape"]:
            numel *= d
        pieces, end = opt["pieces"].get(name), 0
        if not isinstance(pieces, list):
            refuse(f"the pieces of {name!r} are not a list")
        for piece in pieces:
            if not (isinstance(piece, (tuple, list)) and len(piece) == 2 and is_shape(piece) and piece[0] == end
                    and piece[1] > piece[0]):
                refuse(f"the pieces of {name!r} do not tile its {numel} elements in order ({piece!r} after {end})")
            end = piece[1]
        if end != numel:
            refuse(f"the pieces of {name!r} cover [0, {end}) of its {numel} elements")


def read_index(target: Path, form: str) -> dict[str, StoredTensor]:
    """The tensor index of the checkpoint of format ``form`` at ``target`` (read without running code).

    Raises:
        CheckpointError: the index is refused or names something nxd_smp does not write.
    """
    try:
        return storage_index(target, dcp=form != FORMAT)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"the checkpoint at {target} is damaged or refused: {e}") from e


def read_entries(
    staging: Mapping[str, torch.Tensor], target: Path, verify: bool, index: Mapping[str, StoredTensor]
) -> None:
    """Read every ``staging`` tensor from the checkpoint at ``target`` (this process only;
    checked against its CRC-32 when ``verify``).

    Raises:
        CheckpointError: a missing, damaged or refused tensor, named.
    """
    missing = sorted(set(staging) - set(index))
    if missing:
        raise CheckpointError(f"the checkpoint at {target} lacks the tensors {missing[:8]}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else "") + ".")
    try:
        read_tensors(target, index, staging, verify=verify, threads=IO_THREADS)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"the checkpoint at {target} is damaged or refused: {e}") from e


# ---------------------------------------------------------------------------- small files
def small_files(meta: Mapping[str, Any], extra: Any, objects: Mapping[str, Any]) -> tuple[dict[str, bytes],
                                                                                         dict[str, torch.Tensor]]:
    """The metadata and the caller's state (``extra``, each stateful object's ``state_dict()``)
    as the bytes of their typed-JSON files, taken now (an asynchronous save writes what the state
    was at the call), and the tensors they refer to, copied, by their index keys.

    Raises:
        TypeError: a value that is not a JSON value or a tensor (``typed_json``), naming where.
    """
    tensors: dict[str, torch.Tensor] = {}

    def entry(tensor: torch.Tensor) -> str:
        key = f"{SMALL_PREFIX}{len(tensors)}"
        tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
        return key

    states = {name: obj.state_dict() for name, obj in objects.items()}
    files = {META_FILE: dumps(encode(meta, entry, what="the checkpoint's metadata")),
             EXTRA_FILE: dumps({"extra": encode(extra, entry, what="extra"),
                                "objects": {name: encode(state, entry, what=f"{name}.state_dict()")
                                            for name, state in states.items()}})}
    return files, tensors


def read_small_files(target: Path, record: Mapping[str, Any],
                     index: Mapping[str, StoredTensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's metadata (checked by ``check_meta``) and its caller's state as ``{"extra",
    "objects"}``: format 3's typed JSON (its bytes checked against the completion record, its
    tensors read from ``index``), formats 1 and 2's ``torch.save`` files through the strict reader
    (format 1 held the extra alone)."""
    form = record["format"]
    meta_file, extra_file = small_file_paths(target, form)
    if form == FORMAT:
        meta = _read_json(target, META_FILE, record, index)
    else:
        meta = load_file(meta_file, folder=target, name=META_FILE_V2)
    check_meta(meta, meta_file)
    if form == FORMAT:
        saved = _read_json(target, EXTRA_FILE, record, index)
    else:
        saved = load_file(extra_file, folder=target, name=EXTRA_FILE_V2)
        saved = {"extra": saved, "objects": {}} if form == FORMAT_V1 else saved
    if not isinstance(saved, dict) or set(saved) != {"extra", "objects"} or not isinstance(saved["objects"], dict) \
            or not all(isinstance(name, str) for name in saved["objects"]):
        raise CheckpointError(f"{extra_file} is damaged or crafted: not {{'extra': ..., 'objects': {{name: state}}}}.")
    return meta, saved


def small_file_paths(target: Path, form: str) -> tuple[Path, Path]:
    """Where a checkpoint of format ``form`` keeps its metadata and its caller's state."""
    return (target / META_FILE, target / EXTRA_FILE) if form == FORMAT else (target / META_FILE_V2,
                                                                           target / EXTRA_FILE_V2)


def _read_json(target: Path, name: str, record: Mapping[str, Any], index: Mapping[str, StoredTensor]) -> Any:
    """A format-3 small file: its bytes (those the completion record lists: size and CRC-32), decoded,
    each tensor it refers to read from its index entry."""
    path = target / name
    if name not in record["files"]:
        raise CheckpointError(f"{target / COMPLETE_FILE} does not list {name}; the checkpoint is damaged.")
    size, crc = record["files"][name]
    data = read_small(target, name, limit=min(size, JSON_LIMIT))
    if len(data) != size or zlib.crc32(data) != crc:
        raise CheckpointError(f"{path} is truncated, altered or corrupted (not the {size} bytes with the CRC-32 its "
                              f"completion record lists).")

    def tensor(key: str) -> torch.Tensor:
        stored = index.get(key) if key.startswith(SMALL_PREFIX) else None
        if stored is None:
            raise CheckpointError(f"{path} refers to the tensor {key!r}, which is not one of its entries.")
        value = torch.empty(stored.shape, dtype=stored.dtype)
        read_entries({key: value}, target, True, index)
        return value

    return decode(loads(data, str(path)), tensor, str(path))
