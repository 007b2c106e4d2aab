"""The one check of a staged state (``staged``) against what it is installed into, for every format
and entry point: it runs on every rank after the read and before anything changes, and decides
what the install does (``Plan``), so that the install has nothing left to fail on.

* The model: the names (all of them with ``strict``), the shapes, the dtypes (nxd_smp's own format
  records the device's dtype and must match it; other tools' tensors must convert exactly), the
  tensor-parallel coordinate a DTensor model's checkpoint was saved at.
* The optimizer, per parameter, as the live optimizer class keeps it under the hyperparameters
  being installed (``optim.state_fit``): the param groups' hyperparameters of the live groups' kinds
  and of values the class's constructor accepts; each parameter's state keys, each a moment (a
  floating tensor shaped like the parameter: a 0-dim moment of a 0-dim parameter is a moment, not a
  step counter) or a counter (0-dim; ``step`` a finite, non-negative whole number) as a throwaway
  instance of the class keeps it; the master weights floating and shaped like their parameters; the
  loss scaler's state one the live scaler can reach and count from.
* The scheduler by a dry run: its saved state loaded into a copy of it bound to a stub optimizer
  (copies of the param groups, no parameters), then stepped; it must accept the state and leave
  every learning rate finite and non-negative. The other stateful objects cannot be dry-run: their
  loads are the install's transaction.

``digest`` is what the ranks of a data-parallel group compare before installing (``agree``): the
hyperparameters, the step counters, the loss scaler, the scheduler and the checksums of the
replicated tensors; RNG states differ by rank and stay out.
"""

from __future__ import annotations

import copy
import hashlib
import math
import struct
import warnings
import zlib
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ...core.dtensors import tensor_parallel_layout
from ...core.errors import CheckpointError
from ..param_groups import KERNEL_OPTIONS
from ..state_fit import (
    StateFit,
    check_scaler_state,
    check_state_entry,
    describe,
    is_moment,
    misfit,
    torch_group_problems,
)
from .staged import Pieces, Staged, StagedModel, StagedOptimizer, Targets, Whole

SCHEDULER = "scheduler"  # the name the scheduler's state is saved under


# ---------------------------------------------------------------------------- sizes and values
def is_size(value: Any) -> bool:
    """Whether ``value`` is a size, offset or length: a non-negative int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


#: torch computes a tensor's size in bytes as a signed 64-bit integer: the product of its nonzero
#: dimensions and its item size must stay below this, even where a zero dimension makes it empty
#: (``torch.empty((2**62, 2**62, 0))`` raises).
SIZE_LIMIT = 1 << 63


def is_shape(value: Any, dtype: torch.dtype | None = None) -> bool:
    """Whether ``value`` is a shape a tensor can have: a tuple or list of sizes whose nonzero
    dimensions times ``dtype``'s item size (1 without one) stay below ``SIZE_LIMIT``."""
    if not isinstance(value, (tuple, list)) or not all(is_size(d) for d in value):
        return False
    nbytes = 1 if dtype is None else dtype.itemsize
    for d in value:
        nbytes *= d or 1
        if nbytes >= SIZE_LIMIT:
            return False
    return True


#: The tensor types a load installs from: plain tensors and parameters (never a subclass that
#: dispatches elsewhere: a DTensor, a ``FlatShard``, a fake or functional tensor).
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def tensor_problem(value: torch.Tensor, devices: Sequence[str] = ("cpu",)) -> str | None:
    """Why the install could not read ``value``'s elements, None where it can: a plain tensor
    (``_PLAIN_TENSORS``), strided, not quantized, with storage (not on the meta device) and on one
    of ``devices`` (device types: the host's, and the device the install copies to)."""
    if type(value) not in _PLAIN_TENSORS:
        return f"a {type(value).__name__}, not a plain tensor"
    if value.is_meta:
        return "a meta tensor (no data: it was saved or loaded without its storage)"
    if value.layout != torch.strided or value.is_quantized:
        return f"a {'quantized' if value.is_quantized else str(value.layout).removeprefix('torch.')} tensor"
    if value.device.type not in devices:
        return f"on the {value.device.type} device, where the install reads from {' or '.join(devices)}"
    return None


