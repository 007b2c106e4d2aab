"""The install: one transaction over the model, the optimizer, the loss scaler, the scheduler and the
caller's stateful objects, of a state the check passed (``check.Plan``).

It runs in three parts around the ranks' agreements (``run``):

* ``install`` (before ``agree``, on every rank): what can be put back cheaply: each stateful object's
  state (its ``state_dict()`` copied first; a refusal puts back every object loaded so far, the refusing
  one included), the optimizer's hyperparameters, its inner state over the new shards and the loss
  scaler's state (the old objects kept, not copied). It returns the undo, which the agreement runs
  on every rank if any rank refused.
* ``commit`` (after it, then ``settle``): the local work that would cost a copy of the model to undo:
  the model's weights copied in place (through the model's own ``load_state_dict`` and its hooks), the
  dicts NxD Training passes filled, the master shards built from the staged pieces. The check left it
  nothing to fail on that a file or a dict can cause; what is left (a model hook's own refusal) is
  settled across the ranks before anything collective runs.
* ``publish`` (once every rank committed): the master weights published into the parameters (a
  collective) or rebuilt from them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
import torch.nn as nn

from ...core.dtensors import like_live
from ...core.errors import CheckpointError
from ..state_fit import torch_state_dict
from .check import Plan
from .staged import Pieces, Slot, Staged, StagedOptimizer, Targets, Whole


def install(staged: Staged, plan: Plan, targets: Targets) -> Callable[[], None]:
    """The reversible part of the install; returns its undo.

    Raises:
        CheckpointError: an object refused its state (every object is put back first).
    """
    undos: list[Callable[[], None]] = []

    def undo() -> None:
        for step in reversed(undos):
            step()

    try:
        undos.append(load_objects(targets.objects, staged))
        if targets.rank_state is not None:
            undos.append(targets.rank_state.install(
                _bucket_state(staged.optimizer, plan, targets), [g for g in staged.optimizer.groups],
                staged.optimizer.scaler if targets.rank_state.loss_scaler is not None else None,
                _param_counters(staged.optimizer, plan, targets)))
        elif isinstance(targets.optimizer, torch.optim.Optimizer) and staged.torch_optimizer is not None:
            undos.append(_install_torch_optimizer(targets.optimizer, staged.torch_optimizer.state_dict))
    except BaseException:
        undo()
        raise
    return undo


def commit(staged: Staged, plan: Plan, targets: Targets) -> list[torch.Tensor] | None:
    """The local part after the agreement: the model's weights, the dicts to fill, the master shards built
    (returned for ``publish``; None where none were read)."""
    model = targets.model
    if isinstance(model, nn.Module) and plan.model_state is not None:
        live = model.state_dict()  # (DTensors take their parts back as DTensors)
        state = {key: like_live(value if value.dtype == live[key].dtype else value.to(live[key].dtype), live[key])
                 for key, value in plan.model_state.items()}
        with torch.no_grad():
            model.load_state_dict(state, strict=targets.strict)  # copies in place: views stay views
    if staged.fill is not None:
        for target, name in ((model, "model"), (targets.optimizer, "optimizer")):
            if isinstance(target, MutableMapping) and staged.fill.get(name) is not None:
                target.update(staged.fill[name])  # NxD's way: every saved entry set, in place
    return _masters(staged.optimizer, targets) if targets.rank_state is not None else None


def publish(masters: list[torch.Tensor] | None, targets: Targets) -> None:
    """Once every rank committed: the master shards published into the parameters (a collective), or the
    masters rebuilt from the loaded parameters; the accumulated gradients dropped (a checkpoint's load)."""
    held = targets.rank_state
    if held is not None:
        held.finish(masters, rebuild=targets.rebuild_masters, discard_gradients=targets.discard_gradients)


# ---------------------------------------------------------------------------- stateful objects
def load_objects(objects: Mapping[str, Any], staged: Staged) -> Callable[[], None]:
    """Load each of ``objects`` (a scheduler, a sampler, ...) with its state in ``staged.objects``, each one's
    state copied before; if one refuses, every object loaded so far and the refusing one are put back, and a
    ``CheckpointError`` names it and the file. Returns the undo (put every object back)."""
    states, source = staged.objects.states, staged.objects_source
    done: list[tuple[str, Any, Any]] = []

    def undo() -> None:
        failed = []
        for name, obj, before in reversed(done):
            try:
                obj.load_state_dict(before)
            except Exception as e:  # noqa: BLE001 - each object is put back, whatever one of them says
                failed.append(f"{name} ({type(e).__name__}: {e})")
        if failed:
            raise CheckpointError(f"{source}: putting back the state of {', '.join(failed)} failed; those objects "
                                  f"are in an unknown state.")

    for name, obj in objects.items():
        before = copy.deepcopy(obj.state_dict())
        done.append((name, obj, before))  # (before its load: a refusing object is put back too)
        try:
            obj.load_state_dict(copy.deepcopy(states[name]))
        except Exception as e:  # noqa: BLE001 - any refusal of the object's own
            undo()
            raise CheckpointError(f"{source}: {name} refused its saved state: {type(e).__name__}: {e}") from e
    return undo


# ---------------------------------------------------------------------------- the optimizer
@torch.no_grad()
def _shard(staged: StagedOptimizer, key: str | None, values: Mapping[str, Any], b: int, numel: int,
           dtype: torch.dtype, slots: list[tuple[str, Slot]]) -> torch.Tensor:
    """Bucket ``b``'s shard of ``key`` (None: the master weights) on this rank: the staging buffer the
    reader filled where there is one, else a new one of ``numel`` elements with each parameter's slots of
    it (``OptimizerRequest.bucket_slots``) copied in (zeros for padding and for parameters without state;
    no autograd history, whatever a caller's tensor carries)."""
    if key in staged.staging:
        return staged.staging[key][b]
    buffer = torch.zeros(numel, dtype=dtype)
    for name, slot in slots:
        value = values.get(name)
        if isinstance(value, Pieces):
            source = value.parts[slot.start]
        elif isinstance(value, Whole):
            source = value.tensor.reshape(-1)[slot.start:slot.end]
        else:
            continue
        buffer[slot.shard_start:slot.shard_start + slot.end - slot.start].copy_(source)
    return buffer


def _bucket_state(staged: StagedOptimizer, plan: Plan, targets: Targets) -> dict[int, dict[str, Any]]:
    """The inner optimizer's state per bucket shard: each moment a shard built from the parameters'
    pieces, each counter from the bucket's first parameter with state (each parameter's own counters
    are installed beside it: ``_param_counters``; a parameter without state,
    which got no gradient in the saved run, starts from zero moments with its bucket's count; a
    bucket none of whose parameters has state takes its group's, or any parameter's, count)."""
    held, request = targets.rank_state, targets.request().optimizer
    names, slots = targets.names, request.bucket_slots()
    group_of_param = {id(p): g for g, group in enumerate(held.param_groups) for p in group["params"]}
    group_of = {name: group_of_param[id(p)] for name, p in zip(names, held.managed_params)}
    with_state = [name for name in names if staged.state.get(name)]
    state: dict[int, dict[str, Any]] = {}
    for b, layout in enumerate(held.bucket_layouts):
        mine = [names[i] for i in layout.param_indices]
        source = next((n for n in mine if staged.state.get(n)), None) \
            or next((n for n in with_state if group_of[n] == group_of[mine[0]]), None) \
            or (with_state[0] if with_state else None)
        if source is None:
            continue
        entry = _saved_counters(staged, plan, source)
        for key in plan.moments.get(source, []):
            values = {name: staged.state[name].get(key) for name, _ in slots[b] if staged.state.get(name)}
            entry[key] = _shard(staged, key, values, b, request.shard_numels[b], request.shard_dtypes[b], slots[b])
        state[b] = entry
    return state


def _param_counters(staged: StagedOptimizer, plan: Plan, targets: Targets) -> list[dict[str, Any] | None]:
    """Each managed parameter's counters (Adam's ``step``) as saved, None for a parameter without
    state (its bucket's where every other count is equal, else a fresh state at its next step, as
    torch.optim's): every parameter keeps its own count, as torch.optim's do."""
    return [_saved_counters(staged, plan, name) if staged.state.get(name) else None for name in targets.names]


def _saved_counters(staged: StagedOptimizer, plan: Plan, name: str) -> dict[str, Any]:
    """Parameter ``name``'s saved counters (the keys the check found counters), copies of its tensors."""
    entry: dict[str, Any] = {}
    for key in plan.counters.get(name, []):
        value = staged.state[name][key]
        value = value.tensor if isinstance(value, Whole) else value
        entry[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return entry


def _masters(staged: StagedOptimizer | None, targets: Targets) -> list[torch.Tensor] | None:
    """The master shards per bucket from the staged master weights, or None (rebuilt from the
    parameters) where none were read or the optimizer keeps none."""
    held = targets.rank_state
    if staged is None or staged.masters is None or not held.mixed_precision.use_master_weights:
        return None
    request = targets.request().optimizer
    return [_shard(staged, None, staged.masters, b, numel, torch.float32, slots)
            for b, (numel, slots) in enumerate(zip(request.shard_numels, request.bucket_slots()))]


def _install_torch_optimizer(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> Callable[[], None]:
    """A plain torch optimizer's checked state installed (the live kernel options kept); returns the undo
    (torch's ``load_state_dict`` replaces ``state`` and ``param_groups`` with new objects: the old ones
    are put back)."""
    before = (optimizer.state, optimizer.param_groups)
    optimizer.load_state_dict(torch_state_dict(optimizer.param_groups, saved["param_groups"], saved["state"]))

    def undo() -> None:
        optimizer.__dict__.update(state=before[0], param_groups=before[1])

    return undo
