"""torch_xla's and NxD's per-rank ZeRO-1 optimizer state dicts, to and from nxd_smp.

torch_xla's ``ZeroRedundancyOptimizer`` (and NxD's ``NeuronZero1Optimizer`` on top of it)
shards every parameter on its own: dim 0 padded to a multiple of the DP size, chunk ``rank``
kept. One file per DP rank holds ``param_groups``, ``base_state`` (``{param id: {step,
exp_avg, ...}}`` of padded chunks), ``shape_info`` and, if saved, ``sharded_master_weights``.

* ``export_xla(checkpoint, out_dir, dp_size)`` writes those files from an nxd_smp
  checkpoint (``optim/dp_rank_XX_tp_rank_00_pp_rank_00.pt`` names, as NxD writes them);
* ``import_xla(files, model=, optimizer=)`` loads them into a ``Zero1Optimizer`` at its own
  DP size.

Both go through nxd_smp's checkpointing: the export through the offline tools' reader
(``read_checkpoint``), the import through the one load pipeline (its files read by the strict reader
into whole per-parameter state, then the check, the ranks' agreement and the install).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..checkpoint import check_args
from ..checkpointing.files import Folder, check_output, local_path, write_output_directory
from ..checkpointing.reader import check_distinct, load_file
from ..checkpointing.tools import read_checkpoint
from ..core.errors import CheckpointError, ConfigError
from ..optim.loading.check import is_shape
from ..optim.loading.run import full_state, run
from ..optim.loading.staged import Request, Staged, Targets
from ..optim.param_groups import index_groups
from ..optim.state_fit import is_moment, numbered_names, torch_group_problems
from ..zero1_optimizer import Zero1Optimizer

__all__ = ["export_xla", "import_xla"]


def _xla_chunk(tensor: torch.Tensor, dp_size: int, rank: int) -> torch.Tensor:
    """torch_xla's shard: pad dim 0 to a multiple of ``dp_size``, keep chunk ``rank``."""
    remainder = tensor.shape[0] % dp_size
    if remainder:
        pad = torch.zeros((dp_size - remainder, *tensor.shape[1:]), dtype=tensor.dtype)
        tensor = torch.cat([tensor, pad])
    return tensor.chunk(dp_size)[rank].clone()


def export_xla(path: str | os.PathLike, out_dir: str | os.PathLike, dp_size: int, *,
               overwrite: bool = False) -> list[Path]:
    """Write the optimizer state in torch_xla's / NxD's ZeRO-1 layout for ``dp_size``
    ranks: ``out_dir/dp_rank_XX_tp_rank_00_pp_rank_00.pt`` holding ``state``,
    ``param_groups``, ``base_state`` (padded dim-0 shards), ``shape_info`` and, if the
    checkpoint has them, ``sharded_master_weights``. Load each file with
    ``ZeroRedundancyOptimizer.load_state_dict`` over the same parameters in the same order.

    The files are written into a fresh staging directory beside ``out_dir``, moved into place
    once all are complete. ``out_dir`` must be absent or an empty directory (checked before the
    checkpoint is read); with ``overwrite=True`` whatever is there (a directory, a file or a
    link, never followed) is replaced as a whole.

    Returns:
        The files written, in rank order.

    Raises:
        ValueError: ``dp_size`` is not a positive int.
        ConfigError: ``path`` or ``out_dir`` is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: ``out_dir`` is taken (see above); the checkpoint holds no optimizer
            state, or 0-dim parameters (torch_xla cannot shard them); it is damaged.
    """
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ConfigError(f"dp_size must be a positive int, got {dp_size!r}.")
    out = check_output(out_dir, overwrite=overwrite, directory=True)
    full = read_checkpoint(path)
    opt = full["optimizer"]
    if opt is None:
        raise CheckpointError(f"{path} holds no optimizer state to export.")
    names = [name for g in opt["groups"] for name in g["params"]]
    shapes = opt["shapes"]
    zero_dim = [name for name in names if len(shapes[name]) == 0]
    if zero_dim:
        raise CheckpointError(
            f"torch_xla's ZeRO-1 shards every parameter along dim 0 and cannot hold the 0-dim "
            f"parameters {zero_dim}; reshape them to (1,) in the model to export."
        )
    ids = index_groups([len(g["params"]) for g in opt["groups"]])
    groups = [{**g["hyper"], "params": i} for g, i in zip(opt["groups"], ids)]
    files = [f"dp_rank_{rank:02d}_tp_rank_00_pp_rank_00.pt" for rank in range(dp_size)]

    def fill(staging: str) -> None:
        for rank, file in enumerate(files):
            base_state, shape_info, masters = {}, {}, {}
            for index, name in enumerate(names):
                shape_info[index] = torch.Size(shapes[name])
                state = opt["state"][name]
                if state:
                    base_state[index] = {
                        key: _xla_chunk(value, dp_size, rank) if is_moment(key, value) else value.clone()
                        for key, value in state.items()
                    }
                if opt["master_weights"] is not None:
                    masters[index] = _xla_chunk(opt["master_weights"][name], dp_size, rank)
            record = {"state": {}, "param_groups": groups, "base_state": base_state, "shape_info": shape_info}
            if opt["master_weights"] is not None:
                record["sharded_master_weights"] = masters
            torch.save(record, f"{staging}/{file}")  # a new directory only this user can enter

    write_output_directory(out, fill, overwrite=overwrite)
    return [out / file for file in files]