def _tensors_in(value: Any) -> Iterator[tuple[tuple, torch.Tensor]]:
    """Every tensor inside ``value`` (dicts, lists, tuples, sets and staged values, each container
    visited once, however deep: no recursion) with its path."""
    seen: set[int] = set()
    stack: list[tuple[tuple, Any]] = [((), value)]
    while stack:
        at, item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield at, item
            continue
        if isinstance(item, Whole):
            stack.append((at, item.tensor))
            continue
        if not isinstance(item, (Mapping, list, tuple, set, frozenset, Pieces)) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, Pieces):
            stack.extend(((*at, start), part) for start, part in item.parts.items())
        elif isinstance(item, Mapping):
            stack.extend(((*at, key), child) for key, child in item.items())
        else:
            stack.extend(((*at, i), child) for i, child in enumerate(item))


def _path(at: tuple) -> str:
    return "".join(f"[{describe(k)}]" for k in at)


def _check_tensors(staged: Staged, targets: Targets) -> None:
    """Every tensor the install and the commit read, in every part of ``staged``, is one they can read
    (``tensor_problem``): checked first, so that no later check or copy meets a meta tensor, a sparse or
    quantized one, or one on a device the install does not copy from.

    Raises:
        CheckpointError: naming the part, the file and the place of each.
    """
    devices = tuple(dict.fromkeys(("cpu", torch.device(targets.backend.device).type)))
    opt, model, torch_opt = staged.optimizer, staged.model, staged.torch_optimizer
    parts = [("model", staged.source, None) if model is None else ("model", model.source, model.entries)]
    if opt is not None:
        parts += [("optimizer state", opt.source, opt.state), ("master weights", opt.source, opt.masters),
                  ("param groups", opt.source, opt.groups), ("loss scaler", opt.source, opt.scaler)]
    if torch_opt is not None:
        parts.append(("optimizer state", torch_opt.source, torch_opt.state_dict))
    parts += [("objects", staged.objects_source, staged.objects.states), ("state dicts", staged.source, staged.fill)]
    problems = []
    for part, where, value in parts:
        for at, tensor in _tensors_in(value):
            found = tensor_problem(tensor, devices)
            if found:
                problems.append(f"{where}: {part}{_path(at)} is {found}")
            if len(problems) >= 8:
                break
    if problems:
        raise CheckpointError("; ".join(problems) + ". Refused before anything was changed: load a state whose "
                              "tensors hold their data on the host (torch.load(..., map_location='cpu')).")


def check_cast(value: Any, dtype: torch.dtype, where: str) -> None:
    """``value`` is a tensor that becomes ``dtype`` exactly enough: a float into a float dtype
    (rounded, and a finite value stays finite), an integer or bool into an integer dtype with every
    value kept; complex only into the same complex dtype.

    Raises:
        CheckpointError: naming ``where`` and the dtypes.
    """
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{where} is a {type(value).__name__}, not a tensor.")
    source = value.dtype
    if dtype.is_complex or source.is_complex:
        ok = source == dtype
    elif dtype.is_floating_point:
        ok = source.is_floating_point and not bool((torch.isfinite(value) & torch.isinf(value.to(dtype))).any())
    else:
        ok = not source.is_floating_point and torch.equal(value.to(dtype).to(source), value)
    if not ok:
        raise CheckpointError(f"{where} is {source}, which does not convert exactly to the {dtype} it is installed as "
                              f"(values out of range, or another kind of number); refused.")


def name_differences(wanted, given, missing: str, extra: str) -> list[str]:
    """The names ``wanted`` has and ``given`` lacks, and the other way round, as problems."""
    lacking, surplus = sorted(set(wanted) - set(given), key=str), sorted(set(given) - set(wanted), key=str)
    return ([f"{missing}: {lacking[:8]}" + (f" and {len(lacking) - 8} more" if len(lacking) > 8 else "")]
            if lacking else []) + ([f"{extra}: {surplus[:8]}" + (f" and {len(surplus) - 8} more"
                                                                   if len(surplus) > 8 else "")] if surplus else [])


def group_hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters: everything but its parameters and the kernel choices
    (``fused``, ``foreach``, ...), which belong to whoever loads."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names", *KERNEL_OPTIONS)}


