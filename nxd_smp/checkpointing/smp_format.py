"""nxd_smp's own checkpoint format (format 3): its files and keys, its metadata read into a typed
record, what one rank writes, and its reader into the neutral staged state.

A checkpoint is a version directory (named by a link: ``versions``) holding

* ``model/<state_dict key>``: the full model tensors (replicated: each written by one rank);
* ``optim/<param>/<state key>/<start>``: elements ``[start, end)`` of the flattened parameter's
  optimizer state (``exp_avg``, ``momentum_buffer``, ...), one entry per contiguous piece a rank
  owned; ``optim/<param>/<state key>`` for 0-dim state (``step``);
* ``master/<param>/<start>``: the same for fp32 master weights, when they are saved;
* ``loss_scaler/<key>``: the fp16 loss scaler's state;

as raw bytes (``storage``: a few files per rank, and the JSON index ``nxd_smp_index.json``), plus
``nxd_smp_meta.json`` (shapes, dtypes, param groups, which pieces exist, the DP size written at),
``extra.json`` (the caller's ``extra`` and the state dicts of the scheduler and other stateful
objects; their tensors are raw entries ``small/<n>``) and, written last, ``COMPLETE.json`` (size and
CRC-32 of every file). Every piece is addressed by parameter name and element range, so a checkpoint
written at DP size N loads at any DP size M. Nothing in it is a pickle: the small files are typed
JSON (``typed_json``). Formats 1 and 2 of the pre-release code are refused by name.

The reader (``read``) parses the metadata once into ``Meta`` (every field checked; nothing
downstream, the offline tools included, reads a field the parse did not check) and stages the pieces
this rank installs (``staged``).
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.nn as nn

from ..backend import Backend
from ..core.dtensors import local_shape, local_state_dict
from ..core.errors import CheckpointError
from ..core.layout import saved_pieces
from ..optim.loading.check import is_shape, is_size
from ..optim.loading.staged import (
    Pieces,
    Request,
    Staged,
    StagedModel,
    StagedObjects,
    StagedOptimizer,
    Whole,
    buffers_for,
    managed_param_names,
    overlaps,
    staging_slices,
    zero_unwritten,
)
from ..optim.param_groups import KERNEL_OPTIONS
from ..optim.state_fit import describe, is_moment
from ..zero1_optimizer import Zero1Optimizer
from .room import Room
from .storage import INDEX_FILE, IO_THREADS, JSON_LIMIT, StoredTensor, crc32_of, read_index, read_tensors
from .typed_json import decode, dtype_named, dumps, encode, loads
from .versions import COMPLETE_FILE

FORMAT = "nxd_smp.checkpoint/3"  # no pickle: raw tensors, a JSON index, typed JSON small files
_EARLIER = ("nxd_smp.checkpoint/1", "nxd_smp.checkpoint/2")  # the pre-release formats: refused by name
META_FILE = "nxd_smp_meta.json"
EXTRA_FILE = "extra.json"
SMALL_PREFIX = "small/"  # the index keys of the tensors in the small files (an RNG state, ...)
_COMPLETE_LIMIT = 256 << 20  # a file is ~60 bytes of the completion record


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


# ---------------------------------------------------------------------------- the metadata, typed
@dataclass(frozen=True)
class SavedParam:
    """A managed parameter as saved: its shape, dtype, the ``[start, end)`` pieces every rank held, and the
    optimizer state keys its bucket held (none: no state yet; the class's keys can differ by group, as
    ``amsgrad`` makes them)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[tuple[int, int], ...]
    keys: tuple[str, ...]


@dataclass(frozen=True)
class SavedOptimizer:
    """The optimizer's part of the metadata, every field checked by ``parse_meta``."""

    world_size: int
    mixed_precision: dict[str, bool]
    master_weights: bool
    params: dict[str, SavedParam]
    groups: tuple[tuple[dict[str, Any], tuple[str, ...]], ...]  # (hyperparameters, parameter names)
    tensor_keys: tuple[str, ...]
    scalar_keys: tuple[str, ...]
    inner_class: str
    loss_scaler: bool


@dataclass(frozen=True)
class Meta:
    """A checkpoint's metadata, every field checked (``parse_meta``)."""

    model: dict[str, tuple[tuple[int, ...], torch.dtype]]
    tensor_parallel: dict[str, Any] | None
    optimizer: SavedOptimizer | None


