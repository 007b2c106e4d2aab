"""Loading: a checkpoint checked against the live model and optimizer, this rank's new
shards planned from the saved pieces (at any DP size: ``resharding``), read into staging
buffers, agreed on by every rank, and only then committed.

A refused load changes nothing: everything is read and checked first (the files through the safe
open and the strict reader, the optimizer state by the one state-fit check, ``optim.state_fit``),
and a failure on any rank, expected or not, is a ``CheckpointError`` on every rank (the backend's
one agreement).
The caller's stateful objects (the scheduler, ...) are loaded before the agreement and put back
if any rank refused; the model and the optimizer are committed after it, by steps that cannot
fail once the checks passed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..backend import Backend
from ..backend.agreement import agree, error_text
from ..core.dtensors import like_live, local_shape, local_state_dict, tensor_parallel_layout
from ..core.errors import CheckpointError
from ..optim.loss_scaler import check_scaler_state
from ..optim.state_fit import StateFit, check_step
from ..zero1_optimizer import Zero1Optimizer
from .format import (
    FORMAT_V1,
    META_FILE,
    SCHEDULER,
    check_args,
    completion_record,
    group_hyperparameters,
    group_records,
    managed_param_names,
    master_key,
    model_key,
    param_group_names,
    read_entries,
    read_index,
    read_small_files,
    scaler_key,
    small_file_paths,
    state_key,
    verify_files,
)
from .links import resolve
from .progress import phases
from .resharding import named_pieces, overlaps
from .storage import StoredTensor
from .typed_json import dtype_named
from .values import check_scheduler_state, is_scheduler, load_objects

log = logging.getLogger("nxd_smp.checkpoint")


def load(
    path: Path,
    model: nn.Module,
    optimizer: Zero1Optimizer | None,
    backend: Backend,
    *,
    objects: Mapping[str, Any],
    verify_checksums: bool,
    progress: bool | None,
    strict: bool = True,
) -> Any:
    """``load_checkpoint`` once its arguments are checked: rank 0 finds and checks the
    checkpoint, every rank plans and reads its part, all agree, then commit. Returns the
    saved ``extra``. ``backend``: the optimizer's (or the model's device's), which coordinates
    the ranks and says what dtype the device holds each tensor in."""
    coordinator = backend.coordinator
    rank = coordinator.rank
    with phases(progress, rank, ["verify", "read", "commit"], f"load {path.name}", log) as advance:
        found: Any = None
        if rank == 0:
            try:
                target = resolve(path)
                record = completion_record(target)
                verify_files(target, record, checksums=verify_checksums and record["format"] == FORMAT_V1)
                found = [str(target), record]
            except FileNotFoundError as e:
                found = {"missing": str(e)}
            except Exception as e:  # noqa: BLE001 - every rank learns of any failure
                found = {"refused": error_text(e)}
        found = coordinator.broadcast(found)
        if isinstance(found, dict):
            raise FileNotFoundError(found["missing"]) if "missing" in found else CheckpointError(found["refused"])
        target, record = Path(found[0]), found[1]

        def prepare() -> tuple[tuple[Any, dict[str, Any], LoadPlan], Any]:
            index = read_index(target, record["format"])
            meta, saved = read_small_files(target, record, index)
            source, extra_file = small_file_paths(target, record["format"])
            _check_objects(saved, objects, extra_file)
            advance("verify")
            plan = plan_load(meta, model, optimizer, strict=strict, device_dtype=backend.device_dtype, source=source)
            read_entries(plan.staging, target, verify_checksums, index)
            _check_values(plan, optimizer, index)
            plan.assemble()
            return (meta, saved, plan), load_objects(objects, saved["objects"], str(extra_file))

        meta, saved, plan = agree(coordinator, prepare)
        advance("read")
        _commit(plan, meta, model, optimizer, strict=strict)
        advance("commit")
    return saved["extra"]


def _check_objects(saved: Mapping[str, Any], objects: Mapping[str, Any], source: Path) -> None:
    """The saved states (``read_small_files``' ``{"extra", "objects"}``) hold one for every object
    asked for, the scheduler's fitting the scheduler."""
    missing = sorted(set(objects) - set(saved["objects"]))
    if missing:
        raise CheckpointError(
            f"the checkpoint holds no state for {missing}; it has {sorted(saved['objects']) or 'none'}. "
            f"Load without them, or from a checkpoint saved with them."
        )
    for name, obj in objects.items():
        if name == SCHEDULER or is_scheduler(obj):
            check_scheduler_state(saved["objects"][name], obj, f"{source} ({name})")


def _check_values(plan: LoadPlan, optimizer: Zero1Optimizer | None, index: Mapping[str, StoredTensor]) -> None:
    """The values read that the checks of the metadata could not see: each bucket's ``step`` a
    finite, non-negative whole number, the loss scaler's state one the scaler accepts (a finite,
    positive scale; whole trackers). Errors name each entry and the file ``index`` says holds it."""
    problems = [found for scalars in plan.scalars for key, entry in scalars.items()
                if key == "step" and (found := check_step(plan.staging[entry], f"{entry} in {index[entry].file}"))]
    scaler = optimizer.loss_scaler if optimizer is not None else None
    if scaler is not None:
        saved = {key: plan.staging[scaler_key(key)] for key in scaler.state_dict() if scaler_key(key) in plan.staging}
        if saved:
            held = index[scaler_key("scale")].file if scaler_key("scale") in index else None
            problems += [f"loss_scaler{p}" + (f" (in {held})" if held else "") for p in check_scaler_state(saved, scaler)]
    if problems:
        raise CheckpointError("values the optimizer would not accept: " + "; ".join(problems) + ".")


@dataclass
class LoadPlan:
    """What one rank reads, and where it goes.

    Attributes:
        staging: checkpoint key -> the tensor it is read into: a view of a new shard buffer
            (a saved piece inside one of this rank's pieces), or a tensor of its own.
        shards: (``"optim"``, state key) or (``"master"``, None) -> this rank's new shard
            buffer per bucket.
        copies: (key, buffer, dst, src, numel): overlaps of saved pieces that straddle this
            rank's shard boundaries, copied after the read.
        scalars: per bucket, 0-dim state key -> checkpoint key (from the bucket's first
            parameter: a shard of only padding still needs ``step``).
    """

    staging: dict[str, torch.Tensor]
    shards: dict[tuple[str, str | None], list[torch.Tensor]] = field(default_factory=dict)
    copies: list[tuple[str, torch.Tensor, int, int, int]] = field(default_factory=list)
    scalars: list[dict[str, str]] = field(default_factory=list)

    def assemble(self) -> None:
        """Finish the shard buffers from the pieces that straddled shard boundaries."""
        for key, buffer, dst, src, n in self.copies:
            buffer[dst : dst + n].copy_(self.staging[key][src : src + n])


def name_differences(wanted, given, missing: str, extra: str) -> list[str]:
    """The names ``wanted`` has and ``given`` lacks, and the other way round, as problems."""
    lacking, surplus = sorted(set(wanted) - set(given)), sorted(set(given) - set(wanted))
    return ([f"{missing}: {lacking}"] if lacking else []) + ([f"{extra}: {surplus}"] if surplus else [])


def _check_model(meta: Mapping[str, Any], model: nn.Module, strict: bool,
                 device_dtype: Callable[[torch.dtype], torch.dtype]) -> None:
    live = local_state_dict(model)
    saved = meta["model"]
    problems = []
    if strict:
        problems = name_differences(live, saved, "missing from the checkpoint", "in the checkpoint but not in the model")
    for key in sorted(set(live) & set(saved)):
        shape, dtype = tuple(live[key].shape), str(device_dtype(live[key].dtype))
        if tuple(saved[key]["shape"]) != shape:
            problems.append(f"{key}: shape {tuple(saved[key]['shape'])} in the checkpoint, {shape} in the model")
        elif saved[key]["dtype"] != dtype:
            problems.append(f"{key}: dtype {saved[key]['dtype']} in the checkpoint, {dtype} in the model")
    saved_tp, live_tp = meta.get("tensor_parallel"), tensor_parallel_layout(model)
    if saved_tp != live_tp:
        where = (lambda tp: "a model without DTensors" if tp is None else
                 f"tensor-parallel rank {tp['rank']} of {tp['size']} (split {sorted(tp['split'])})")
        problems.append(f"it was saved by {where(saved_tp)}, and this rank holds {where(live_tp)}: each tensor-parallel "
                        f"coordinate loads the checkpoint it saved")
    if problems:
        raise CheckpointError("the checkpoint does not fit the model: " + "; ".join(problems) + ".")


def _check_optimizer(saved_opt: Mapping[str, Any] | None, names: list[str], optimizer: Zero1Optimizer,
                     source: Path | str) -> None:
    if saved_opt is None:
        raise CheckpointError(
            "the checkpoint holds no optimizer state; load it with optimizer=None and build "
            "the optimizer afresh."
        )
    mine = group_records(optimizer, names)
    if [g["params"] for g in mine] != [g["params"] for g in saved_opt["groups"]]:
        live_names, saved_names = set(names), set(saved_opt["params"])
        raise CheckpointError(
            "the checkpoint's optimizer does not fit: "
            f"parameters missing from it {sorted(live_names - saved_names)}, "
            f"extra in it {sorted(saved_names - live_names)}"
            + ("" if live_names != saved_names else "; the param groups are arranged differently")
            + "."
        )
    problems = [f"{name}: shape {tuple(saved_opt['params'][name]['shape'])} in the checkpoint, {tuple(local_shape(p))} "
                f"in the optimizer" for name, p in zip(names, optimizer.managed_params)
                if tuple(saved_opt["params"][name]["shape"]) != tuple(local_shape(p))]
    if problems:
        raise CheckpointError(f"{source}: the optimizer's parameters do not fit: " + "; ".join(problems) + ".")
    fit = StateFit(type(optimizer.inner_optimizer), optimizer.param_groups, [g["hyper"] for g in saved_opt["groups"]])
    problems = fit.group_problems()
    if problems:
        raise CheckpointError(f"{source}: " + "; ".join(problems) + ".")
    tensors, scalars = set(saved_opt["tensor_keys"]), set(saved_opt["scalar_keys"])
    if tensors or scalars:
        expected = fit.expected_keys() or (tensors, scalars & {"step"})  # (a class that cannot be probed)
        if (tensors, scalars) != expected:
            raise CheckpointError(
                f"{source}: the optimizer state keys do not fit {type(optimizer.inner_optimizer).__name__} with the "
                f"hyperparameters saved: tensors {sorted(tensors)} and 0-dim {sorted(scalars)} in the checkpoint, "
                f"the optimizer keeps tensors {sorted(expected[0])} and 0-dim {sorted(expected[1])}."
            )


def plan_load(
    meta: Mapping[str, Any], model: nn.Module, optimizer: Zero1Optimizer | None, strict: bool = True,
    device_dtype: Callable[[torch.dtype], torch.dtype] = lambda dtype: dtype, source: Path | str = META_FILE,
) -> LoadPlan:
    """Check the checkpoint (its metadata ``meta``) against the live objects and allocate
    this rank's staging buffers. ``strict=False``: model entries on one side only are left
    alone (the optimizer must fit all the same). ``device_dtype``: the dtype the device holds
    a live tensor's dtype in (what checkpoints record: bf16 for a float32 parameter under
    ``XLA_DOWNCAST_BF16``); the commit casts back.

    ``meta`` was checked by ``check_meta``; ``source`` names its file in errors.

    Raises:
        CheckpointError: names, shapes, dtypes, groups, hyperparameters or state keys that do
            not fit, each named.
    """
    _check_model(meta, model, strict, device_dtype)
    live = local_state_dict(model)
    plan = LoadPlan({
        model_key(key): torch.empty(info["shape"], dtype=dtype_named(info["dtype"]))
        for key, info in meta["model"].items() if key in live
    })
    if optimizer is None:
        return plan
    saved_opt = meta["optimizer"]
    names = managed_param_names(model, optimizer)
    _check_optimizer(saved_opt, names, optimizer, source)

    kinds = [("optim", key) for key in saved_opt["tensor_keys"]]
    if saved_opt["master_weights"]:
        kinds.append(("master", None))
    layouts, shards = optimizer.bucket_layouts, optimizer.inner_shards
    for kind, key in kinds:
        buffers = []
        for layout, shard in zip(layouts, shards):
            buffer = torch.empty(layout.shard_numel, dtype=torch.float32 if kind == "master" else device_dtype(shard.dtype))
            covered = sum(piece.numel for piece in layout.pieces(optimizer.rank))
            buffer[covered:].zero_()  # padding: the pieces fill a prefix of the shard
            buffers.append(buffer)
        plan.shards[(kind, key)] = buffers
    if saved_opt.get("loss_scaler") and optimizer.loss_scaler is not None:
        for key, value in optimizer.loss_scaler.state_dict().items():
            plan.staging[scaler_key(key)] = torch.empty((), dtype=value.dtype)
    for layout in layouts:
        first = names[layout.param_indices[0]]
        plan.scalars.append({key: state_key(first, key) for key in saved_opt["scalar_keys"]})
        for key in saved_opt["scalar_keys"]:
            plan.staging[state_key(first, key)] = torch.empty((), dtype=torch.float32)
    for b, name, piece in named_pieces(layouts, optimizer.rank, names):
        for part in overlaps(saved_opt["pieces"][name], piece):
            for kind, key in kinds:
                entry = state_key(name, key, part.saved_start) if kind == "optim" else master_key(name, part.saved_start)
                buffer = plan.shards[(kind, key)][b]
                if part.whole:
                    plan.staging[entry] = buffer[part.dst : part.dst + part.numel]
                else:
                    if entry not in plan.staging:
                        plan.staging[entry] = torch.empty(part.saved_end - part.saved_start, dtype=buffer.dtype)
                    plan.copies.append((entry, buffer, part.dst, part.src, part.numel))
    return plan


def _commit(
    plan: LoadPlan, meta: Mapping[str, Any], model: nn.Module, optimizer: Zero1Optimizer | None, strict: bool
) -> None:
    live = model.state_dict()  # (DTensors take their parts back as DTensors)
    model_state = {key: like_live(plan.staging[model_key(key)], live.get(key))
                   for key in meta["model"] if model_key(key) in plan.staging}
    with torch.no_grad():
        model.load_state_dict(model_state, strict=strict)  # copies in place: views stay views
    if optimizer is None:
        return
    scaler_state = None
    if optimizer.loss_scaler is not None and meta["optimizer"].get("loss_scaler"):
        scaler_state = {key: plan.staging[scaler_key(key)] for key in optimizer.loss_scaler.state_dict()}
    commit_optimizer(
        optimizer,
        {key: bufs for (kind, key), bufs in plan.shards.items() if kind == "optim"},
        [{key: plan.staging[entry] for key, entry in scalars.items()} for scalars in plan.scalars],
        [record["hyper"] for record in meta["optimizer"]["groups"]],
        plan.shards.get(("master", None)),
        scaler_state=scaler_state,
    )


def commit_optimizer(
    optimizer: Zero1Optimizer,
    tensors: Mapping[str, list[torch.Tensor]],
    scalars: list[Mapping[str, torch.Tensor]],
    hypers: list[Mapping[str, Any]],
    masters: list[torch.Tensor] | None,
    *,
    scaler_state: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Install checked shard states (``tensors[key][bucket]``), per-bucket scalar state,
    per-group hyperparameters, the loss scaler's state if given, and, if given, master shards; else
    the masters are rebuilt from the loaded parameters, with a warning
    (``Zero1Optimizer.install_state``, whose undo covers the scaler too)."""
    state = {}
    for b in range(len(optimizer.bucket_layouts)):
        entry = {key: value.clone() for key, value in scalars[b].items()}
        entry.update({key: bufs[b] for key, bufs in tensors.items()})
        if entry:
            state[b] = entry
    optimizer.install_state(state, hypers, masters, rebuild=True, scaler_state=scaler_state)


def load_full_optimizer_state(
    model: nn.Module,
    optimizer: Zero1Optimizer,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    hyperparameters: list[Mapping[str, Any]],
    master_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    source: str | os.PathLike | None = None,
) -> None:
    """Install unsharded, per-parameter optimizer state into ``optimizer`` at its own DP
    size; every rank calls it with the same full tensors and keeps its own shard.

    Args:
        state: ``{parameter name: {key: tensor shaped like the parameter, or 0-dim}}`` (the
            layout ``read_checkpoint`` returns; ``{}`` for a parameter without state yet, which
            then starts from zero moments with its bucket's step count).
        hyperparameters: one dict per param group (lr, betas, ...), in group order; kernel
            choices such as ``fused`` are ignored.
        master_weights: ``{parameter name: tensor shaped like the parameter}``, or None to
            rebuild the masters from the current parameters (with a warning that precision
            below the parameter dtype is lost).

    Raises:
        CheckpointError: names, shapes or groups that do not fit, each named; nothing is
            changed then.
    """
    check_full_optimizer_state(model, optimizer, state, hyperparameters, master_weights, source=source)
    install_full_optimizer_state(model, optimizer, state, hyperparameters, master_weights)


def check_full_optimizer_state(
    model: nn.Module,
    optimizer: Zero1Optimizer,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    hyperparameters: list[Mapping[str, Any]],
    master_weights: Mapping[str, torch.Tensor] | None = None,
    *,
    source: str | os.PathLike | None = None,
) -> None:
    """Raise a ``CheckpointError`` naming every way the arguments of
    ``load_full_optimizer_state`` do not fit; change nothing. The one state-fit check
    (``optim.state_fit``): each group's hyperparameters fit the live group, and each parameter's
    state has the keys the inner optimizer keeps under the hyperparameters installed, tensor or
    0-dim as it keeps them, moments shaped like the parameter; masters are floating tensors shaped
    like their parameters. ``source``: the file(s) they were read
    from, named in the error."""
    optimizer = check_args(model, optimizer)
    names = managed_param_names(model, optimizer)
    live = dict(zip(names, optimizer.managed_params))
    if not isinstance(state, Mapping) or not isinstance(hyperparameters, (list, tuple)) or not (
            master_weights is None or isinstance(master_weights, Mapping)):
        raise CheckpointError("the optimizer state is not {name: {key: tensor}} with a list of param groups.")
    problems = name_differences(names, state, "no state for", "state for parameters the optimizer does not manage")
    fit = StateFit(type(optimizer.inner_optimizer), optimizer.param_groups,
                   [group_hyperparameters(h) if isinstance(h, Mapping) else h for h in hyperparameters])
    group_problems = fit.group_problems()
    problems += group_problems
    if not group_problems:
        group_of = {name: g for g, group in enumerate(param_group_names(model, optimizer)) for name in group}
        keys = {frozenset(entry) for entry in state.values() if isinstance(entry, Mapping) and entry}
        if fit.expected_keys() is None and len(keys) > 1:  # (a class that cannot be probed)
            problems.append(f"the parameters' state keys differ: {sorted(sorted(k) for k in keys)}")
        problems += fit.problems((group_of[name], name, state[name], tuple(local_shape(live[name])))
                                 for name in sorted(set(names) & set(state)))
    for name in sorted(set(names) & set(state)) if master_weights is not None else ():
        master, shape = master_weights.get(name), tuple(local_shape(live[name]))
        if not isinstance(master, torch.Tensor) or tuple(master.shape) != shape or not master.dtype.is_floating_point:
            problems.append(f"master weight {name}: {_what(master)}, the parameter is {shape}")
    if problems:
        raise CheckpointError((f"{source}: " if source is not None else "") + "the optimizer state does not fit: "
                              + "; ".join(problems) + ".")


def _what(value: Any) -> str:
    return f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def install_full_optimizer_state(
    model: nn.Module,
    optimizer: Zero1Optimizer,
    state: Mapping[str, Mapping[str, torch.Tensor]],
    hyperparameters: list[Mapping[str, Any]],
    master_weights: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """The second half of ``load_full_optimizer_state``: arguments already checked by
    ``check_full_optimizer_state``, cut this rank's shards and commit them."""
    names = managed_param_names(model, optimizer)
    tensor_keys = sorted({k for entry in state.values() for k, v in entry.items() if v.dim() > 0})
    layouts = optimizer.bucket_layouts

    def shards_of(source: Mapping[str, torch.Tensor], dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """Each bucket's shard of this rank, cut from the whole tensors ``source[name]``."""
        buffers = [torch.zeros(layout.shard_numel, dtype=dtype) for layout, dtype in zip(layouts, dtypes)]
        for b, name, piece in named_pieces(layouts, optimizer.rank, names):
            flat = source[name].reshape(-1)
            buffers[b][piece.shard_start : piece.shard_start + piece.numel].copy_(flat[piece.param_start : piece.param_end])
        return buffers

    shard_dtypes = [shard.dtype for shard in optimizer.inner_shards]
    # A parameter without state (it got no gradient in the saved run: torch creates state
    # lazily) starts from zero moments, in a bucket whose step count the others give.
    live = dict(zip(names, optimizer.managed_params))
    with_state = [n for n in names if state[n]]
    scalars = []
    for layout in layouts:
        source = next((names[i] for i in layout.param_indices if state[names[i]]), with_state[0] if with_state else None)
        scalars.append({} if source is None else {k: v for k, v in state[source].items() if v.dim() == 0})

    def entry(name: str, key: str) -> torch.Tensor:
        return state[name][key] if key in state[name] else torch.zeros(local_shape(live[name]), dtype=torch.float32)

    tensors = {key: shards_of({n: entry(n, key) for n in names}, shard_dtypes) for key in tensor_keys}
    masters = None if master_weights is None else shards_of(master_weights, [torch.float32] * len(layouts))
    commit_optimizer(optimizer, tensors, scalars, [group_hyperparameters(h) for h in hyperparameters], masters)
