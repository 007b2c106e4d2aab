"""The offline tools: what a checkpoint holds, every tensor of it whole, and one plain file.

They read files and never communicate, whatever process group exists: one rank can call
them while the others wait at a barrier (torch's ``dcp.load`` would join a collective over
the default group). Nothing they read runs code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.errors import CheckpointError
from .format import (
    FORMAT_V1,
    completion_record,
    master_key,
    model_key,
    read_entries,
    read_index,
    read_small_files,
    state_key,
    torch_optim_groups,
    verify_files,
)
from .links import resolve
from .outputs import check_target, write_file


def inspect_checkpoint(path: str | os.PathLike, *, verify: bool = False) -> dict[str, Any]:
    """What a checkpoint holds: per tensor its shape, dtype and bytes; master weights or
    not; the DP size it was written at; the saved stateful objects; total bytes on disk.
    ``verify``: also check the size and CRC-32 of every file (CheckpointError if damaged)."""
    target = resolve(Path(path))
    record = completion_record(target)
    verify_files(target, record, checksums=verify)
    index = read_index(target, record["format"])
    meta, saved = read_small_files(target, record, index)
    tensors = {key: {"shape": info.shape, "dtype": str(info.dtype), "bytes": info.nbytes}
               for key, info in sorted(index.items())}
    opt = meta["optimizer"]
    return {
        "path": str(target),
        "format": record["format"],
        "saved_at_ns": record.get("saved_at_ns"),
        "stateful": sorted(saved["objects"]),
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
    parameter (or 0-dim)}}, "master_weights": {name: fp32 tensor} or None, "inner_class": the
    torch.optim class's name}, "extra",
    "stateful": {name: state dict}, "tensor_parallel": None, or for a DTensor model the TP coordinate
    that saved it and the dimension each split tensor is cut on (``core.dtensors.tensor_parallel_layout``)}."""
    target = resolve(Path(path))
    record = completion_record(target)
    verify_files(target, record, checksums=record["format"] == FORMAT_V1)
    index = read_index(target, record["format"])
    meta, saved = read_small_files(target, record, index)
    staging = {key: torch.empty(shape, dtype=index[key].dtype) for key, shape in _entries(meta, index, target).items()}
    read_entries(staging, target, verify=True, index=index)
    result: dict[str, Any] = {
        "model": {key: staging[model_key(key)] for key in meta["model"]},
        "optimizer": None,
        "extra": saved["extra"],
        "stateful": saved["objects"],
        "tensor_parallel": meta.get("tensor_parallel"),
    }
    opt = meta["optimizer"]
    if opt is None:
        return result

    def whole(key_of, name: str, shape) -> torch.Tensor:
        """A parameter's tensor from its saved pieces, in order (``key_of(start)``: their keys)."""
        return torch.cat([staging[key_of(start)] for start, _ in opt["pieces"][name]]).view(shape)

    state = {}
    for name, info in opt["params"].items():
        shape = tuple(info["shape"])
        entry = {key: whole(lambda start, k=key: state_key(name, k, start), name, shape) for key in opt["tensor_keys"]}
        entry.update({key: staging[state_key(name, key)] for key in opt["scalar_keys"]})
        state[name] = entry
    result["optimizer"] = {
        "inner_class": opt["inner_class"],
        "groups": opt["groups"],
        "state": state,
        "master_weights": {
            name: whole(lambda start, n=name: master_key(n, start), name, tuple(info["shape"]))
            for name, info in opt["params"].items()
        } if opt["master_weights"] else None,
    }
    return result


