"""The one pipeline every load goes through, whatever its format and entry point: **read** (a
format's reader: bytes to a neutral staged state, ``staged``) -> **check** (``check``: against the
live objects) -> **agree** (``backend.agreement.agree``: a world-wide verdict, and a digest compared
within each data-parallel group) -> **install** (``install``: one transaction).

The formats that read files sit above, in ``nxd_smp.checkpointing`` (``pipeline``: the folder formats,
registered there). Entry points hand ``run`` a reader and their targets:

* ``load_checkpoint`` (every registered format; rank 0 decides which checkpoint a path means);
* ``Zero1Optimizer.load_state_dict`` and ``check_state_dict`` (``load_rank_state``, reading with
  ``read_rank_state``: its own rank-local state dict);
* ``load_full_optimizer_state`` and the imports of other tools' files (``full_state``: whole
  per-parameter tensors: NxD's folders, ``import_xla``, ``import_torch``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ...backend.agreement import agree, settle
from ...core.dtensors import global_offset
from ...core.errors import CheckpointError
from ...core.flat_shard import FlatShard
from ...core.progress import phases
from .. import rank_state
from ..rank_state import MASTER_KEY, RECORD_KEY, SCALER_KEY, STATE_DICT_FORMAT, layout_signature
from ..state_fit import describe, is_moment, torch_group_problems
from .check import check, digest
from .install import commit, install, publish
from .staged import Pieces, Request, Staged, StagedModel, StagedOptimizer, Targets, Whole, canonical_name, known_names

log = logging.getLogger("nxd_smp.checkpoint")

Reader = Callable[[Request], Staged]


# ---------------------------------------------------------------------------- the four stages
def run(read: Reader, targets: Targets, *, what: str, progress: bool | None = False) -> Staged:
    """Read (this rank's part, through ``read``), check, agree (every rank of the job), install; every
    rank calls it. Returns the staged state (its ``extra`` is what ``load_checkpoint`` returns).

    After the agreement only the model's own ``load_state_dict`` (its hooks: a framework's may refuse)
    can still fail; every rank learns of it before the master weights are published (``settle``).

    Raises:
        CheckpointError: on every rank, when any rank's read or check refused, or the ranks of a
            data-parallel group would install different values; nothing is changed then. Or, on every
            rank, when the model's ``load_state_dict`` failed on one: the optimizer and the objects are
            put back, the model's weights may be partly loaded (the error says to load again).
    """
    backend = targets.backend
    with phases(progress, backend.rank, ["read and check", "install"], f"load {Path(what).name}", log) as advance:

        def prepare() -> tuple[tuple[Staged, Any, Callable[[], None]], Callable[[], None], dict[str, str]]:
            staged = read(targets.request())
            plan = check(staged, targets)
            fingerprints = digest(staged, plan)  # (before the install: nothing after it may fail here)
            undo = install(staged, plan, targets)
            return (staged, plan, undo), undo, fingerprints

        staged, plan, undo = agree(backend.world_coordinator, prepare, what=what, group=targets.group())
        advance("read and check")
        masters = settle(backend.world_coordinator, lambda: commit(staged, plan, targets), what=f"loading {what}",
                         undo=undo, consequence=_PARTLY_LOADED if isinstance(targets.model, nn.Module) else "")
        publish(masters, targets)
        advance("install")
    return staged


#: What a failure after the agreement leaves, in its error.
_PARTLY_LOADED = ("The optimizer's state and the other objects were put back on every rank, but the model's weights "
                  "may be partly loaded: load the checkpoint again (every rank) before training on.")


# ---------------------------------------------------------------------------- whole per-parameter state
def full_state(state: Any, hyperparameters: Any, masters: Any, *, source: str) -> StagedOptimizer:
    """An optimizer state of whole per-parameter tensors (``{name: {key: tensor or number}}``, one dict of
    hyperparameters per live param group, masters ``{name: tensor}`` or None) as the staged state: what
    NxD's folders, torch_xla's files, DCP imports and ``load_full_optimizer_state`` give. Its structure
    is checked here; its fit, by the check.

    Raises:
        CheckpointError: not ``{name: {key: value}}`` with a list of groups.
    """
    if not isinstance(state, Mapping) or not isinstance(hyperparameters, (list, tuple)) or not (
            masters is None or isinstance(masters, Mapping)) or not all(isinstance(h, Mapping) for h in hyperparameters):
        raise CheckpointError(f"{source}: the optimizer state is not {{name: {{key: tensor}}}} with a list of param "
                              f"groups.")
    staged = {}
    for name, entry in state.items():
        if not isinstance(entry, Mapping):
            staged[name] = entry  # (the check names it)
            continue
        staged[name] = {key: Whole(value) if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
    return StagedOptimizer(
        groups=[{k: v for k, v in h.items() if k not in ("params", "param_names")} for h in hyperparameters],
        state=staged,
        masters=None if masters is None else {name: Whole(value) if isinstance(value, torch.Tensor) else value
                                              for name, value in masters.items()},
        source=source)


# ---------------------------------------------------------------------------- the rank-local state dict
def read_rank_state(targets: Targets, state_dict: Any, request: Request) -> Staged:
    """``Zero1Optimizer.state_dict()``'s dict as the staged state: torch.optim's shape, its ``state``
    keyed by parameter number or, as torch's distributed state-dict API hands it back
    (``set_optimizer_state_dict``), by name; each group's ``params`` lists its parameters in the
    optimizer's order. Each moment and master is this rank's range of its parameter: a ``FlatShard``,
    which says which range (what ``dcp.load`` filled in place, from any DP size), or a plain 1-D tensor
    (a ``torch.save``d copy), which only the state dict's ``nxd_smp`` record of the same rank, DP size
    and layout places; or the whole tensor (torch's ``set_optimizer_state_dict`` with
    ``full_state_dict=True`` hands every rank the whole per-parameter state), sliced on arrival, at any
    DP and TP size. The loss scaler's state is the first group's ``loss_scaler``.

    Raises:
        CheckpointError: not such a dict, a range this rank does not hold (another rank's, another DP
            size's), naming the fix.
    """
    source = "the state dict"
    optimizer = targets.rank_state
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping) \
            or not isinstance(state_dict.get("param_groups"), list):
        found = state_dict.get("format") if isinstance(state_dict, Mapping) else None
        raise CheckpointError("not a Zero1Optimizer state dict (no 'state' and 'param_groups' as torch.optim writes "
                              "them); pass what Zero1Optimizer.state_dict() returned."
                              + (rank_state.hint(f"format:{found}") if isinstance(found, str) else ""))
    groups = state_dict["param_groups"]
    live_groups = optimizer.param_groups
    problems = []
    name_of: dict[Any, str] = {}
    if len(groups) != len(live_groups) or not all(isinstance(g, Mapping) for g in groups):
        problems.append(f"{len(groups)} param groups, the optimizer has {len(live_groups)}")
    else:
        found, name_of = _key_names(groups, live_groups, request.optimizer.groups,
                                    known_names(targets.model, optimizer))
        problems += found
    if optimizer.loss_scaler is not None and groups and isinstance(groups[0], Mapping) and SCALER_KEY not in groups[0]:
        problems.append(f"no loss scaler state (the first param group's {SCALER_KEY!r}), which this optimizer's scaler "
                        f"needs: a state saved without a loss scaler, or one that went through torch's "
                        f"flatten_optimizer_state_dict, which drops it on the set side (use the nested layout)")
    record = state_dict.get(RECORD_KEY)
    placed_by_record = isinstance(record, Mapping) and record.get("format") == STATE_DICT_FORMAT
    if placed_by_record:
        here = optimizer.coordinate
        problems += [f"{key} {describe(record.get(key))} (this optimizer: {mine})"
                     for key, mine in (("world_size", optimizer.world_size), ("rank", optimizer.rank),
                                       ("model_parallel_rank", [here.tensor, here.pipeline]))
                     if record.get(key) != mine or isinstance(record.get(key), bool)]
        if record.get("layout") != layout_signature(optimizer.bucket_layouts):
            problems.append("bucket layout (parameters, shapes, dtypes, groups or bucket size differ)")
    elif record is not None:
        problems.append(f"the {RECORD_KEY!r} record {describe(record)} is not one of format {STATE_DICT_FORMAT!r}")
    if problems:
        raise CheckpointError(
            "this state dict does not fit the optimizer: " + "; ".join(problems) + ". A state dict loads into the "
            "same model and param groups; with plain tensors (a torch.save'd copy) at the same DP size and rank; "
            "torch.distributed.checkpoint (dcp.save/dcp.load) or nxd_smp.checkpoint move across DP sizes."
            + (rank_state.hint("another rank") if placed_by_record and record.get("rank") != optimizer.rank else ""))
    names = request.optimizer.names  # (param-group order: the order of the groups' ``params``)
    param_of = dict(zip(targets.names, optimizer.managed_params))
    state: dict[str, dict[str, Any]] = {name: {} for name in names}
    masters: dict[str, Pieces | Whole] = {}
    bad = []
    for key, entry in state_dict["state"].items():
        name = name_of.get(key) if isinstance(key, (int, str)) and not isinstance(key, bool) else None
        if name is None or not isinstance(entry, Mapping):
            bad.append(f"a state for {describe(key)}, which no param group lists" if name is None
                       else f"the state of {name} is a {type(entry).__name__}, not a dict")
            continue
        for field, value in entry.items():
            if not isinstance(field, str) or not isinstance(value, torch.Tensor):
                bad.append(f"{name}/{describe(field)} is a {type(value).__name__}, not a tensor")
                continue
            if not is_moment(field, value) and not isinstance(value, FlatShard):
                found: Whole | Pieces | str = Whole(value)  # (a counter, or a 0-dim parameter's whole moment)
            else:
                found = _range_of(value, request.optimizer, name, param_of[name], placed_by_record)
            if isinstance(found, str):
                bad.append(f"{name}/{field}: {found}")
            elif field == MASTER_KEY:
                masters[name] = found
            else:
                state[name][field] = found
    if bad:
        raise CheckpointError(f"{source} does not fit the optimizer: " + "; ".join(bad) + ".")
    scaler = groups[0].get(SCALER_KEY) if optimizer.loss_scaler is not None else None
    staged = StagedOptimizer(groups=[{k: v for k, v in g.items() if k not in ("params", SCALER_KEY)} for g in groups],
                             state=state, masters=masters or None, scaler=scaler, source=source)
    return Staged(source=source, optimizer=staged)


def _key_names(groups: list, live_groups: list, request_groups: list[list[str]],
               live_names: list[list[str]] | None) -> tuple[list[str], dict[Any, str]]:
    """How the state dict's keys name the live parameters (``request_groups``: their names as the request
    gives them, group by group), and what does not fit. Named keys (torch's distributed state-dict API's
    FQNs) map by name where the optimizer's parameters' names are known (``live_names``: from the model,
    or from the ``param_names`` the optimizer was built with): a name no parameter has, or that the
    optimizer holds in another group, is refused by name, never taken for the parameter at its place.
    Numbered keys (torch.optim's 0..n-1 in group order) map by position, and where the state dict's
    groups carry ``param_names`` and the live names are known, those names must be the live ones in
    order. Without live names, both map by position (as torch.optim's own ``load_state_dict`` does),
    each entry then checked against its parameter's shape and place."""
    keys = [g.get("params") for g in groups]

    def by_position() -> dict[Any, str]:  # (once the keys are known to be lists of numbers or names)
        return {key: name for k, names_g in zip(keys, request_groups) for key, name in zip(k, names_g)}

    if all(isinstance(k, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in k) for k in keys):
        problems = torch_group_problems(list(groups), live_groups, "param_groups")
        if not problems and live_names is not None:
            for i, (group, live) in enumerate(zip(groups, live_names)):
                saved = group.get("param_names")
                if isinstance(saved, list) and [canonical_name(n) if isinstance(n, str) else n for n in saved] \
                        != [canonical_name(n) for n in live]:
                    differ = [f"{s!r} for {n!r}" for s, n in zip(saved, live) if s != n][:4]
                    problems.append(f"param_groups[{i}]['param_names'] names other parameters than the optimizer's, "
                                    f"in order ({'; '.join(differ) or f'{len(saved)} names for {len(live)}'}): a "
                                    f"numbered state maps by position only onto the parameters it was saved for")
        return problems, ({} if problems else by_position())
    problems = []
    for i, (k, live) in enumerate(zip(keys, live_groups)):
        if not isinstance(k, list) or not all(isinstance(n, str) for n in k):
            problems.append(f"param_groups[{i}]['params'] = {describe(k)}, not the names or numbers of the group's "
                            f"parameters")
    flat = [n for k in keys if isinstance(k, list) for n in k]
    if not problems and len(set(flat)) != len(flat):
        problems.append("a parameter listed twice in param_groups")
    if problems:
        return problems, {}
    if live_names is None:
        problems = [f"param_groups[{i}]['params'] lists {len(k)} names, the optimizer's group has "
                    f"{len(live['params'])} parameters"
                    for i, (k, live) in enumerate(zip(keys, live_groups)) if len(k) != len(live["params"])]
        return problems, ({} if problems else by_position())
    where = {canonical_name(n): (g, name) for g, (live, names_g) in enumerate(zip(live_names, request_groups))
             for n, name in zip(live, names_g)}
    name_of: dict[Any, str] = {}
    for i, k in enumerate(keys):
        for n in k:
            found = where.get(canonical_name(n))
            if found is None:
                problems.append(f"param_groups[{i}] names {n!r}, which is no parameter of the optimizer's")
            elif found[0] != i:
                problems.append(f"param_groups[{i}] names {n!r}, which the optimizer holds in param group {found[0]}")
            else:
                name_of[n] = found[1]
    listed = {canonical_name(n) for n in flat}
    lacking = [n for live in live_names for n in live if canonical_name(n) not in listed]
    if lacking:
        problems.append(f"param_groups list none of the optimizer's parameters {lacking[:8]}"
                        + (f" and {len(lacking) - 8} more" if len(lacking) > 8 else ""))
    return problems, name_of


def _range_of(value: torch.Tensor, request: Any, name: str, param: torch.Tensor, placed_by_record: bool
              ) -> Pieces | str:
    """``value``, one moment or master of parameter ``name`` (the live ``param``), as the ``Pieces`` this
    rank installs: a ``FlatShard`` of this rank's range of this rank's part (its place in the whole tensor
    included: a tensor-parallel peer's is another part); (``placed_by_record``) a plain 1-D tensor as
    long as this rank's range; or the whole tensor, of the parameter's global shape, sliced on arrival
    (this rank's part of it, then its range of that: what torch's ``set_optimizer_state_dict`` hands
    over with ``full_state_dict=True``, a consolidated state); else what is wrong."""
    shape = request.shapes[name]
    slots = request.slots.get(name, [])
    wanted = (slots[0].start, slots[0].end) if slots else None
    held = wanted[1] - wanted[0] if wanted else 0
    if isinstance(value, FlatShard):
        where = (tuple(value.shape), value.global_offset)
        if value.local_shape != tuple(shape) or where != (tuple(param.shape), global_offset(param)):
            return (f"a range of a part {value.local_shape} at {value.global_offset} of a tensor {tuple(value.shape)}, "
                    f"this rank's part is {tuple(shape)} at {global_offset(param)} of {tuple(param.shape)}")
        start, data = value.start, value.local
        if (start, value.end) != (wanted or (start, start)):
            return (f"elements [{start}, {value.end}), this rank holds "
                    + (f"[{wanted[0]}, {wanted[1]})" if wanted else "none") + " (another rank's or DP size's state)")
    elif value.dim() > 0 and tuple(value.shape) == tuple(param.shape):  # (a 1-D range as long: the same elements)
        part = value[tuple(slice(o, o + n) for o, n in zip(global_offset(param), shape))]
        data = part.reshape(-1)[wanted[0]:wanted[1]] if wanted else part.reshape(-1)[:0]
    elif placed_by_record and value.dim() == 1:
        data = value
        if value.numel() != held:
            return f"{value.numel()} elements, this rank holds {held} of it"
    else:
        return (f"a plain tensor of shape {tuple(value.shape)}: neither the parameter's whole tensor "
                f"{tuple(param.shape)} nor, in a state dict of this rank's own record, its range of it (pass what "
                f"state_dict() returned, or the whole per-parameter state)")
    if not data.dtype.is_floating_point:
        return f"{data.dtype}, not a floating dtype"
    return Pieces(tuple(shape), data.dtype, {wanted[0]: data} if wanted else {})


def load_rank_state(optimizer: Any, state_dict: Any, *, install: bool) -> None:
    """``Zero1Optimizer.load_state_dict`` (``install``: the one pipeline with the rank-local reader; every
    rank calls it) and ``check_state_dict`` (not: read and checked on this rank alone, nothing installed,
    no communication)."""
    targets = Targets(model=None, optimizer=optimizer, objects={}, backend=optimizer.backend,
                      rebuild_masters=False, discard_gradients=False)
    if install:
        run(lambda request: read_rank_state(targets, state_dict, request), targets, what="its state dict")
    else:
        check(read_rank_state(targets, state_dict, targets.request()), targets)


def load_together(model: nn.Module, optimizer: Any, model_state: Mapping[str, Any] | None, state_dict: Any,
                  *, what: str, strict: bool = True) -> None:
    """A model's state dict and its optimizer's (``state_dict()``'s layout: this rank's ranges, or each
    parameter's whole tensors, sliced on arrival at any DP size) installed together: read, checked, agreed
    on by every rank and installed in one transaction, so a state that does not fit changes neither the
    model nor the optimizer. ``model_state`` None: the optimizer's alone; ``strict`` as
    ``nn.Module.load_state_dict``'s. Every rank calls it.

    Raises:
        CheckpointError: the state does not fit the model or the optimizer, on any rank; naming how.
    """
    targets = Targets(model=model if model_state is not None else None, optimizer=optimizer, objects={},
                      backend=optimizer.backend, strict=strict)

    def read(request: Request) -> Staged:
        staged = read_rank_state(targets, state_dict, request)
        if model_state is not None:
            tensors = {key: value for key, value in model_state.items() if isinstance(value, torch.Tensor)}
            staged.model = StagedModel({key: (tuple(value.shape), value.dtype) for key, value in tensors.items()},
                                       {key: value for key, value in tensors.items()
                                        if key in (request.model_keys or ())}, what)
        return staged

    run(read, targets, what=what)