def parse_meta(value: Any, source: str) -> Meta:
    """The metadata ``value`` (decoded from ``source``) as a ``Meta``: every field of the type it has,
    every shape a tuple of sizes, every dtype a torch dtype's name, every parameter's pieces
    ``[start, end)`` tiling its elements exactly (so a reader allocates no more than the parameters
    hold), the groups naming each parameter once. Nothing else of ``value`` is kept.

    Raises:
        CheckpointError: naming ``source`` and the field.
    """
    def refuse(what: str) -> NoReturn:
        raise CheckpointError(f"{source} is damaged or crafted: {what}; refused.")

    def fields(mapping: Any, expected: set[str], optional: set[str], what: str) -> Mapping[str, Any]:
        if not isinstance(mapping, Mapping) or not expected <= set(mapping) <= expected | optional:
            refuse(f"{what} is not a dict of {sorted(expected)}")
        return mapping

    meta = fields(value, {"format", "model", "optimizer"}, {"tensor_parallel"}, "the metadata")
    if meta["format"] != FORMAT:
        refuse(f"format {describe(meta['format'])}")
    if not isinstance(meta["model"], Mapping):
        refuse("'model' is not a dict")
    model = {}
    for key, info in meta["model"].items():
        info = fields(info, {"shape", "dtype"}, set(), f"the model entry {key!r}")
        if not isinstance(key, str) or dtype_named(info["dtype"]) is None \
                or not is_shape(info["shape"], dtype_named(info["dtype"])):
            refuse(f"the model entry {key!r} is not {{'shape': sizes (below 2**63 bytes), 'dtype': a torch dtype}}")
        model[key] = (tuple(info["shape"]), dtype_named(info["dtype"]))
    tp = meta.get("tensor_parallel")
    if tp is not None:
        tp = fields(tp, {"size", "rank", "split"}, {"save"}, "'tensor_parallel'")
        if not (is_size(tp["size"]) and is_size(tp["rank"]) and tp["rank"] < tp["size"]
                and isinstance(tp["split"], Mapping) and all(
                    k in model and is_size(d) and d < len(model[k][0]) for k, d in tp["split"].items())
                and (tp.get("save") is None or isinstance(tp.get("save"), str) and len(tp["save"]) <= 64)):
            refuse("'tensor_parallel' is not {'size', 'rank' below it, 'split': {model key: one of its dimensions}, "
                   "'save': an id}")
        tp = {"size": tp["size"], "rank": tp["rank"], "split": dict(tp["split"]),
              **({"save": tp["save"]} if tp.get("save") is not None else {})}
    opt = meta["optimizer"]
    return Meta(model, tp, None if opt is None else _parse_optimizer(opt, model, refuse, fields))