# ---------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    """What the check decided for the install.

    Attributes:
        moments: per parameter with state, its keys kept as tensors shaped like it.
        counters: per parameter with state, its keys kept 0-dim (``step``) or as numbers.
        model_state: the model entries to install, cast to the live dtypes where they differ.
    """

    moments: dict[str, list[str]] = field(default_factory=dict)
    counters: dict[str, list[str]] = field(default_factory=dict)
    model_state: dict[str, torch.Tensor] | None = None


def check(staged: Staged, targets: Targets) -> Plan:
    """Everything in ``staged`` that ``targets`` would not take, refused; else the ``Plan``.

    Raises:
        CheckpointError: naming the file and every field that does not fit; nothing is changed.
    """
    plan = Plan()
    _check_tensors(staged, targets)
    if isinstance(targets.model, nn.Module) and staged.model is not None:
        plan.model_state = _check_model(staged.model, targets)
    elif isinstance(targets.model, MutableMapping) and staged.fill is None:
        raise CheckpointError(f"{staged.source} loads into the model and optimizer themselves, not into state dicts: "
                              f"pass model=<module> and optimizer=<optimizer>.")
    if targets.rank_state is not None:
        if staged.optimizer is None:
            raise CheckpointError(f"{staged.source} holds no optimizer state; load it with optimizer=None and build the "
                                  f"optimizer afresh.")
        _check_optimizer(staged.optimizer, targets, plan)
    elif isinstance(targets.optimizer, torch.optim.Optimizer):
        _check_torch_optimizer(staged, targets.optimizer)
    _check_objects(staged, targets.objects)
    return plan


# ---------------------------------------------------------------------------- the model
def _check_model(staged: StagedModel, targets: Targets) -> dict[str, torch.Tensor]:
    model, device_dtype = targets.model, targets.backend.device_dtype
    live = targets.live_model
    saved = staged.shapes
    where = staged.source
    problems = name_differences(live, saved, "missing from the checkpoint",
                                "in the checkpoint but not in the model") if targets.strict else []
    state = {}
    for key in sorted(set(live) & set(saved)):
        shape, dtype = saved[key]
        value = staged.entries.get(key)
        if tuple(shape) != tuple(live[key].shape):
            problems.append(f"{key}: shape {tuple(shape)} in the checkpoint, {tuple(live[key].shape)} in the model")
        elif dtype != device_dtype(live[key].dtype) and staged.exact_dtypes:
            problems.append(f"{key}: dtype {str(dtype).removeprefix('torch.')} in the checkpoint, "
                            f"{str(device_dtype(live[key].dtype)).removeprefix('torch.')} in the model")
        elif value is None:
            problems.append(f"{key}: not read from the checkpoint")
        else:
            try:
                if value.dtype != live[key].dtype:
                    check_cast(value, live[key].dtype, key)
                state[key] = value
            except CheckpointError as e:
                problems.append(str(e).rstrip("."))
    if staged.exact_dtypes:
        saved_tp, live_tp = staged.tensor_parallel, tensor_parallel_layout(model)
        if _layout(saved_tp) != live_tp:
            def at(tp: Any) -> str:
                return ("a model without DTensors" if tp is None else
                        f"tensor-parallel rank {tp['rank']} of {tp['size']} (split {sorted(tp['split'])})")
            problems.append(f"it was saved by {at(saved_tp)}, and this rank holds {at(live_tp)}: each tensor-parallel "
                            f"coordinate loads the checkpoint it saved")
    if problems:
        raise CheckpointError(f"{where} does not fit the model: " + "; ".join(problems) + ".")
    return state


def _layout(tp: Any) -> Any:
    """A saved tensor-parallel layout without the save's identity (which the live one has not)."""
    return None if tp is None else {k: v for k, v in tp.items() if k != "save"}


# ---------------------------------------------------------------------------- the optimizer
def _as_checked(value: Any) -> Any:
    """A staged value as ``state_fit.check_state_entry`` reads it: a tensor of its shape and dtype (a
    meta tensor for pieces and whole moments: no memory), a 0-dim tensor or number as it is."""
    if isinstance(value, Whole):
        return value.tensor if value.tensor.dim() == 0 else torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, Pieces):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    return value


