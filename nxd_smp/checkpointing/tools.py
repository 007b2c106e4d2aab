"""The offline tools: what a checkpoint holds, every tensor of it whole, the tensor-parallel
coordinates of one save joined, and one plain file.

They read through the same reader as a load (``smp_format.open_version``: the completion record, the
index, the metadata parsed into a checked ``Meta``, the small files) and use nothing of the files that
reader did not check. They never communicate, whatever process group exists: one rank can call them
while the others wait at a barrier (torch's ``dcp.load`` would join a collective over the default
group). Nothing they read runs code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..core.errors import CheckpointError
from .files import check_output, write_output_file
from .locations import location_of, open_store
from .smp_format import FORMAT, Opened, expected_entries, master_key, model_key, open_version, state_key
from .storage import read_tensors


@contextmanager
def opened(path: str | os.PathLike, *, verify: bool = False) -> Iterator[Opened]:
    """The complete checkpoint ``path`` means (a link, a version, a directory of them), opened and read
    but for its tensors (``smp_format.open_version``), in this process only.

    Raises:
        ConfigError: ``path`` is a URL of another scheme than ``s3`` (``locations.location_of``).
    """
    path = location_of(path, "the checkpoint path")
    with open_store(path.parent) as store, store.open_located(store.locate(path.name)) as version:
        yield open_version(version, verify=verify)


def inspect_checkpoint(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """What a checkpoint holds: per tensor its shape, dtype and bytes; master weights or not; the DP size
    it was written at; the saved stateful objects; the bytes of its regular files (links neither counted
    nor followed). ``verify``: also check the size and CRC-32 of every file (CheckpointError if damaged).

    Raises:
        ConfigError: ``path`` is a URL: object storage is not supported yet.
    """
    with opened(path, verify=verify) as found:
        meta, opt = found.meta, found.meta.optimizer
        return {
            "path": str(found.version.where()),
            "format": FORMAT,
            "saved_at_ns": found.completion.saved_at_ns,
            "stateful": sorted(found.objects),
            "model": {key: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
                      for key, (shape, dtype) in meta.model.items()},
            "optimizer": None if opt is None else {
                "dp_size_written_at": opt.world_size,
                "master_weights": opt.master_weights,
                "mixed_precision": opt.mixed_precision,
                "state_keys": [*opt.tensor_keys, *opt.scalar_keys],
                "inner_class": opt.inner_class,
                "groups": [{"params": list(names), **hyper} for hyper, names in opt.groups],
            },
            "tensors": {key: {"shape": stored.shape, "dtype": str(stored.dtype), "bytes": stored.nbytes}
                        for key, stored in sorted(found.index.items())},
            "bytes_on_disk": found.version.tree_size(),
        }


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of a checkpoint, whole: ``{"model": state_dict, "optimizer": None or {"groups":
    [{"hyper", "params": names}], "state": {name: {key: tensor shaped like the parameter (or 0-dim)}},
    "master_weights": {name: fp32 tensor} or None, "inner_class": the torch.optim class's name}, "extra",
    "stateful": {name: state dict}, "tensor_parallel": None, or for a DTensor model the coordinate that
    saved it, the dimension each split tensor is cut on and the save's id}``.

    Raises:
        ConfigError: ``path`` is a URL: object storage is not supported yet.
    """
    with opened(path) as found:
        meta, index, opt = found.meta, found.index, found.meta.optimizer
        staging = {key: torch.empty(shape, dtype=index[key].dtype) for key, shape in expected_entries(meta).items()}
        read_tensors(found.version, index, staging)
        result: dict[str, Any] = {"model": {key: staging[model_key(key)] for key in meta.model}, "optimizer": None,
                                  "extra": found.extra, "stateful": found.objects,
                                  "tensor_parallel": meta.tensor_parallel}
        if opt is None:
            return result

        def whole(key_of, name: str) -> torch.Tensor:
            """A parameter's tensor from its saved pieces, in order (``key_of(start)``: their keys)."""
            param = opt.params[name]
            if not param.pieces:
                return torch.empty(param.shape, dtype=param.dtype)
            return torch.cat([staging[key_of(start)] for start, _ in param.pieces]).view(param.shape)

        state = {}
        for name, param in opt.params.items():
            state[name] = {key: whole(lambda start, k=key: state_key(name, k, start), name) if key in opt.tensor_keys
                           else staging[state_key(name, key)] for key in param.keys}
        result["optimizer"] = {
            "inner_class": opt.inner_class,
            "groups": [{"hyper": dict(hyper), "params": list(names)} for hyper, names in opt.groups],
            "shapes": {name: param.shape for name, param in opt.params.items()},
            "state": state,
            "master_weights": {name: whole(lambda start, n=name: master_key(n, start), name) for name in opt.params}
            if opt.master_weights else None,
        }
        return result


