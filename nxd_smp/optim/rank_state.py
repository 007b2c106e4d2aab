"""The rank-local state dict of a ``Zero1Optimizer``: what ``state_dict()`` returns on one rank, and
the optimizer's two halves of installing a checked state (``RankLocalState``, which the optimizer
inherits these methods from).

It holds this rank's inner optimizer state (over its flat shards), the param groups'
hyperparameters, the layout it was written with, the DP size and rank, and, with
``use_master_weights_in_ckpt``, the master shards. It loads only on the same rank of the same
layout at the same DP size; nxd_smp's checkpoints move across DP sizes.

``load_state_dict`` runs the checkpoint layer's one pipeline (read, check, agree, install), which
registers itself here (``register_loader``): a state dict is one more format it reads. What a refusal
advises beyond that (how a training loop that keeps one rank's optimizer file loads every rank's
state) is the loops' to say: the parts that write such files register a hint here (``add_hint``), so
this layer names no training loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..core.dtensors import global_offset, local_shape
from ..core.flat_shard import FlatShard
from ..core.layout import BucketLayout, Piece
from .param_groups import index_groups
from .state_fit import torch_state_dict

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


def param_places(optimizer: Any) -> list[tuple[int, Piece | None]]:
    """Per managed parameter (in ``optimizer.managed_params``' order): its bucket, and the ``Piece`` of it
    this rank's shard holds (its flat range, where it sits in the shard), None where it holds none. A
    parameter lies in one bucket and a shard is contiguous: at most one piece each."""
    places: list[tuple[int, Piece | None]] = [(-1, None)] * len(optimizer.managed_params)
    for b, layout in enumerate(optimizer.bucket_layouts):
        for i in layout.param_indices:
            places[i] = (b, None)
        for piece in layout.pieces(optimizer.rank):
            places[layout.param_indices[piece.index]] = (b, piece)
    return places


def param_numbers(optimizer: Any) -> dict[int, int]:
    """``id(parameter)`` -> the number torch.optim gives it in state dicts (param-group order)."""
    return {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}


def _in_shard(value: torch.Tensor, piece: Piece | None) -> torch.Tensor:
    """The view of shard-shaped ``value`` where ``piece`` lies (empty for None)."""
    return value[:0] if piece is None else value[piece.shard_start:piece.shard_start + piece.param_end
                                                 - piece.param_start]


def rank_state(optimizer: Any) -> dict[str, Any]:
    """This rank's state of ``optimizer`` (a ``Zero1Optimizer``) in torch.optim's shape: ``state`` by
    parameter number, each entry the inner optimizer's state for that parameter (its moments as
    ``FlatShard``: this rank's flat range, over copies of the shards), with ``master`` (the master
    weight's range) under ``use_master_weights_in_ckpt``; ``param_groups`` with the hyperparameters
    (the first group holds the loss scaler's state as ``loss_scaler``); and ``nxd_smp``, what a
    ``torch.save`` of it needs to load again (format, DP size and rank, tensor- and pipeline-parallel
    ranks, layout, precision)."""
    inner = optimizer.inner_optimizer
    copies = [{key: value.detach().clone() for key, value in inner.state.get(shard, {}).items()
               if isinstance(value, torch.Tensor)} for shard in optimizer.inner_shards]
    if optimizer.mixed_precision.use_master_weights_in_ckpt:
        for copy, master in zip(copies, optimizer.master_shards):
            copy[MASTER_KEY] = master.detach().clone()
    numbers = param_numbers(optimizer)
    state: dict[int, dict[str, Any]] = {}
    for i, (param, (b, piece)) in enumerate(zip(optimizer.managed_params, param_places(optimizer))):
        whole = (tuple(local_shape(param)), tuple(param.shape), global_offset(param))
        entry = {key: value.clone() if value.dim() == 0 else
                 FlatShard(_in_shard(value, piece), 0 if piece is None else piece.param_start, *whole)
                 for key, value in copies[b].items()}
        entry.update({key: value.detach().clone() for key, value in (optimizer.param_counters(i) or {}).items()
                      if isinstance(value, torch.Tensor)})  # (its own step, where it is not its bucket's)
        if entry:
            state[numbers[id(param)]] = entry
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [numbers[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    if optimizer.loss_scaler is not None:
        groups[0][SCALER_KEY] = optimizer.loss_scaler.state_dict()
    return {"state": state, "param_groups": groups,
            RECORD_KEY: {"format": STATE_DICT_FORMAT, "world_size": optimizer.world_size, "rank": optimizer.rank,
                         "model_parallel_rank": [optimizer.topology.coordinate.tensor,
                                                 optimizer.topology.coordinate.pipeline],
                         "mixed_precision": optimizer.mixed_precision.to_dict(),
                         "layout": layout_signature(optimizer.bucket_layouts)}}


class ParamStates(Mapping):
    """``Zero1Optimizer.state``: per managed parameter, its state as this rank holds it (each moment a
    1-D view of this rank's range of the live shard, empty where it holds none; its counters; with ``use_master_weights_in_ckpt`` its ``master`` weight, as its state dict holds it),
    read-only. It is never empty once the optimizer is built: torch's
    ``_init_optim_state`` (``get_optimizer_state_dict``) steps an optimizer whose ``state`` is empty to
    create one."""

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer
        self._where: dict[int, tuple[int, int, Piece | None]] | None = None  # id(param) -> (index, bucket, piece)
        self._master_cache: tuple[int, list[torch.Tensor]] | None = None

    def _place(self, param: Any) -> tuple[int, int, Piece | None]:
        if self._where is None:
            optimizer = self._optimizer
            self._where = {id(p): (i, *place) for i, (p, place) in enumerate(zip(optimizer.managed_params,
                                                                                param_places(optimizer)))}
        place = self._where.get(id(param))
        if place is None or self._optimizer._managed[place[0]] is not param:
            raise KeyError(param)
        return place

    def _masters(self) -> list[torch.Tensor]:
        """The master shards, rebuilt once per state generation where they are (parameter remainders)."""
        optimizer = self._optimizer
        if self._master_cache is None or self._master_cache[0] != optimizer.state_generation:
            self._master_cache = (optimizer.state_generation, optimizer.master_shards)
        return self._master_cache[1]

    def __getitem__(self, param: Any) -> dict[str, Any]:
        optimizer = self._optimizer
        if not optimizer._initialized:
            raise KeyError(param)
        index, b, piece = self._place(param)
        live = dict(optimizer.inner_optimizer.state.get(optimizer.inner_shards[b], {}))
        live.update(optimizer.param_counters(index) or {})
        if optimizer.mixed_precision.use_master_weights_in_ckpt:  # (what its state dict holds for it, too)
            live[MASTER_KEY] = self._masters()[b]
        return {key: _in_shard(value, piece) if isinstance(value, torch.Tensor) and value.dim() > 0 else value
                for key, value in live.items()}

    def __iter__(self):
        return iter(self._optimizer.managed_params if self._optimizer._initialized else [])

    def __len__(self) -> int:
        return len(self._optimizer.managed_params) if self._optimizer._initialized else 0

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


#: How a rank-local state is read, checked, agreed on and installed: the checkpoint layer's one
#: pipeline (``nxd_smp.checkpointing.pipeline``), which registers itself here when it is imported
#: (a lower layer cannot import it; ``import nxd_smp`` imports it).
_loader: Callable[..., None] | None = None


def register_loader(loader: Callable[..., None]) -> None:
    """Make ``load_state_dict`` and ``check_state_dict`` run ``loader(optimizer, state_dict, install=...)``."""
    global _loader
    _loader = loader


def _load(optimizer: Any, state_dict: Any, install: bool) -> None:
    if _loader is None:
        raise RuntimeError("nxd_smp's checkpoint layer is not imported: import nxd_smp before loading a state dict.")
    _loader(optimizer, state_dict, install=install)


def hint(situation: str) -> str:
    """The advice registered for ``situation`` (``add_hint``), with a leading space; empty if none."""
    text = _HINTS.get(situation)
    return f" {text}" if text else ""


class RankLocalState:
    """``state_dict``, ``load_state_dict`` and the two halves of an install of a ``Zero1Optimizer``,
    with torch's optimizer state-dict hooks around the first two."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the inner optimizer's state over its shards, the hyperparameters, the
        layout it was written with, and the master shards with ``use_master_weights_in_ckpt``. It
        loads at the same DP size and rank; ``nxd_smp.checkpoint`` moves across DP sizes. Parameters
        written in place since the last step are taken up first, so the masters match the model.
        torch's state-dict hooks run around it: a pre-hook that returns a dict gives the state dict
        instead (then nothing is built: a training loop's reference to a checkpoint), and a post-hook
        may return another."""
        state = None
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            result = hook(self)
            state = result if state is None else state
        if state is None:
            self.adopt_param_changes()
            state = rank_state(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            state = state if result is None else result
        return state

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise if ``state_dict`` is not what ``state_dict()`` returns on this rank (same model,
        layout, DP size and rank, a state the hyperparameters it installs keep); change nothing. It reads
        and checks on this rank alone (``load_state_dict`` also has the ranks agree).

        Raises:
            CheckpointError (a ``ValueError``): naming every way it does not fit, and the fix.
        """
        self._require_initialized()
        _load(self, state_dict, install=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned on the same rank at the same DP size; every process of the
        job calls it (the ranks agree world-wide: the tensor- and pipeline-parallel peers too). It is read, checked, agreed on and installed as every checkpoint is (the checkpoint
        layer's pipeline): if one rank's state dict does not fit, or the ranks of the data-parallel
        group would install different hyperparameters or step counts, every rank refuses and nothing
        changes. With master weights in it the parameters become ``master.to(param dtype)``; without,
        the masters are rebuilt at the next step from the parameters loaded by then (a warning says
        precision was lost). torch's load-state-dict hooks run around it; a pre-hook that installs the
        state itself returns ``STATE_LOADED``.

        Raises:
            CheckpointError (a ``ValueError``): the state dict does not fit, naming how.
        """
        self._require_initialized()
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):  # (a hook may add one)
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        if state_dict is not STATE_LOADED:
            _load(self, state_dict, install=True)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def install_local(self, state: Mapping[int, Mapping[str, Any]], hyperparameters: Sequence[Mapping[str, Any]],
                      scaler_state: Any = None, counters: Sequence[Mapping[str, Any] | None] | None = None
                      ) -> Callable[[], None]:
        """The first half of an install, of a state the checkpoint layer's check passed: the inner
        optimizer's state by bucket (its tensors become the optimizer's own), each managed parameter's
        ``counters`` (None: its bucket's), each param group's ``hyperparameters`` (over the live group;
        kernel options stay the live ones), the loss scaler's state. Local to this rank; returns the
        undo (the old objects put back: torch's ``load_state_dict`` replaces ``state`` and
        ``param_groups`` with new ones)."""
        inner = self.inner_optimizer
        before = (inner.state, inner.param_groups, [dict(g) for g in self.param_groups],
                  None if self.loss_scaler is None else self.loss_scaler.state_dict())
        counters_before = self._inner_step.counters.snapshot()

        def undo() -> None:
            counters_before()
            inner.__dict__.update(state=before[0], param_groups=before[1])
            for group, old in zip(self.param_groups, before[2]):
                group.clear()
                group.update(old)
            if before[3] is not None:
                self.loss_scaler.load_state_dict(before[3])

        try:
            bucket_of = {id(shard): b for b, shard in enumerate(self.inner_shards)}
            ids = index_groups([len(g["params"]) for g in inner.param_groups])
            by_id = {i: state[bucket_of[id(p)]] for g, numbers in zip(inner.param_groups, ids)
                     for i, p in zip(numbers, g["params"]) if bucket_of[id(p)] in state}
            loaded = torch_state_dict(inner.param_groups, hyperparameters, by_id)
            inner.load_state_dict(loaded)
            self._inner_step.counters.load(counters or [None] * len(self.managed_params))
            for group, installed in zip(self.param_groups, loaded["param_groups"]):
                group.update({k: v for k, v in installed.items() if k != "params"})
            if scaler_state is not None:
                self.loss_scaler.load_state_dict(scaler_state)
        except BaseException:
            undo()
            raise
        return undo

    def finish_install(self, masters: Sequence[torch.Tensor] | None, *, rebuild: bool = True,
                       discard_gradients: bool = True) -> None:
        """The second half, once every rank agreed (the masters' publication is a collective): the
        master shards published into the parameters; without them (under master weights) the masters
        are rebuilt from the current parameters now (``rebuild``), or else at the next step from those
        loaded by then, with a warning that precision below the parameter dtype was lost.
        ``discard_gradients``: drop the gradients accumulated since the last step (a checkpoint's load
        does; ``load_state_dict`` keeps them, as torch's optimizers do)."""
        if discard_gradients:
            self.zero_grad()
        self._state_changed()
        if not self.mixed_precision.use_master_weights:
            return
        if masters is not None:
            self.load_master_shards(masters)
            return
        if rebuild:
            self.rebuild_master_from_params()
        warnings.warn(
            "the loaded state has no master weights: they were rebuilt from the parameters "
            + ("loaded" if rebuild else "you load into the model (before or after this call), at the next step")
            + ", so precision below the parameter dtype is lost. Save with use_master_weights_in_ckpt=True to "
            "keep it.", stacklevel=4)