def _check_optimizer(staged: StagedOptimizer, targets: Targets, plan: Plan) -> None:
    held = targets.rank_state
    groups = targets.groups
    names = [name for group in groups for name in group]
    shapes = targets.request().optimizer.shapes
    inner_class = type(held.inner_optimizer)
    if staged.arrangement is not None and staged.arrangement != groups:
        saved_names = {name for group in staged.arrangement for name in group}
        problems = name_differences(names, saved_names, "parameters missing from it",
                                    "parameters it holds that the optimizer does not manage")
        raise CheckpointError(f"{staged.source}: the optimizer does not fit: "
                              + ("; ".join(problems) if problems else "its param groups are arranged differently "
                                 f"({[len(g) for g in staged.arrangement]} parameters per group saved, "
                                 f"{[len(g) for g in groups]} live)") + ".")
    problems = name_differences(names, staged.state, "parameters missing from it",
                                "parameters it holds that the optimizer does not manage")
    inner = held.inner_optimizer
    fit = StateFit(inner_class, held.param_groups, staged.groups,
                   [next((inner.state[shard] for shard in group["params"] if inner.state.get(shard)), None)
                    for group in inner.param_groups])
    group_problems = fit.group_problems()
    problems += group_problems
    if not problems:
        group_of = {name: g for g, group in enumerate(groups) for name in group}
        entries = [(group_of[name], name, {k: _as_checked(v) for k, v in staged.state[name].items()}, shapes[name])
                   for name in names if isinstance(staged.state[name], Mapping)]
        problems += [f"parameter {name}: a state that is not a dict" for name in names
                     if not isinstance(staged.state[name], Mapping)]
        kinds_known = True
        for g, name, entry, shape in entries:
            kinds = fit.kinds(g)
            kinds_known = kinds_known and kinds is not None
            problems += check_state_entry(entry, kinds, shape, name)
            if entry and not problems:
                plan.moments[name] = sorted(k for k, v in entry.items() if is_moment(k, v, kinds, saved=True))
                plan.counters[name] = sorted(k for k, v in entry.items() if not is_moment(k, v, kinds, saved=True))
        if not kinds_known:  # (a class that cannot be probed: every parameter with state keeps the same keys)
            keys = {frozenset(entry) for _, _, entry, _ in entries if entry}
            if len(keys) > 1:
                problems.append(f"the parameters' state keys differ: {sorted(sorted(k) for k in keys)}")
    if staged.masters is not None and held.mixed_precision.use_master_weights:
        for name in sorted(set(names) & set(staged.masters)):
            master = staged.masters[name]
            if not isinstance(master, (Pieces, Whole)) or master.shape != shapes[name] \
                    or not master.dtype.is_floating_point:
                found = (f"{master.dtype} of shape {master.shape}" if isinstance(master, (Pieces, Whole))
                         else type(master).__name__)
                problems.append(f"master weight {name}: {found}, the parameter is {shapes[name]}")
        problems += [f"master weight {name}: missing" for name in names if name not in staged.masters]
    if not problems:
        problems += _staged_problems(staged, targets, plan, names)
    scaler = held.loss_scaler
    if scaler is not None and staged.scaler is not None:
        problems += [f"loss_scaler{p}" for p in check_scaler_state(staged.scaler, scaler)]
    if problems:
        raise CheckpointError(f"{staged.source}: the optimizer state does not fit {inner_class.__name__}: "
                              + "; ".join(problems) + ".")


def _staged_problems(staged: StagedOptimizer, targets: Targets, plan: Plan, names: list[str]) -> list[str]:
    """What the install would copy of each moment and master weight, as it will copy it: a ``Pieces``
    holds exactly this rank's slots (``Request``), each a 1-D floating tensor of the slot's length; a
    value narrower in its shard's dtype than as read (fp64 into fp32, fp32 into fp16) keeps every finite
    value finite (``check_cast``). (A ``Whole`` tensor's shape and kind are ``_check_optimizer``'s.)"""
    request = targets.request().optimizer
    values = [(name, f"{name}/{key}", staged.state[name][key], None) for name in names
              for key in plan.moments.get(name, [])]
    if staged.masters is not None and targets.rank_state.mixed_precision.use_master_weights:
        values += [(name, f"master weight {name}", staged.masters[name], torch.float32) for name in names]
    problems = []
    for name, where, value, installed_as in values:  # (the masters' shards are built in fp32)
        slots = request.slots.get(name, [])
        if isinstance(value, Pieces):
            if set(value.parts) != {slot.start for slot in slots}:
                problems.append(f"{where}: the ranges from {sorted(value.parts)[:4]}, this rank installs the ranges "
                                f"from {sorted(slot.start for slot in slots)[:4]}")
                continue
            parts = [(value.parts[slot.start], slot) for slot in slots]
            wrong = [(part, slot) for part, slot in parts if part.dim() != 1 or part.numel() != slot.end - slot.start
                     or not part.dtype.is_floating_point]
            if wrong:
                part, slot = wrong[0]
                problems.append(f"{where}: a {part.dtype} tensor of shape {tuple(part.shape)} where this rank "
                                f"installs {slot.end - slot.start} floating elements")
                continue
        elif isinstance(value, Whole):
            parts = [(value.tensor, slot) for slot in slots[:1]]
        else:
            continue
        for part, slot in parts:
            dtype = installed_as or request.shard_dtypes[slot.bucket]
            if torch.finfo(part.dtype).max > torch.finfo(dtype).max:
                try:
                    check_cast(part, dtype, where)
                except CheckpointError as e:
                    problems.append(str(e).rstrip("."))
    return problems