def read_whole_checkpoint(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> dict[str, Any]:
    """``read_checkpoint`` of one checkpoint, or of the checkpoints of every tensor-parallel coordinate of
    one save of a DTensor model (in rank order) joined into the whole model's: split tensors (model
    entries, masters, state shaped like the parameter) concatenated on their dimension, the rest taken
    from rank 0 (replicated: the same). What the exports and ``consolidate`` read.

    Raises:
        ConfigError: a path is a URL of another scheme than ``s3`` (checked for every path before any is read).
        CheckpointError: one coordinate's checkpoint alone; parts of different saves (their save ids
            differ), not each coordinate once in order, or whose entries do not join (other names, groups,
            state keys, or shapes that differ off the split dimension); each named.
    """
    many = not isinstance(paths, (str, os.PathLike))
    names = [str(location_of(p, "the checkpoint path")) for p in (paths if many else [paths])]
    parts = [read_checkpoint(p) for p in names]
    layouts = [part["tensor_parallel"] for part in parts]
    if len(parts) == 1:
        tp = layouts[0]
        if tp is not None and tp["size"] > 1:
            raise CheckpointError(
                f"{names[0]} holds tensor-parallel rank {tp['rank']} of {tp['size']} of a DTensor model; pass the "
                f"checkpoints of all {tp['size']} coordinates, in rank order, to export the whole model.")
        return parts[0]
    _check_parts(names, parts)
    split = layouts[0]["split"]

    def join(key: str, values: list[Any]) -> Any:
        if key in split and isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
            return torch.cat(values, dim=split[key])
        return values[0]

    whole = {**parts[0], "tensor_parallel": None,
             "model": {key: join(key, [p["model"][key] for p in parts]) for key in parts[0]["model"]}}
    opt = parts[0]["optimizer"]
    if opt is not None:
        masters = opt["master_weights"]
        whole["optimizer"] = {
            **opt,
            "shapes": {name: tuple(sum(p["optimizer"]["shapes"][name][d] for p in parts) if d == split.get(name) else n
                                   for d, n in enumerate(shape)) for name, shape in opt["shapes"].items()},
            "state": {name: {key: join(name, [p["optimizer"]["state"][name][key] for p in parts]) for key in entry}
                      for name, entry in opt["state"].items()},
            "master_weights": None if masters is None else {
                name: join(name, [p["optimizer"]["master_weights"][name] for p in parts]) for name in masters},
        }
    return whole


def _check_parts(names: list[str], parts: list[dict[str, Any]]) -> None:
    """The parts are the tensor-parallel coordinates 0..n-1 of one save, in order, and every entry joins.

    Raises:
        CheckpointError: naming the parts and the entries that do not.
    """
    n = len(parts)
    layouts = [part["tensor_parallel"] for part in parts]
    if any(tp is None for tp in layouts):
        plain = [name for name, tp in zip(names, layouts) if tp is None]
        raise CheckpointError(f"{plain} hold no tensor-parallel coordinate (a model without DTensors); join only the "
                              f"checkpoints of every coordinate of one DTensor model's save.")
    saves = {tp.get("save") for tp in layouts}
    if len(saves) != 1 or None in saves:
        ids = ", ".join(f"{name}: save {tp.get('save')}" for name, tp in zip(names, layouts))
        raise CheckpointError(f"the {n} checkpoints are parts of different saves ({ids}); pass every coordinate's "
                              f"checkpoint of one save.")
    wrong = [f"{name} is rank {tp['rank']} of {tp['size']}" for r, (name, tp) in enumerate(zip(names, layouts))
             if tp["rank"] != r or tp["size"] != n]
    if wrong:
        raise CheckpointError(f"the {n} checkpoints are not tensor-parallel ranks 0..{n - 1} of one model in rank "
                              f"order ({'; '.join(wrong)}); pass each coordinate's checkpoint once, in rank order.")
    split = layouts[0]["split"]
    if any(tp["split"] != split for tp in layouts):
        raise CheckpointError(f"the {n} checkpoints split their tensors differently: {[tp['split'] for tp in layouts]}.")
    problems: list[str] = []
    first = parts[0]
    for r, (name, part) in enumerate(zip(names, parts)):
        if set(part["model"]) != set(first["model"]):
            problems.append(f"{name} holds the model entries {sorted(set(part['model']) ^ set(first['model']))[:8]} that "
                            f"{names[0]} does not (or the other way round)")
            continue
        problems += [f"{name}: {p}" for key in first["model"]
                     if (p := _joins(key, part["model"][key], first["model"][key], split))]
        opt, opt0 = part["optimizer"], first["optimizer"]
        if (opt is None) != (opt0 is None):
            problems.append(f"{name} {'holds no' if opt is None else 'holds an'} optimizer state, {names[0]} "
                            f"{'does' if opt is None else 'does not'}")
        elif opt is not None:
            if opt["groups"] != opt0["groups"]:
                problems.append(f"{name}: its param groups differ from {names[0]}'s")
            elif {k: sorted(e) for k, e in opt["state"].items()} != {k: sorted(e) for k, e in opt0["state"].items()}:
                problems.append(f"{name}: its optimizer state keys differ from {names[0]}'s")
            elif (opt["master_weights"] is None) != (opt0["master_weights"] is None):
                problems.append(f"{name}: {'no' if opt['master_weights'] is None else ''} master weights, unlike "
                                f"{names[0]}")
            else:
                problems += [f"{name}: {p}" for param, entry in opt0["state"].items() for key in entry
                             if (p := _joins(param, opt["state"][param][key], entry[key], split, key))]
    if problems:
        raise CheckpointError(f"the {n} checkpoints do not join into one model: " + "; ".join(problems[:8])
                              + (f" and {len(problems) - 8} more" if len(problems) > 8 else "") + ".")


def _joins(key: str, value: Any, first: Any, split: dict[str, int], part: str = "") -> str | None:
    """Why ``value`` (a coordinate's tensor of ``key``) does not join with rank 0's ``first``, or None."""
    what = f"{key}{'/' + part if part else ''}"
    if not isinstance(value, torch.Tensor) or not isinstance(first, torch.Tensor):
        return None
    if value.dtype != first.dtype or value.dim() != first.dim():
        return f"{what} is {value.dtype} of {value.dim()} dimensions, rank 0's {first.dtype} of {first.dim()}"
    dim = split.get(key) if value.dim() > 0 else None
    if dim is not None and dim >= value.dim():
        return f"{what} has {value.dim()} dimensions, and the split names its dimension {dim}"
    other = [d for d in range(value.dim()) if d != dim]
    if any(value.shape[d] != first.shape[d] for d in other):
        return (f"{what} has shape {tuple(value.shape)}, rank 0's {tuple(first.shape)}: they differ off the split "
                f"dimension {dim}")
    return None


def consolidate(path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Write one plain ``torch.save`` file ``out``: ``{"model": state_dict, "optimizer": torch.optim-style
    state dict (param ids in the saved group order; each group also lists its ``param_names``),
    "master_weights": {name: fp32 tensor} or None, "extra": ..., "stateful": {name: state dict} (the
    scheduler's under "scheduler")}``. Runs in one process.

    Written into a new file beside ``out`` and moved into place once complete (``files.write_output_file``).
    An existing ``out`` (a file, or a link, dangling or not) is refused, checked before the checkpoint is
    read, unless ``overwrite=True``: then it is replaced (a link itself, never what it points to). A
    directory at ``out`` is refused either way.

    Raises:
        ConfigError: ``path`` or ``out`` is a URL: object storage is not supported yet.
        CheckpointError: ``out`` is taken (see above); the checkpoint is damaged.
        TypeError: ``out`` is not a path or ``overwrite`` not a bool.
    """
    out = check_output(out, overwrite=overwrite, directory=False)
    full = read_whole_checkpoint(path)
    result = {"model": full["model"], "optimizer": None, "master_weights": None, "extra": full["extra"],
              "stateful": full["stateful"]}
    opt = full["optimizer"]
    if opt is not None:
        groups = torch_optim_groups(opt["groups"])
        names = [name for g in groups for name in g["param_names"]]
        state = {i: opt["state"][name] for i, name in enumerate(names) if opt["state"][name]}
        result["optimizer"] = {"state": state, "param_groups": groups}
        result["master_weights"] = opt["master_weights"]
    write_output_file(out, lambda f: torch.save(result, f), overwrite=overwrite)


def torch_optim_groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Group records (``{"hyper", "params": names}``) as torch.optim state dicts write param groups: the
    hyperparameters, consecutive integer ``params``, and the names beside them."""
    out, start = [], 0
    for g in groups:
        out.append({**g["hyper"], "params": list(range(start, start + len(g["params"]))),
                    "param_names": list(g["params"])})
        start += len(g["params"])
    return out