def _parse_optimizer(opt: Any, model: Mapping[str, Any], refuse, fields) -> SavedOptimizer:
    opt = fields(opt, {"world_size", "mixed_precision", "master_weights", "params", "pieces", "groups", "tensor_keys",
                       "scalar_keys", "inner_class", "loss_scaler"}, set(), "'optimizer'")
    for field, kind in (("groups", list), ("params", Mapping), ("pieces", Mapping), ("tensor_keys", list),
                        ("scalar_keys", list), ("master_weights", bool), ("loss_scaler", bool), ("inner_class", str),
                        ("mixed_precision", Mapping)):
        if not isinstance(opt[field], kind):
            refuse(f"the optimizer's {field!r} is a {type(opt[field]).__name__}, not a {kind.__name__}")
    if not is_size(opt["world_size"]) or opt["world_size"] < 1:
        refuse(f"the optimizer's 'world_size' is {describe(opt['world_size'])}, not a positive int")
    if not all(isinstance(k, str) and isinstance(v, bool) for k, v in opt["mixed_precision"].items()):
        refuse("the optimizer's 'mixed_precision' is not {flag: bool}")
    keys = [*opt["tensor_keys"], *opt["scalar_keys"]]
    if not all(isinstance(k, str) and "/" not in k for k in keys) or len(set(keys)) != len(keys):
        refuse("the optimizer's state keys are not distinct names")
    if len(opt["inner_class"]) > 200:
        refuse("the optimizer's 'inner_class' is not a class name")
    params = {}
    for name, info in opt["params"].items():
        info = fields(info, {"shape", "dtype", "keys"}, set(), f"the optimizer's parameter {name!r}")
        if not isinstance(name, str) or dtype_named(info["dtype"]) is None \
                or not is_shape(info["shape"], torch.float64):  # (the widest state it may hold: fp64 moments)
            refuse(f"the optimizer's parameter {name!r} is not {{'shape': sizes (below 2**63 bytes), 'dtype': a torch "
                   f"dtype, 'keys': state keys}}")
        if not isinstance(info["keys"], list) or not all(isinstance(k, str) for k in info["keys"]) \
                or len(set(info["keys"])) != len(info["keys"]):
            refuse(f"the state keys of {name!r} are not a list of names, each once")
        unknown = sorted(set(info["keys"]) - set(keys))
        if unknown:
            refuse(f"the state keys {unknown} of {name!r} are neither of the optimizer's tensor keys "
                   f"{sorted(opt['tensor_keys'])} nor of its 0-dim keys {sorted(opt['scalar_keys'])}")
        shape = tuple(info["shape"])
        if name in model and model[name][0] != shape:
            refuse(f"the optimizer's parameter {name!r} has the shape {shape}, its model entry {model[name][0]}")
        numel = 1
        for d in info["shape"]:
            numel *= d
        pieces, end = opt["pieces"].get(name), 0
        if not isinstance(pieces, list):
            refuse(f"the pieces of {name!r} are not a list")
        for piece in pieces:
            if not (isinstance(piece, (tuple, list)) and len(piece) == 2 and is_shape(piece) and piece[0] == end
                    and piece[1] > piece[0]):
                refuse(f"the pieces of {name!r} do not tile its {numel} elements in order ({describe(piece)} after "
                       f"{end})")
            end = piece[1]
        if end != numel:
            refuse(f"the pieces of {name!r} cover [0, {end}) of its {numel} elements")
        params[name] = SavedParam(shape, dtype_named(info["dtype"]), tuple(map(tuple, pieces)), tuple(info["keys"]))
    if set(opt["pieces"]) != set(params):
        refuse("the optimizer's 'pieces' name other parameters than its 'params'")
    groups, seen = [], set()
    for i, group in enumerate(opt["groups"]):
        group = fields(group, {"hyper", "params"}, set(), f"param group {i}")
        if not isinstance(group["params"], list) or not all(isinstance(n, str) and n in params and n not in seen
                                                            and not seen.add(n) for n in group["params"]):
            refuse(f"param group {i} does not list the parameters by name, each once")
        if not isinstance(group["hyper"], Mapping) or not all(isinstance(k, str) for k in group["hyper"]):
            refuse(f"param group {i}'s hyperparameters are not a dict of names")
        groups.append((dict(group["hyper"]), tuple(group["params"])))
    if seen != set(params):
        refuse("the param groups do not list every parameter")
    return SavedOptimizer(opt["world_size"], dict(opt["mixed_precision"]), opt["master_weights"], params,
                          tuple(groups), tuple(opt["tensor_keys"]), tuple(opt["scalar_keys"]), opt["inner_class"],
                          opt["loss_scaler"])


# ---------------------------------------------------------------------------- the completion record
@dataclass(frozen=True)
class Completion:
    """A version's completion record: per file its size and CRC-32, and when it was saved."""

    files: dict[str, tuple[int, int]]
    saved_at_ns: int | None