def _check_torch_optimizer(staged: Staged, optimizer: torch.optim.Optimizer) -> None:
    """``staged.torch_optimizer`` is a ``state_dict()`` of ``optimizer`` (a plain torch optimizer: NxD's
    with ZeRO-1 off): its groups as torch's ``load_state_dict`` checks them, numbering the parameters
    as the optimizer does, and the one state-fit check per parameter id."""
    saved, source = staged.torch_optimizer.state_dict, staged.torch_optimizer.source
    groups, state = (saved.get("param_groups"), saved.get("state")) if isinstance(saved, Mapping) else (None, None)
    if not isinstance(groups, list) or not isinstance(state, Mapping) or not all(
            isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{source} is not a torch optimizer state dict ('state' and 'param_groups').")
    problems = torch_group_problems(groups, optimizer.param_groups, "param_groups")
    if problems:
        raise CheckpointError(f"{source}: the optimizer state does not fit: " + "; ".join(problems) + ".")
    where = {i: (g, tuple(p.shape)) for g, (saved_group, group) in enumerate(zip(groups, optimizer.param_groups))
             for i, p in zip(saved_group["params"], group["params"])}
    problems = [f"state for parameter {describe(i)}, which the param groups do not list" for i in state
                if isinstance(i, bool) or i not in where]
    hypers = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    problems += StateFit(type(optimizer), optimizer.param_groups, hypers).problems(
        (where[i][0], f"parameter {i}", entry, where[i][1]) for i, entry in state.items() if i in where)
    if problems:
        raise CheckpointError(f"{source}: the optimizer state does not fit: " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------- objects
def _check_objects(staged: Staged, objects: Mapping[str, Any]) -> None:
    """The staged states hold one for every object asked for; the scheduler's passes its dry run."""
    where, states = staged.objects_source, staged.objects.states
    missing = sorted(set(objects) - set(states))
    if missing:
        raise CheckpointError(f"{where} holds no state for {missing}; it has {sorted(states) or 'none'}. Load "
                              f"without them, or from a checkpoint saved with them.")
    for name, obj in objects.items():
        if name == SCHEDULER or is_scheduler(obj):
            check_scheduler_state(states[name], obj, f"{where} ({name})")


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is one of torch's LR schedulers (its state is checked by a dry run)."""
    lr = torch.optim.lr_scheduler
    return isinstance(obj, (lr.LRScheduler, lr.ReduceLROnPlateau))


class _StubOptimizer:
    """What a scheduler's dry run steps instead of the real optimizer: copies of its param groups'
    hyperparameters (no parameters), so neither the optimizer nor the model is copied or touched."""

    def __init__(self, optimizer: Any):
        self.param_groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}, "params": []}
                             for g in optimizer.param_groups]
        self.defaults = dict(getattr(optimizer, "defaults", {}))
        self.state: dict = {}

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None


