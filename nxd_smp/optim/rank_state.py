"""This rank's state of a ``Zero1Optimizer``, a part the optimizer holds (``RankState``): what
``state_dict()`` returns on one rank, the per-parameter view ``opt.state`` shows, and the two halves
of installing a state the load checked (``optim.loading``).

It holds this rank's inner optimizer state (over its flat shards), the param groups'
hyperparameters, the layout it was written with, the DP size and rank, and, with
``use_master_weights_in_ckpt``, the master shards. It loads only on the same rank of the same
layout at the same DP size; nxd_smp's checkpoints move across DP sizes.

``load_state_dict`` runs the one load pipeline (``optim.loading``: read, check, agree, install) with
the rank-local reader: a state dict is one more format it reads. What a refusal advises beyond that
(how a training loop that keeps one rank's optimizer file loads every rank's state) is the loops' to
say: the parts that write such files register a hint here (``add_hint``), so this layer names no
training loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.dtensors import global_offset, local_shape
from ..core.flat_shard import FlatShard
from ..core.layout import BucketLayout, Piece, param_pieces
from .full_state import gather
from .param_groups import index_groups
from .state_fit import is_moment, torch_state_dict

#: The ``format`` of a rank-local state dict (in its ``nxd_smp`` record).
STATE_DICT_FORMAT = "nxd_smp.zero1.rank_local/2"
#: Where a state dict keeps what only nxd_smp reads: a top-level key (torch's distributed state-dict API
#: keeps only ``state`` and ``param_groups``, and needs none of it).
RECORD_KEY = "nxd_smp"
#: A parameter's master weight, beside its optimizer state (``use_master_weights_in_ckpt``).
MASTER_KEY = "master"
#: The loss scaler's state, in the first param group.
SCALER_KEY = "loss_scaler"

#: Advice a refusal adds, by situation: ``"another rank"`` (a state dict of another rank), or
#: ``"format:<format>"`` (a dict of that format, which is not a rank-local state).
_HINTS: dict[str, str] = {}


def add_hint(situation: str, text: str) -> None:
    """Make refusals in ``situation`` (``"another rank"``, or ``"format:<a state dict's format>"``)
    end with ``text``: how the part that registers it loads such a state."""
    _HINTS[situation] = text




def layout_signature(layouts: Sequence[BucketLayout]) -> list[dict[str, Any]]:
    """The buckets as a state dict records them: group, dtype, norm role, sizes."""
    return [
        {
            "group": layout.key.group,
            "dtype": str(layout.key.dtype),
            "tensor_model_parallel": layout.key.role == "split",
            **({"pipeline_shared": True} if layout.key.role == "shared" else {}),
            **({"sequence_parallel": True} if layout.key.sequence_parallel else {}),
            "numels": list(layout.numels),
            "padded_numel": layout.padded_numel,
        }
        for layout in layouts
    ]


def _in_shard(value: torch.Tensor, piece: Piece | None) -> torch.Tensor:
    """The view of shard-shaped ``value`` where ``piece`` lies (empty for None)."""
    return value[:0] if piece is None else value[piece.shard_start:piece.shard_start + piece.param_end
                                                 - piece.param_start]


@dataclass
class ParamState:
    """One managed parameter's optimizer state as this rank holds it: the one model of it that every door
    converts to and from (``state_dict()`` and ``opt.state``, torch's full-state options, nxd_smp's
    checkpoints, the exports; a load's staged state is installed into the buckets by the same walk).

    Attributes:
        bucket: the bucket it lies in.
        piece: where this rank's shard holds it (its flat range, and where that sits in the shard), None
            where the shard holds none of it.
        moments: per key, this rank's range of the moment, 1-D (empty where ``piece`` is None); which keys
            are moments and which counters is ``state_fit.is_moment``'s to say.
        counters: per key, its counters (Adam's ``step``): its own where it keeps them
            (``optim.step_counters``), else its bucket's.
        master: this rank's range of its fp32 master weight, where the state holds it.
    """

    bucket: int
    piece: Piece | None
    moments: dict[str, torch.Tensor]
    counters: dict[str, Any]
    master: torch.Tensor | None = None

    def as_dict(self) -> dict[str, Any]:
        """As torch.optim shows a parameter's state: counters and moments by key, ``master`` beside them."""
        return {**self.counters, **self.moments, **({MASTER_KEY: self.master} if self.master is not None else {})}


class Generation:
    """A count that changes whenever the optimizer's state does (a step, a load): what a saved copy
    stands for. The optimizer and its ``RankState`` hold the same one."""

    def __init__(self) -> None:
        self.value = 0

    def advance(self) -> None:
        self.value += 1


class RankState:
    """This rank's state of a ``Zero1Optimizer``, which holds it: the state dict in torch.optim's shape,
    each parameter's place and counters, and the two halves of installing a checked state. It holds
    every part it reads, given at construction (the optimizer builds it in ``init_zero``), and calls
    nothing back in the optimizer:

    Args:
        inner_step: the inner step (its optimizer over the shards, its per-parameter counters).
        masters: the master weights (``MasterWeights``: their shards; loaded, rebuilt and taken up here).
        layouts: the buckets.
        backend: the data-parallel rank and size, the collectives.
        coordinate: this rank's place in the topology (its tensor- and pipeline-parallel ranks).
        managed: the managed parameters, in layout order.
        param_groups: the optimizer's param groups (the list itself: hyperparameters are installed
            into its dicts).
        mixed_precision: the ``MixedPrecisionConfig``.
        loss_scaler: the ``DynamicLossScaler``, or None.
        gradients: the gradient source (``grad_accum.GradientSource``): a checkpoint's load drops what it
            accumulated since the last step.
        generation: the ``Generation`` the optimizer counts its steps in; an install advances it.
    """

    def __init__(self, *, inner_step: Any, masters: Any, layouts: Sequence[BucketLayout], backend: Any,
                 coordinate: Any, managed: Sequence[torch.Tensor], param_groups: list[dict[str, Any]],
                 mixed_precision: Any, loss_scaler: Any, gradients: Any, generation: Generation):
        self._inner_step = inner_step
        self._masters = masters
        self._layouts = list(layouts)
        self._backend = backend
        self._coordinate = coordinate
        self._managed = list(managed)
        self._param_groups = param_groups
        self._mixed_precision = mixed_precision
        self._loss_scaler = loss_scaler
        self._gradients = gradients
        self.generation = generation
        self._places: list[tuple[int, Piece | None]] | None = None
        self._positions = {index: (layout, position) for layout in self._layouts
                           for position, index in enumerate(layout.param_indices)}
        self._masters_cache: tuple[int, list[torch.Tensor]] | None = None

    # ------------------------------------------------------------------ its parts, as a load reads them
    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The inner optimizer, over this rank's shards."""
        return self._inner_step.inner

    @property
    def inner_shards(self) -> list[torch.Tensor]:
        """The inner optimizer's parameters, one per bucket: the keys of its state."""
        return list(self._inner_step.shards)

    @property
    def managed_params(self) -> list[torch.Tensor]:
        """The managed parameters, in layout order."""
        return self._managed

    @property
    def bucket_layouts(self) -> list[BucketLayout]:
        return self._layouts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's param groups (the list itself)."""
        return self._param_groups

    @property
    def backend(self) -> Any:
        return self._backend

    @property
    def rank(self) -> int:
        return self._backend.rank

    @property
    def world_size(self) -> int:
        return self._backend.world_size

    @property
    def coordinate(self) -> Any:
        """This rank's place in the topology (``optim.topology.Coordinate``)."""
        return self._coordinate

    @property
    def mixed_precision(self) -> Any:
        return self._mixed_precision

    @property
    def loss_scaler(self) -> Any:
        return self._loss_scaler

    def current_masters(self) -> list[torch.Tensor]:
        """The master shards, rebuilt once per state generation where they are rebuilt on demand
        (parameter remainders)."""
        if self._masters_cache is None or self._masters_cache[0] != self.generation.value:
            self._masters_cache = (self.generation.value, self._masters.values())
        return self._masters_cache[1]

    @property
    def masters_in_state(self) -> bool:
        """Whether the state holds the master weights (``use_master_weights_in_ckpt``)."""
        return bool(self._mixed_precision.use_master_weights_in_ckpt)

    # ------------------------------------------------------------------ where each parameter is
    def places(self) -> list[tuple[int, Piece | None]]:
        """Per managed parameter (in layout order): its bucket, and the ``Piece`` of it this rank's shard
        holds (its flat range, where it sits in the shard), None where it holds none. A parameter lies in
        one bucket and a shard is contiguous: at most one piece each."""
        if self._places is None:
            self._places = param_pieces(self._layouts, self._backend.rank)
        return self._places

    def numbers(self) -> dict[int, int]:
        """``id(parameter)`` -> the number torch.optim gives it in state dicts (param-group order)."""
        return {id(p): i for i, p in enumerate(p for g in self._param_groups for p in g["params"])}

    def param_counters(self, index: int) -> dict[str, Any] | None:
        """The inner optimizer's counters (Adam's ``step``) of the ``index``-th managed parameter where
        they are its own, None where they are its bucket's (every parameter stepped alike so far, or on
        XLA): ``optim.step_counters``."""
        return self._inner_step.counters.param_counters(index)

    def param_state(self, index: int, buckets: Sequence[Mapping[str, Any]] | None = None,
                    masters: Sequence[torch.Tensor] | None = None,
                    own: Sequence[Mapping[str, Any] | None] | None = None) -> ParamState:
        """The ``index``-th managed parameter's ``ParamState``, cut from each bucket's state: ``buckets``
        (per bucket, the inner optimizer's state of its shard or a copy of it; None: the live state),
        ``masters`` (per bucket, the master shard or a copy; None: no master in the state) and ``own``
        (per parameter, its own counters or None for its bucket's; None: the live ones). Views of them."""
        b, piece = self.places()[index]
        state = self.inner_optimizer.state.get(self._inner_step.shards[b], {}) if buckets is None else buckets[b]
        counters = {key: value for key, value in state.items() if not is_moment(key, value)}
        counters.update((self.param_counters(index) if own is None else own[index]) or {})
        return ParamState(b, piece, {key: _in_shard(value, piece) for key, value in state.items()
                                     if is_moment(key, value)},
                          counters, None if masters is None else _in_shard(masters[b], piece))

    def param_states(self, buckets: Sequence[Mapping[str, Any]] | None = None,
                     masters: Sequence[torch.Tensor] | None = None,
                     own: Sequence[Mapping[str, Any] | None] | None = None) -> list[ParamState]:
        """Every managed parameter's ``ParamState`` (layout order; ``param_state``)."""
        return [self.param_state(i, buckets, masters, own) for i in range(len(self._managed))]

    # ------------------------------------------------------------------ the state dict
    def state_dict(self) -> dict[str, Any]:
        """This rank's state in torch.optim's shape: ``state`` by parameter number, each entry the inner
        optimizer's state for that parameter (its moments as ``FlatShard``: this rank's flat range, over
        copies of the shards; its own counters), with ``master`` (the master weight's range) under
        ``use_master_weights_in_ckpt``; ``param_groups`` with the hyperparameters (the first group holds
        the loss scaler's state as ``loss_scaler``); and ``nxd_smp``, what a ``torch.save`` of it needs to
        load again (format, DP size and rank, tensor- and pipeline-parallel ranks, layout, precision)."""
        inner = self.inner_optimizer
        copies = [{key: value.detach().clone() for key, value in inner.state.get(shard, {}).items()
                   if isinstance(value, torch.Tensor)} for shard in self._inner_step.shards]
        masters = [master.detach().clone() for master in self._masters.values()] if self.masters_in_state else None
        numbers = self.numbers()
        state: dict[int, dict[str, Any]] = {}
        for param, held in zip(self._managed, self.param_states(copies, masters)):
            start = 0 if held.piece is None else held.piece.param_start
            whole = (tuple(local_shape(param)), tuple(param.shape), global_offset(param))
            entry = {key: value.detach().clone() if key in held.counters else FlatShard(value, start, *whole)
                     for key, value in held.as_dict().items() if isinstance(value, torch.Tensor)}
            if entry:
                state[numbers[id(param)]] = entry
        return {"state": state, "param_groups": self._groups(numbers),
                RECORD_KEY: {"format": STATE_DICT_FORMAT, "world_size": self._backend.world_size,
                             "rank": self._backend.rank,
                             "model_parallel_rank": [self._coordinate.tensor, self._coordinate.pipeline],
                             "mixed_precision": self._mixed_precision.to_dict(),
                             "layout": layout_signature(self._layouts)}}

    def _groups(self, numbers: Mapping[int, int]) -> list[dict[str, Any]]:
        """The param groups as a state dict holds them: hyperparameters, parameter numbers, and in the first
        the loss scaler's state."""
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [numbers[id(p)] for p in g["params"]]}
                  for g in self._param_groups]
        if self._loss_scaler is not None:
            groups[0][SCALER_KEY] = self._loss_scaler.state_dict()
        return groups

    def full_state_dict(self, *, keep: bool = True, cpu: bool = False) -> dict[str, Any]:
        """The whole state in torch.optim's shape, as torch's ``full_state_dict`` option gives it: ``state``
        by parameter number, each parameter's moments (and ``master``) whole in its global shape, gathered
        from every rank's range and joined over its tensor-parallel mesh (``optim.full_state``), its counters;
        ``param_groups`` as ``state_dict()`` holds them; no ``nxd_smp`` record (the state is every rank's).
        Every rank of the job calls it at once. One parameter's tensor is gathered at a time, and moved to
        the host at once with ``cpu`` (the counters and the scaler's state stay where they are, as torch's own
        ``cpu_offload`` then moves them); with ``keep=False`` (torch's ``cpu_offload`` on a rank other than 0)
        this rank takes part in the gathers (each brought to the host, so that on XLA it runs on every rank)
        and keeps none of it: its ``state`` holds the counters only."""
        masters = self._masters.values() if self.masters_in_state else None
        numbers = self.numbers()
        state: dict[int, dict[str, Any]] = {}
        for i, (param, held) in enumerate(zip(self._managed, self.param_states(masters=masters))):
            entry: dict[str, Any] = {}
            for key, value in sorted(held.as_dict().items()):
                if not isinstance(value, torch.Tensor):
                    continue
                if key in held.counters:
                    entry[key] = value.detach().clone()
                    continue
                whole = self._whole(i, value)
                if cpu or not keep:  # (on the host now; on XLA this runs the gather, on every rank alike)
                    whole = whole.cpu()
                if keep:
                    entry[key] = whole
                del whole  # (not kept past the next gather)
            if entry:
                state[numbers[id(param)]] = entry
        return {"state": state, "param_groups": self._groups(numbers)}

    def gathered_masters(self) -> list[torch.Tensor]:
        """Per managed parameter (layout order), its master weight whole over the data-parallel group, shaped
        like the parameter's local part (its tensor-parallel part for a DTensor): one parameter gathered at
        a time (``optim.full_state.gather``). Every rank of the data-parallel group calls it at once."""
        masters = self._masters.values()
        return [self._whole(i, held.master, join=False) for i, held in enumerate(self.param_states(masters=masters))]

    def _whole(self, index: int, value: torch.Tensor, *, join: bool = True) -> torch.Tensor:
        """The ``index``-th managed parameter's tensor whole, from ``value``, this rank's range of it
        (``optim.full_state.gather``; ``join=False``: its tensor-parallel part)."""
        layout, position = self._positions[index]
        return gather(value, layout, position, self._backend, self._managed[index], join=join)

    # ------------------------------------------------------------------ an install, in two halves
    def install(self, state: Mapping[int, Mapping[str, Any]], hyperparameters: Sequence[Mapping[str, Any]],
                scaler_state: Any = None, counters: Sequence[Mapping[str, Any] | None] | None = None
                ) -> Callable[[], None]:
        """The first half of an install, of a state the load's check passed: the inner
        optimizer's state by bucket (its tensors become the optimizer's own), each managed parameter's
        ``counters`` (None: its bucket's), each param group's ``hyperparameters`` (over the live group;
        kernel options stay the live ones), the loss scaler's state. Local to this rank; returns the
        undo (the old objects put back: torch's ``load_state_dict`` replaces ``state`` and
        ``param_groups`` with new ones)."""
        inner, scaler = self.inner_optimizer, self._loss_scaler
        before = (inner.state, inner.param_groups, [dict(g) for g in self._param_groups],
                  None if scaler is None else scaler.state_dict())
        counters_before = self._inner_step.counters.snapshot()

        def undo() -> None:
            counters_before()
            inner.__dict__.update(state=before[0], param_groups=before[1])
            for group, old in zip(self._param_groups, before[2]):
                group.clear()
                group.update(old)
            if before[3] is not None:
                scaler.load_state_dict(before[3])

        try:
            bucket_of = {id(shard): b for b, shard in enumerate(self._inner_step.shards)}
            ids = index_groups([len(g["params"]) for g in inner.param_groups])
            by_id = {i: state[bucket_of[id(p)]] for g, numbers in zip(inner.param_groups, ids)
                     for i, p in zip(numbers, g["params"]) if bucket_of[id(p)] in state}
            loaded = torch_state_dict(inner.param_groups, hyperparameters, by_id)
            inner.load_state_dict(loaded)
            self._inner_step.counters.load(counters or [None] * len(self._managed))
            for group, installed in zip(self._param_groups, loaded["param_groups"]):
                group.update({k: v for k, v in installed.items() if k != "params"})
            if scaler_state is not None:
                scaler.load_state_dict(scaler_state)
        except BaseException:
            undo()
            raise
        return undo

    def finish(self, masters: Sequence[torch.Tensor] | None, *, rebuild: bool = True,
               discard_gradients: bool = True) -> None:
        """The second half, once every rank agreed (the masters' publication is a collective): the
        master shards published into the parameters; without them (under master weights) the masters
        are rebuilt from the current parameters now (``rebuild``), or else at the next step from those
        loaded by then, with a warning that precision below the parameter dtype was lost.
        ``discard_gradients``: drop the gradients accumulated since the last step (a checkpoint's load
        does; ``load_state_dict`` keeps them, as torch's optimizers do)."""
        if discard_gradients:
            self._gradients.zero_grad(True)
        self.generation.advance()
        if not self._mixed_precision.use_master_weights:
            return
        if masters is not None:
            self._masters.load(masters)
            return
        if rebuild:
            self._masters.rebuild(list(range(len(self._managed))), only_changed_values=False)
        warnings.warn(
            "the loaded state has no master weights: they were rebuilt from the parameters "
            + ("loaded" if rebuild else "you load into the model (before or after this call), at the next step")
            + ", so precision below the parameter dtype is lost. Save with use_master_weights_in_ckpt=True to "
            "keep it.", stacklevel=4)