def read_completion(version: Room) -> Completion:
    """The completion record of ``version``, checked to be one: its format, and per file a plain name
    with its size and CRC-32.

    Raises:
        CheckpointError: missing (the save did not complete), damaged, of another format, or refused.
    """
    source = str(version.where(COMPLETE_FILE))
    if not version.exists(COMPLETE_FILE):
        raise CheckpointError(f"{source} is missing: the checkpoint is incomplete (its save was cut off).")
    record = loads(version.read_bytes(COMPLETE_FILE, limit=_COMPLETE_LIMIT), source)
    found = record.get("format") if isinstance(record, dict) else record
    if found in _EARLIER:
        raise CheckpointError(f"{version.where()} is an nxd_smp checkpoint of format {found}, from before the first "
                              f"release; this nxd_smp reads {FORMAT} only (the earlier formats held pickles, and every "
                              f"reader of them is attack surface). Load it with the nxd_smp that wrote it and export "
                              f"it (export_torch, or consolidate), then import_torch here; or resume from a checkpoint "
                              f"this release saved.")
    if not isinstance(record, dict) or found != FORMAT or not set(record) <= {"format", "files", "saved_at_ns"}:
        raise CheckpointError(f"{version.where()} has format {describe(found)}; this nxd_smp reads {FORMAT}.")
    files = record.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and "/" not in name and not name.startswith(".") and isinstance(entry, list)
            and len(entry) == 2 and all(is_size(v) for v in entry) and entry[1] < 1 << 32
            for name, entry in files.items()):
        raise CheckpointError(f"{source} is damaged: its 'files' are not name -> [size, CRC-32].")
    saved_at = record.get("saved_at_ns")
    if saved_at is not None and not is_size(saved_at):
        raise CheckpointError(f"{source} is damaged: 'saved_at_ns' is {describe(saved_at)}.")
    return Completion({name: (size, crc) for name, (size, crc) in files.items()}, saved_at)


def verify_files(version: Room, completion: Completion, checksums: bool) -> None:
    """Every file the completion record lists is there, a regular file, with its size; with
    ``checksums`` also its CRC-32 (a second read of every byte: ``inspect --verify``; the loader checks
    the tensors it reads as it reads them)."""
    problems = []
    for name, (size, crc) in sorted(completion.files.items()):
        st = version.stat_file(name)
        if st is None:
            problems.append(f"{name} is missing")
        elif not st.regular:
            problems.append(f"{name} is not a regular file")
        elif st.size != size:
            problems.append(f"{name} is truncated or altered ({st.size} bytes, expected {size})")
        elif checksums and crc32_of(version, name) != crc:
            problems.append(f"{name} is corrupted (CRC-32 mismatch)")
    if problems:
        raise CheckpointError(f"the checkpoint at {version.where()} is damaged: " + "; ".join(problems) + ".")


def _listed_bytes(version: Room, completion: Completion, name: str, limit: int) -> bytes:
    """A small file's bytes, those the completion record lists (size and CRC-32)."""
    if name not in completion.files:
        raise CheckpointError(f"{version.where(COMPLETE_FILE)} does not list {name}; the checkpoint is damaged.")
    size, crc = completion.files[name]
    data = version.read_bytes(name, limit=min(size, limit))
    if len(data) != size or zlib.crc32(data) != crc:
        raise CheckpointError(f"{version.where(name)} is truncated, altered or corrupted (not the {size} bytes with the "
                              f"CRC-32 its completion record lists).")
    return data


@dataclass
class Opened:
    """A version folder opened and checked as far as every reader of it needs: its completion record,
    its index, its metadata and its small files (the caller's extra, the objects' states)."""

    version: Room
    completion: Completion
    index: dict[str, StoredTensor]
    meta: Meta
    extra: Any
    objects: dict[str, Any]


def open_version(version: Room, *, verify: bool = False) -> Opened:
    """Read and check everything of ``version`` but its tensors' bytes.

    Raises:
        CheckpointError: damaged, of another format, or refused; naming the file and field.
    """
    completion = read_completion(version)
    verify_files(version, completion, checksums=verify)
    index = read_index(version, data=_listed_bytes(version, completion, INDEX_FILE, JSON_LIMIT))

    def small(name: str) -> Any:
        source = str(version.where(name))

        def tensor(key: str) -> torch.Tensor:
            stored = index.get(key) if key.startswith(SMALL_PREFIX) else None
            if stored is None:
                raise CheckpointError(f"{source} refers to the tensor {key!r}, which is not one of its entries.")
            value = torch.empty(stored.shape, dtype=stored.dtype)
            read_tensors(version, index, {key: value})
            return value

        data = _listed_bytes(version, completion, name, JSON_LIMIT)
        return decode(loads(data, source), tensor, source, size=len(data))

    meta = parse_meta(small(META_FILE), str(version.where(META_FILE)))
    saved = small(EXTRA_FILE)
    if not isinstance(saved, dict) or set(saved) != {"extra", "objects"} or not isinstance(saved["objects"], dict) \
            or not all(isinstance(name, str) for name in saved["objects"]):
        raise CheckpointError(f"{version.where(EXTRA_FILE)} is damaged or crafted: not {{'extra': ..., 'objects': "
                              f"{{name: state}}}}.")
    _check_entries(meta, index, version)
    return Opened(version, completion, index, meta, saved["extra"], saved["objects"])