def check_scheduler_state(saved: Any, scheduler: Any, where: str) -> None:
    """``saved`` is a state ``scheduler`` takes, by behaviour: the keys of its own ``state_dict()``
    (never ``optimizer``), each of the kind it holds there, and then a dry run: a copy of the scheduler
    bound to a stub optimizer (``_StubOptimizer``) loads ``saved`` and steps once, and must leave
    every learning rate a finite, non-negative number. A scheduler that cannot be copied is checked by
    its keys and kinds alone (its load is then the install's to undo).

    Raises:
        CheckpointError: naming ``where``, the keys, or the scheduler's own refusal.
    """
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where}: the scheduler state is a {type(saved).__name__}, not a dict.")
    live = scheduler.state_dict()
    problems = []
    if "optimizer" in saved:
        problems.append("'optimizer' (a scheduler's state never holds its optimizer)")
    lacking, surplus = sorted(set(live) - set(saved), key=str), sorted(set(saved) - set(live) - {"optimizer"}, key=str)
    if lacking:
        problems.append(f"missing {lacking}")
    if surplus:
        problems.append(f"keys the scheduler does not have {surplus[:8]}")
    problems += [m for key in sorted(set(saved) & set(live), key=str)
                 if (m := misfit(saved[key], live[key], finite=False, at=repr(key))
                     or _scheduler_value(saved[key], live[key], repr(key)))]
    if not problems:
        problems += _dry_run(saved, scheduler)
    if problems:
        raise CheckpointError(f"{where}: the scheduler state does not fit {type(scheduler).__name__}: "
                              + "; ".join(problems) + ".")


def _scheduler_value(saved: Any, live: Any, at: str) -> str | None:
    """Where ``saved`` (of ``live``'s kind, ``misfit`` said) is not a value the scheduler keeps
    there: see ``check_scheduler_state``. ``at``: the path so far."""
    if isinstance(live, Mapping):
        return next((m for k in live if (m := _scheduler_value(saved[k], live[k], f"{at}[{k!r}]"))), None)
    if isinstance(live, (tuple, list)):
        return next((m for i, (s, v) in enumerate(zip(saved, live)) if (m := _scheduler_value(s, v, f"{at}[{i}]"))),
                    None)
    here = f"{at} = {describe(saved)} where the live value is {describe(live)}"
    if isinstance(live, str):
        return None if saved == live else f"{here} (a scheduler's mode or the name of a group's key)"
    if isinstance(live, bool) or not isinstance(live, (int, float, torch.Tensor)):
        return None
    values = saved.detach().double().reshape(-1) if isinstance(saved, torch.Tensor) else torch.tensor([float(saved)],
                                                                                                     dtype=torch.float64)
    lives = live.detach().double().reshape(-1) if isinstance(live, torch.Tensor) else torch.tensor([float(live)],
                                                                                                   dtype=torch.float64)
    if bool(values.isnan().any()):
        return f"{here}: NaN"
    if bool(torch.isfinite(lives).all()):
        if not bool(torch.isfinite(values).all()):
            return f"{here}: not finite"
        if "lr" not in at and bool(((lives > 0) & ~(values > 0)).any()):  # (a decayed lr reaches 0)
            return f"{here}: not > 0 (a period, a factor or a rate, which step() divides by or multiplies with)"
        if bool(((lives >= 0) & ~(values >= 0)).any()):
            return f"{here}: negative"
    if isinstance(live, int) and not isinstance(saved, int) and "lr" not in at and "T_cur" not in at:
        return f"{here}: not a whole number (a count or a period)"
    return None


def _dry_run(saved: Mapping[str, Any], scheduler: Any) -> list[str]:
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is None:
        return []
    stub = _StubOptimizer(optimizer)
    try:
        trial = copy.deepcopy(scheduler, memo={id(optimizer): stub})
    except Exception:  # noqa: BLE001 - a scheduler that cannot be copied: the install's transaction undoes it
        return []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trial.load_state_dict(copy.deepcopy(dict(saved)))
            if isinstance(trial, torch.optim.lr_scheduler.ReduceLROnPlateau):
                best = trial.best
                trial.step(best if isinstance(best, (int, float)) and math.isfinite(best) else 0.0)
            else:
                trial.step()
    except Exception as e:  # noqa: BLE001 - the scheduler's own refusal, whatever its type
        return [f"it refuses the state ({type(e).__name__}: {e})"]
    bad = [f"param group {i}: lr = {describe(g.get('lr'))}" for i, g in enumerate(stub.param_groups)
           if not _finite_non_negative(g.get("lr"))]
    return [f"after one step from it, {', '.join(bad)}: not a finite, non-negative learning rate"] if bad else []