def _entries(meta: dict[str, Any], index: dict[str, Any], target: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor the metadata says the checkpoint holds, with its shape, each checked to be in
    the index at that shape (so what is read is what the metadata accounts for)."""
    shapes = {model_key(key): tuple(info["shape"]) for key, info in meta["model"].items()}
    opt = meta["optimizer"]
    if opt is not None:
        for name, pieces in opt["pieces"].items():
            for start, end in pieces:
                shapes.update({state_key(name, key, start): (end - start,) for key in opt["tensor_keys"]})
                if opt["master_weights"]:
                    shapes[master_key(name, start)] = (end - start,)
            if pieces:
                shapes.update({state_key(name, key): () for key in opt["scalar_keys"]})
    problems = [f"{key} ({'missing' if key not in index else f'shape {index[key].shape}, expected {shape}'})"
                for key, shape in shapes.items() if key not in index or tuple(index[key].shape) != shape]
    if problems:
        raise CheckpointError(f"the checkpoint at {target} does not hold what its metadata says: "
                              + "; ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8 else "")
                              + ".")
    return shapes


def read_whole_checkpoint(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> dict[str, Any]:
    """``read_checkpoint`` of one checkpoint, or of the checkpoints of every tensor-parallel coordinate of a
    DTensor model (in rank order) joined into the whole model's: split tensors (model entries, masters, state
    shaped like the parameter) concatenated on their dimension, the rest taken from rank 0 (replicated: the
    same). What the exports and ``consolidate`` read.

    Raises:
        CheckpointError: one coordinate's checkpoint alone, or parts that are not every coordinate of one
            save (their layouts, param groups or state keys differ).
    """
    many = not isinstance(paths, (str, os.PathLike))
    parts = [read_checkpoint(p) for p in (paths if many else [paths])]
    layouts = [part["tensor_parallel"] for part in parts]
    if not many or len(parts) == 1:
        tp = layouts[0]
        if tp is not None and tp["size"] > 1:
            raise CheckpointError(
                f"{paths if not many else paths[0]} holds tensor-parallel rank {tp['rank']} of {tp['size']} of a DTensor "
                f"model; pass the checkpoints of all {tp['size']} coordinates, in rank order, to export the whole model.")
        return parts[0]
    wanted = [{"size": len(parts), "rank": r, "split": layouts[0]["split"] if layouts[0] else None}
              for r in range(len(parts))]
    if layouts != wanted:
        raise CheckpointError(
            f"the {len(parts)} checkpoints are not tensor-parallel ranks 0..{len(parts) - 1} of one DTensor model "
            f"(their layouts: {layouts}); pass each coordinate's checkpoint once, in rank order.")
    if any((p["optimizer"] is None) != (parts[0]["optimizer"] is None) for p in parts) or (
            parts[0]["optimizer"] is not None and any(
                p["optimizer"]["groups"] != parts[0]["optimizer"]["groups"]
                or {n: sorted(e) for n, e in p["optimizer"]["state"].items()}
                != {n: sorted(e) for n, e in parts[0]["optimizer"]["state"].items()}
                or (p["optimizer"]["master_weights"] is None) != (parts[0]["optimizer"]["master_weights"] is None)
                for p in parts)):
        raise CheckpointError(f"the {len(parts)} checkpoints hold different optimizer states (param groups, state "
                              f"keys or master weights): pass the coordinates' checkpoints of one save.")
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
            "state": {name: {key: join(name, [p["optimizer"]["state"][name][key] for p in parts]) for key in entry}
                      for name, entry in opt["state"].items()},
            "master_weights": None if masters is None else {
                name: join(name, [p["optimizer"]["master_weights"][name] for p in parts]) for name in masters},
        }
    return whole


def consolidate(path: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> None:
    """Write one plain ``torch.save`` file ``out``: ``{"model": state_dict, "optimizer":
    torch.optim-style state dict (param ids in the saved group order; each group also lists
    its ``param_names``), "master_weights": {name: fp32 tensor} or None, "extra": ...,
    "stateful": {name: state dict} (the scheduler's under "scheduler")}``. Runs in one process.

    Written into a fresh staging file beside ``out`` and moved into place once complete. An
    existing ``out`` (a file, or a link, dangling or not) is refused, checked before the
    checkpoint is read, unless ``overwrite=True``: then it is replaced (a link itself, never
    what it points to). A directory at ``out`` is refused either way.

    Raises:
        CheckpointError: ``out`` is taken (see above); the checkpoint is damaged.
        TypeError: ``out`` is not a path or ``overwrite`` not a bool.
    """
    out = check_target(out, overwrite=overwrite, directory=False)
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
    write_file(out, lambda f: torch.save(result, f), overwrite=overwrite)