def expected_entries(meta: Meta) -> dict[str, tuple[int, ...]]:
    """Every tensor entry the metadata says the checkpoint holds, with its shape: the one enumeration of a
    checkpoint's keys that the reader and the offline tools both read by."""
    shapes = {model_key(key): shape for key, (shape, _) in meta.model.items()}
    opt = meta.optimizer
    if opt is not None:
        for name, param in opt.params.items():
            for start, end in param.pieces:
                shapes.update({state_key(name, key, start): (end - start,) for key in param.keys
                               if key in opt.tensor_keys})
                if opt.master_weights:
                    shapes[master_key(name, start)] = (end - start,)
            shapes.update({state_key(name, key): () for key in param.keys if key in opt.scalar_keys})
        if opt.loss_scaler:
            shapes.update({scaler_key(key): () for key in ("scale", "growth_tracker", "hysteresis_tracker")})
    return shapes


def _check_entries(meta: Meta, index: Mapping[str, StoredTensor], version: Room) -> None:
    """Every tensor the metadata says the checkpoint holds is in the index at that shape, so what is
    read is what the metadata accounts for."""
    problems = [f"{key} ({'missing' if key not in index else f'shape {index[key].shape}, expected {shape}'})"
                for key, shape in expected_entries(meta).items()
                if key not in index or tuple(index[key].shape) != tuple(shape)]
    if problems:
        raise CheckpointError(f"the checkpoint at {version.where()} does not hold what its metadata says: "
                              + "; ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8 else "")
                              + ".")


# ---------------------------------------------------------------------------- reading into the staged state
def read(opened: Opened, request: Request, *, verify: bool = True) -> Staged:
    """This rank's part of the checkpoint ``opened``, staged: the model entries the live model has, and
    for a live optimizer the pieces of each state tensor and master weight that its shards hold (read
    into shard-shaped staging buffers, so the install takes them without a copy), every parameter's
    0-dim state, the param groups' hyperparameters and the loss scaler's state. Tensors are checked
    against their CRC-32 as they are read (``verify``).

    Raises:
        CheckpointError: a tensor missing, damaged or refused, naming it.
    """
    meta, index, version = opened.meta, opened.index, opened.version
    model = StagedModel(dict(meta.model), {}, str(version.where(META_FILE)), meta.tensor_parallel, exact_dtypes=True)
    staged = Staged(source=str(version.where()), model=model,
                    objects=StagedObjects(dict(opened.objects), str(version.where(EXTRA_FILE))), extra=opened.extra)
    targets: dict[str, torch.Tensor] = {}
    wanted = request.model_keys if request.model_keys is not None else set()
    for key in sorted(set(meta.model) & wanted):
        shape, dtype = meta.model[key]
        model.entries[key] = targets[model_key(key)] = torch.empty(shape, dtype=dtype)
        staged.replicated[model_key(key)] = index[model_key(key)].crc32
    copies: list[tuple[torch.Tensor, str, int, int]] = []
    if request.optimizer is not None and meta.optimizer is not None:
        source = f"{version.where(META_FILE)} (its tensors in {INDEX_FILE})"
        staged.optimizer = _stage_optimizer(meta.optimizer, request, index, targets, copies, source)
    read_tensors(version, index, targets, verify=verify, threads=IO_THREADS)
    for view, entry, src, numel in copies:  # saved pieces that straddle this rank's ranges
        view.copy_(targets[entry][src:src + numel])
    return staged