def _finite_non_negative(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and bool(torch.isfinite(value).all()) and float(value) >= 0
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


# ---------------------------------------------------------------------------- the digest
#: How deep ``_fingerprint`` goes: deeper than anything the strict reader (64) or the typed JSON (100)
#: builds, or than the live values a checked state is shaped like.
_FINGERPRINT_DEPTH = 128


def _fingerprint(value: Any, tensors: dict[int, str], depth: int = 0) -> str:
    """``value``'s canonical text: containers in order (dicts by their keys' text, sets by their items'),
    tensors by dtype, shape and the CRC-32 of their bytes (each tensor moved to the host once:
    ``tensors``, by id), floats exactly, anything else by type and ``repr`` (the strict reader and the
    typed JSON build nothing whose ``repr`` holds an address). ``depth``: the containers around it.

    Raises:
        CheckpointError: containers nested deeper than ``_FINGERPRINT_DEPTH`` (no recursion on that).
    """
    if isinstance(value, Whole):
        value = value.tensor
    if isinstance(value, torch.Tensor):
        if id(value) not in tensors:
            t = value.detach().to("cpu").contiguous()
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            tensors[id(value)] = f"T{t.dtype}{tuple(t.shape)}{zlib.crc32(data)};"
        return tensors[id(value)]
    if isinstance(value, (Mapping, set, frozenset, list, tuple)) and depth >= _FINGERPRINT_DEPTH:
        raise CheckpointError(f"a value the ranks compare before loading (hyperparameters, step counters, scheduler) "
                              f"nests containers more than {_FINGERPRINT_DEPTH} deep; refused.")
    depth += 1
    if isinstance(value, Mapping):
        items = sorted((_fingerprint(k, tensors, depth), _fingerprint(v, tensors, depth)) for k, v in value.items())
        return "{" + "".join(k + ":" + v for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + "".join(sorted(_fingerprint(v, tensors, depth) for v in value)) + "}s"
    if isinstance(value, (list, tuple)):
        return ("[" if isinstance(value, list) else "(") + "".join(_fingerprint(v, tensors, depth) for v in value) + "]"
    if isinstance(value, float):
        return "f" + struct.pack("<d", value).hex() + ";"
    return f"{type(value).__name__}:{value!r};"


def fingerprint(value: Any) -> str:
    """A short digest of ``value`` (``_fingerprint``)."""
    return hashlib.sha256(_fingerprint(value, {}).encode()).hexdigest()[:32]


def _steps(value: Any) -> list[Any]:
    """Every value under a ``step`` key inside ``value`` (a rank-local state dict to fill)."""
    found: list[Any] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            for key, child in item.items():
                (found.append(child) if key == "step" else stack.append(child))
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def digest(staged: Staged, plan: Plan) -> dict[str, str]:
    """What must be equal across a data-parallel group, by part, as fingerprints: the hyperparameters,
    the step counters, the loss scaler, the scheduler and the replicated tensors' checksums."""
    parts: dict[str, Any] = {}
    opt = staged.optimizer
    if opt is not None:
        parts["hyperparameters"] = [group_hyperparameters(g) for g in opt.groups]
        parts["step counters"] = {name: {k: opt.state[name][k] for k in plan.counters.get(name, [])}
                                  for name in sorted(opt.state) if plan.counters.get(name)}
        parts["master weights"] = opt.masters is not None  # (their publication is a collective)
        if opt.scaler is not None:
            parts["loss scale"] = opt.scaler
    for name, saved in (("a torch optimizer's state", staged.torch_optimizer and staged.torch_optimizer.state_dict),
                        ("the optimizer's state dict", (staged.fill or {}).get("optimizer"))):
        if isinstance(saved, Mapping):
            groups = saved.get("param_groups")
            parts["hyperparameters"] = ([group_hyperparameters(g) if isinstance(g, Mapping) else g for g in groups]
                                        if isinstance(groups, list) else groups)
            parts["step counters"] = _steps({k: v for k, v in saved.items() if k != "param_groups"})
    if SCHEDULER in staged.objects.states:
        parts["scheduler"] = staged.objects.states[SCHEDULER]
    if staged.replicated:
        parts["replicated tensors"] = staged.replicated
    return {part: fingerprint(value) for part, value in parts.items()}