def import_xla(files: Sequence[str | os.PathLike], *, model: nn.Module, optimizer: Zero1Optimizer) -> None:
    """Load torch_xla / NxD ZeRO-1 optimizer files (one per DP rank, in rank order) into ``optimizer`` at
    its own DP size; every process of the job calls it (the ranks agree world-wide), with all the files. The files' parameters must be the
    optimizer's, in the same group order; the model's weights are not in these files (load them first).
    Without ``sharded_master_weights`` the masters are rebuilt from the parameters, with a warning. Each
    file is read by the strict reader; the state then runs the one load pipeline (check, agreement,
    install), as a checkpoint's does.

    Raises:
        ConfigError: a file's path is a URL (``s3://...``): object storage is not supported yet.
        CheckpointError: the files do not fit the optimizer (count, shapes, groups, state keys), named; a
            file listed twice (or two that are one file), a parameter number listed twice, one record for
            two state entries.
    """
    optimizer = check_args(model, optimizer)
    if optimizer is None:
        raise TypeError("import_xla needs the optimizer to load into.")
    if isinstance(files, (str, os.PathLike)) or not files:
        raise ConfigError("import_xla needs the per-rank files (a list: one per DP rank, in rank order).")
    paths = [local_path(f, "a torch_xla optimizer file") for f in files]
    targets = Targets(model=model, optimizer=optimizer, objects={}, backend=optimizer.backend)

    def read(request: Request) -> Staged:
        records, checksums, once = [], [], {}
        for path in paths:
            with Folder.open(path.parent) as folder:  # (a file listed twice, or hard-linked, is refused: once)
                records.append(load_file(folder, path.name, checksums=checksums, once=once))
        groups = records[0].get("param_groups") if isinstance(records[0], Mapping) else None
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                                                   for g in groups):
            raise CheckpointError(f"{paths[0]} is not a torch_xla optimizer state dict (no param_groups of parameters).")
        numbered_names(groups, request.optimizer.groups, str(paths[0]))
        source = _files_text(paths)
        state, hypers, masters = full_state_of(records, request.optimizer.names, paths)
        return Staged(source=source, optimizer=full_state(state, hypers, masters, source=source),
                      replicated={f"rank file {i}": crc for i, crc in enumerate(checksums)})

    run(read, targets, what=_files_text(paths))


def _files_text(files: Sequence[Path]) -> str:
    """The first of the ranks' files, and how many more: what an error names."""
    return str(files[0]) + (f" (and {len(files) - 1} more rank files)" if len(files) > 1 else "")