def _stage_optimizer(opt: SavedOptimizer, request: Request, index: Mapping[str, StoredTensor],
                     targets: dict[str, torch.Tensor], copies: list, source: str) -> StagedOptimizer:
    want = request.optimizer
    names = want.names
    staged = StagedOptimizer(groups=[], state={}, masters=None, source=source)
    by_name = {name: hyper for hyper, group in opt.groups for name in group}
    # The live groups' hyperparameters from the saved group of each live group's first parameter; the
    # check refuses groups arranged otherwise (it compares ``arrangement`` with the live groups).
    staged.groups = [dict(by_name.get(group[0], {})) if group else {} for group in want.groups]
    staged.arrangement = [list(group) for _, group in opt.groups]
    masters_read = opt.master_weights and want.master_weights
    masters: dict[str, Pieces] = {}
    for name in names:
        saved = opt.params.get(name)
        if saved is None:
            continue
        entry: dict[str, Any] = {}
        kinds = [key for key in saved.keys if key in opt.tensor_keys] + ([None] if masters_read else [])
        for key in kinds:
            views = staging_slices(staged.staging, key, want, name)
            pieces = Pieces(saved.shape, index[_entry(name, key, saved.pieces[0][0])].dtype if saved.pieces else
                            saved.dtype, views)
            for start, view in views.items():
                for part in overlaps(saved.pieces, start, start + view.numel()):
                    entry_key = _entry(name, key, part.saved_start)
                    if part.whole:
                        targets[entry_key] = view[part.dst:part.dst + part.numel]
                    else:
                        if entry_key not in targets:
                            targets[entry_key] = torch.empty(part.saved_end - part.saved_start,
                                                             dtype=index[entry_key].dtype)
                        copies.append((view[part.dst:part.dst + part.numel], entry_key, part.src, part.numel))
            if key is None:
                masters[name] = pieces
            else:
                entry[key] = pieces
        for key in saved.keys:
            if key in opt.scalar_keys:
                scalar = state_key(name, key)
                targets[scalar] = torch.empty((), dtype=index[scalar].dtype)
                entry[key] = Whole(targets[scalar])
        staged.state[name] = entry
    if masters_read:
        staged.masters = masters
    if opt.loss_scaler and want.scaler_keys:
        staged.scaler = {}
        for key in want.scaler_keys:
            if scaler_key(key) in index:
                staged.scaler[key] = targets[scaler_key(key)] = torch.empty((), dtype=index[scaler_key(key)].dtype)
    for key in {*opt.tensor_keys, *([None] if masters_read else [])}:  # the buffers the pieces went into
        buffers_for(staged.staging, key, want)
    zero_unwritten(staged.staging, [*targets.values(), *(view for view, *_ in copies)])
    return staged


def _entry(name: str, key: str | None, start: int) -> str:
    return master_key(name, start) if key is None else state_key(name, key, start)


# ---------------------------------------------------------------------------- what one rank writes
def model_keys_of(rank: int, world_size: int, model_state: Mapping[str, torch.Tensor]) -> list[str]:
    """The model tensors ``rank`` writes: each one by one rank (they are replicated), the largest first to
    the rank with the fewest bytes so far, the same split on every rank."""
    load = [0] * world_size
    mine = []
    for key in sorted(model_state, key=lambda k: (-model_state[k].numel() * model_state[k].element_size(), k)):
        r = load.index(min(load))
        load[r] += model_state[key].numel() * model_state[key].element_size()
        if r == rank:
            mine.append(key)
    return mine


#: How the inner optimizer computes, not what: chosen per device by whoever loads.
_IMPLEMENTATION_KEYS = frozenset({"params", *KERNEL_OPTIONS})


def group_records(optimizer: Zero1Optimizer, names: list[str]) -> list[dict[str, Any]]:
    """Per param group: its hyperparameters (lr, betas, ... but not kernel choices such as ``fused``,
    which belong to the device that loads) and its parameters' names."""
    index = {id(p): i for i, p in enumerate(optimizer.managed_params)}
    return [{"hyper": {k: v for k, v in group.items() if k not in _IMPLEMENTATION_KEYS},
             "params": [names[index[id(p)]] for p in group["params"]]} for group in optimizer.param_groups]