class ParamStates(Mapping):
    """``Zero1Optimizer.state``: per managed parameter, its state as this rank holds it
    (``RankState.param_state``), read-only. It is never empty once the optimizer is built: torch's
    ``_init_optim_state`` (``get_optimizer_state_dict``) steps an optimizer whose ``state`` is empty to
    create one.

    Args:
        held: the optimizer's ``RankState``, or None for an optimizer not built yet (``lazy_init``: empty).
    """

    def __init__(self, held: RankState | None = None):
        self._held = held
        self._index = {} if held is None else {id(p): (i, p) for i, p in enumerate(held.managed_params)}

    def _find(self, param: Any) -> tuple[RankState, int]:
        found = self._index.get(id(param))
        if self._held is None or found is None or found[1] is not param:
            raise KeyError(param)
        return self._held, found[0]

    def __getitem__(self, param: Any) -> dict[str, Any]:
        held, index = self._find(param)
        return held.param_state(index, masters=held.current_masters() if held.masters_in_state else None).as_dict()

    def __iter__(self):
        return iter([] if self._held is None else list(self._held.managed_params))

    def __len__(self) -> int:
        return 0 if self._held is None else len(self._held.managed_params)

    def __setitem__(self, param: Any, value: Any) -> None:
        """Accept what a framework writes back unchanged (Lightning moves every state tensor ``.to`` its
        device, which returns the same tensors where they are already there); refuse anything else."""
        mine = self[param]
        if isinstance(value, Mapping) and set(value) == set(mine) and all(
                value[k] is v or (isinstance(v, torch.Tensor) and isinstance(value[k], torch.Tensor)
                                  and value[k].data_ptr() == v.data_ptr() and value[k].shape == v.shape
                                  and value[k].dtype == v.dtype and value[k].device == v.device)
                for k, v in mine.items()):
            return
        raise TypeError("Zero1Optimizer.state is a read-only view of this rank's shards: load a state with "
                        "load_state_dict (or nxd_smp.checkpoint), which checks it.")


class _StateLoaded:
    def __repr__(self) -> str:
        return "nxd_smp.zero1_optimizer.STATE_LOADED"


#: A ``load_state_dict`` pre-hook returns this when it has installed the state itself (from a
#: checkpoint the dict it was given refers to): nothing more is loaded.
STATE_LOADED = _StateLoaded()


def hint(situation: str) -> str:
    """The advice registered for ``situation`` (``add_hint``), with a leading space; empty if none."""
    text = _HINTS.get(situation)
    return f" {text}" if text else ""