def full_state_of(
    records: Sequence[Mapping[str, Any]], order: Sequence[str], files: Sequence[Path]
) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, Any]], dict[str, torch.Tensor] | None]:
    """Whole per-parameter state from the DP ranks' records (rank order) of torch_xla's
    ZeRO-1 layout: ``(state by name, param_groups, master weights by name or None)``, the
    parameters named by ``order`` (the optimizer's group order; the records number them).

    Each record is used once, checked before anything is joined: every rank's ``param_groups``
    number the parameters 0..n-1 in group order, each once (as ``torch.optim`` writes them, so no
    number stands for two parameters), and no two of a rank's moments and masters are one record (the
    same tensor twice, one xser tensor id for two moments, or overlapping views of one storage: torch_xla
    keeps each parameter's state in tensors of its own; 0-dim counters are left out, as values).

    Raises:
        CheckpointError: records that do not belong together or do not fit ``order``; a parameter
            number listed twice; one record for two state entries; naming the file and the field.
    """
    first = records[0]
    shapes = first.get("shape_info") if isinstance(first, Mapping) else None
    if not isinstance(shapes, Mapping) or not all(type(i) is int for i in shapes) \
            or sorted(shapes) != list(range(len(shapes))) or not all(is_shape(shape) and len(shape) > 0
                                                                    for shape in shapes.values()):
        raise CheckpointError(f"{files[0]}: its shape_info is not {{parameter index: shape}} for parameters 0..n-1.")
    if len(shapes) != len(order):
        raise CheckpointError(
            f"the torch_xla optimizer files hold {len(shapes)} parameters, the optimizer {len(order)}."
        )
    groups = first.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                                               for g in groups):
        raise CheckpointError(f"{files[0]} is not a torch_xla optimizer state dict (no param_groups of parameters).")
    sizes = [{"params": g["params"]} for g in groups]  # (how many each group holds: the numbers are checked below)
    for f, r in zip(files, records):
        if not isinstance(r, Mapping) or not isinstance(r.get("base_state"), Mapping) or r.get("shape_info") != shapes:
            raise CheckpointError(f"{f} does not belong with {files[0]} (another layout or other parameters).")
        if set(r["base_state"]) != set(first["base_state"]) or any(
                not isinstance(r["base_state"][i], Mapping) or set(r["base_state"][i]) != set(entry)
                for i, entry in first["base_state"].items() if isinstance(entry, Mapping)):
            raise CheckpointError(f"{f} holds state for other parameters or keys than {files[0]}: the ranks' files of "
                                  f"one save hold the same (a rank's file is from another run).")
        if not set(r["base_state"]) <= set(shapes):
            raise CheckpointError(f"{f}: its base_state names parameters its shape_info does not list.")
        masters_of = r.get("sharded_master_weights", {})
        if not isinstance(masters_of, Mapping) or not all(isinstance(e, Mapping) for e in r["base_state"].values()):
            raise CheckpointError(f"{f}: its base_state or sharded_master_weights are not {{parameter index: ...}}.")
        odd = [f"base_state/{i}/{key}" for i, entry in r["base_state"].items() for key, v in entry.items()
               if not isinstance(v, torch.Tensor)]
        odd += [f"sharded_master_weights/{i}" for i, v in masters_of.items() if not isinstance(v, torch.Tensor)]
        if odd:
            raise CheckpointError(f"{f}: {odd[:8]} are not tensors; torch_xla's ZeRO-1 state holds tensors only.")
        numbering = torch_group_problems(r.get("param_groups"), sizes, "param_groups")
        if numbering:
            raise CheckpointError(f"{f} does not number its parameters as torch.optim does (0..n-1 in group order, "
                                  f"each once): {'; '.join(numbering[:4])}.")
        moment_records = [(f"base_state/{i}/{key}", v) for i, entry in r["base_state"].items()
                          for key, v in entry.items() if is_moment(key, v)]
        master_records = [(f"sharded_master_weights/{i}", v) for i, v in masters_of.items()]
        check_distinct(moment_records + master_records, str(f), "each moment and master is a tensor of its own")
    # torch_xla pads dim 0 to a multiple of the DP size and keeps chunk ``rank``: every chunk of
    # parameter i has the shape (ceil(rows / n), *shape[1:]); checked before any is joined, so
    # the joined tensors are no larger than the parameters
    n = len(records)
    for f, r in zip(files, records):
        for i, shape in shapes.items():
            chunk = (-(-shape[0] // n), *shape[1:])
            chunks = [("sharded_master_weights", r["sharded_master_weights"].get(i))] if "sharded_master_weights" in r else []
            chunks += [(key, v) for key, v in r["base_state"].get(i, {}).items() if is_moment(key, v)]
            for key, v in chunks:
                if v is None or tuple(v.shape) != chunk:
                    raise CheckpointError(
                        f"{f}: {key} of parameter {i} (shape {tuple(shape)}) is a chunk of shape "
                        f"{None if v is None else tuple(v.shape)}, not {chunk} as {n} DP ranks' files make up: a "
                        f"rank's file is missing or from another run."
                    )

    def whole(chunks: list[torch.Tensor], i: int) -> torch.Tensor:
        """Parameter ``i`` from the ranks' padded dim-0 chunks."""
        return torch.cat(chunks)[: shapes[i][0]].view(tuple(shapes[i]))

    state, masters = {}, {} if "sharded_master_weights" in first else None
    for i, name in enumerate(order):
        saved = first["base_state"].get(i, {})
        for key, value in saved.items():
            if not is_moment(key, value) and any(not torch.equal(r["base_state"][i][key], value) for r in records):
                raise CheckpointError(f"the ranks' files {files[0]} ... hold different {key!r} for parameter {i}: files "
                                      f"of one save hold the same.")
        state[name] = {key: whole([r["base_state"][i][key] for r in records], i) if is_moment(key, value) else value
                       for key, value in saved.items()}
        if masters is not None:
            masters[name] = whole([r["sharded_master_weights"][i] for r in records], i)
    return state, first["param_groups"], masters