def entries_to_save(model: nn.Module, optimizer: Zero1Optimizer | None, with_masters: bool, backend: Backend,
                    tensor_parallel: dict[str, Any] | None) -> tuple[dict[str, torch.Tensor], dict[str, Any], bool]:
    """This rank's tensors of the checkpoint (on the host), the metadata, and whether the tensors are
    copies (False: some are the live ones, which an asynchronous save stages)."""
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
    if tensor_parallel is not None:
        meta["tensor_parallel"] = tensor_parallel
    if optimizer is None:
        return state, meta, copied

    optimizer.adopt_param_changes()  # weights changed in place since the last step are the truth
    names = managed_param_names(model, optimizer)
    held = optimizer.rank_state
    inner = held.inner_optimizer
    layouts, shards = held.bucket_layouts, held.inner_shards
    tensor_keys: set[str] = set()
    scalar_keys: set[str] = set()
    for layout, shard in zip(layouts, shards):
        for key, value in inner.state.get(shard, {}).items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"inner optimizer state '{key}' is not a tensor; it cannot be sharded.")
            if not is_moment(key, value):
                scalar_keys.add(key)
            elif tuple(value.shape) == (layout.shard_numel,):
                tensor_keys.add(key)
            else:
                raise CheckpointError(f"inner optimizer state '{key}' has shape {tuple(value.shape)}, neither a scalar "
                                      f"nor the shard's ({layout.shard_numel},); it cannot be resharded.")
    # Whole shards to the host at once (one transfer each on XLA), cut into each parameter's state there.
    live = [(b, key, value) for b, shard in enumerate(shards) for key, value in inner.state.get(shard, {}).items()]
    live += [(b, None, master) for b, master in enumerate(optimizer.master_shards)] if with_masters else []
    # each parameter's own counters, where they are not its bucket's (``optim.step_counters``)
    own = [(i, key, value) for i in range(len(names)) for key, value in (held.param_counters(i) or {}).items()
           if isinstance(value, torch.Tensor)]
    host, copied_shards = backend.to_host([value for _, _, value in live] + [value for _, _, value in own])
    buckets: list[dict[str, torch.Tensor]] = [{} for _ in shards]
    masters: list[torch.Tensor] = []
    for (b, key, _), value in zip(live, host):
        if key is None:
            masters.append(value)
        else:
            buckets[b][key] = value
    counters: list[dict[str, torch.Tensor] | None] = [None] * len(names)
    for (i, key, _), value in zip(own, host[len(live):]):
        counters[i] = counters[i] or {}
        counters[i][key] = value
    states = held.param_states(buckets, masters if with_masters else None, counters)
    for name, p, param in zip(names, held.managed_params, states):
        if param.piece is not None:
            start = param.piece.param_start
            state.update({state_key(name, key, start): value for key, value in param.moments.items()})
            if param.master is not None:
                state[master_key(name, start)] = param.master
        elif math.prod(local_shape(p)) or optimizer.rank != 0:
            continue  # (a parameter, or DTensor part, of no elements is no rank's piece: its counters from rank 0)
        state.update({state_key(name, key): value for key, value in param.counters.items()})
    bucket_keys = {names[i]: sorted(key for key in inner.state.get(shard, {}))
                   for layout, shard in zip(layouts, shards) for i in layout.param_indices}
    scaler = optimizer.loss_scaler
    if scaler is not None:
        scaler_state = scaler.state_dict()
        values, copied_scaler = backend.to_host(list(scaler_state.values()))
        copied_shards = copied_shards and copied_scaler
        state.update({scaler_key(key): value for key, value in zip(scaler_state, values)})
    meta["optimizer"] = {
        "world_size": optimizer.world_size,
        "mixed_precision": optimizer.mixed_precision.to_dict(),
        "master_weights": with_masters,
        "params": {name: {"shape": tuple(local_shape(p)), "dtype": str(backend.device_dtype(p.dtype)),
                          "keys": bucket_keys[name]} for name, p in zip(names, optimizer.managed_params)},
        "pieces": saved_pieces(layouts, optimizer.world_size, names),
        "groups": group_records(optimizer, names),
        "tensor_keys": sorted(tensor_keys),
        "scalar_keys": sorted(scalar_keys),
        "inner_class": type(inner).__name__,
        "loss_scaler": scaler is not None,
    }
    return state, meta, copied and copied_shards


def small_files(meta: Mapping[str, Any], extra: Any, objects: Mapping[str, Any]
                ) -> tuple[dict[str, bytes], dict[str, torch.Tensor]]:
    """The metadata and the caller's state (``extra``, each stateful object's ``state_dict()``) as the
    bytes of their typed-JSON files, taken now (an asynchronous save writes what the state was at the
    call), and the tensors they refer to, copied, by their index keys.

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


def completion_bytes(files: Mapping[str, list[int]]) -> bytes:
    """The completion record listing ``files`` (name -> [size, CRC-32]), as written last."""
    return dumps({"format": FORMAT, "files": dict(files), "saved_at_ns": time.time_ns()})

