"""The neutral staged state every checkpoint reader produces, and what a rank asks readers for.

A load runs four stages, whatever the format (``run``): **read** (a format's reader turns its
files into a ``Staged`` state, trusting nothing and installing nothing), **check** (``check``: the
one check against the live objects), **agree** (``backend.agreement``), **install** (``install``).
This module is what passes between them:

* ``Request``: what this rank asks for: the live parameters' names by param group and their shapes,
  and the element ranges of each parameter this rank's shards hold (``core.layout``'s pieces, in
  logical per-parameter coordinates), the objects asked for, this rank's coordinate;
* ``Staged``: what a reader read: the model's entries, and the optimizer's per parameter (its state
  by key and its master weight), its param groups' hyperparameters, the loss scaler's state, the
  saved objects' states (the scheduler's, ...), the caller's extra, and the checksums of what every
  rank of a data-parallel group reads alike (for the agreement's digest). The optimizer's tensors
  are ``Pieces`` (only the element ranges this rank installs: never the whole state on every rank)
  or, from formats whose files hold whole per-parameter tensors, ``Whole`` tensors as read.

The arithmetic of pieces (which saved pieces overlap a rank's pieces, ``overlaps``) is here too:
pure element ranges, no tensors or files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
import torch.nn as nn

from ...core.dtensors import local_shape, local_state_dict
from ...core.errors import CheckpointError
from ...backend.base import Backend
from ..rank_state import RankState


# ---------------------------------------------------------------------------- pieces: arithmetic
@dataclass(frozen=True)
class Overlap:
    """Elements ``[saved_start + src, saved_start + src + numel)`` of the saved piece ``[saved_start,
    saved_end)`` go to ``[dst, dst + numel)`` of the wanted range. ``whole``: the saved piece lies
    inside the wanted range (``src`` is 0, ``numel`` its length)."""

    saved_start: int
    saved_end: int
    src: int
    dst: int
    numel: int
    whole: bool


def overlaps(saved: Sequence[tuple[int, int]], start: int, end: int) -> list[Overlap]:
    """The parts of the saved pieces ``saved`` (ranges of one parameter) that the wanted range
    ``[start, end)`` holds, each with where it lands in that range (``dst`` from ``start``)."""
    out = []
    for lo, hi in saved:
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.append(Overlap(lo, hi, a - lo, a - start, b - a, lo >= start and hi <= end))
    return out


# ---------------------------------------------------------------------------- what a rank asks for
@dataclass(frozen=True)
class Slot:
    """One range ``[start, end)`` of a parameter's flat elements this rank holds: at
    ``[shard_start, shard_start + end - start)`` of bucket ``bucket``'s shard."""

    start: int
    end: int
    bucket: int
    shard_start: int


@dataclass
class OptimizerRequest:
    """What this rank's optimizer installs.

    Attributes:
        groups: the live parameters' names, param group by param group (the order torch.optim state
            dicts number them in: NxD's and torch_xla's files name parameters by that number).
        shapes: each parameter's shape (its local part for a DTensor).
        slots: per parameter, the ranges of it this rank's shards hold.
        shard_numels: each bucket's shard size on this rank (staging buffers are allocated so).
        shard_dtypes: each bucket's optimizer-state dtype as the device holds it.
        master_weights: the optimizer keeps master weights (so a checkpoint's are read).
        scaler_keys: the loss scaler's state keys, if the optimizer has one.
    """

    groups: list[list[str]]
    shapes: dict[str, tuple[int, ...]]
    slots: dict[str, list[Slot]]
    shard_numels: list[int]
    shard_dtypes: list[torch.dtype]
    master_weights: bool
    scaler_keys: tuple[str, ...] = ()

    @property
    def names(self) -> list[str]:
        return [name for group in self.groups for name in group]

    def bucket_slots(self) -> list[list[tuple[str, Slot]]]:
        """Per bucket, the slots of it this rank holds, as (parameter name, slot)."""
        by_bucket: list[list[tuple[str, Slot]]] = [[] for _ in self.shard_numels]
        for name, slots in self.slots.items():
            for slot in slots:
                by_bucket[slot.bucket].append((name, slot))
        return by_bucket


@dataclass
class Request:
    """What one rank asks a reader for.

    Attributes:
        model_keys: the live model's state-dict keys (None: the model is a dict to fill, or absent).
        optimizer: the live optimizer's request (None: no Zero1Optimizer to install into).
        objects: the names of the stateful objects asked for (``"scheduler"`` among them).
        data, data_size, tensor, pipeline: this rank's coordinate (NxD's per-rank files).
        device_dtype: the dtype the device holds a tensor of a torch dtype in.
    """

    model_keys: set[str] | None
    optimizer: OptimizerRequest | None
    objects: frozenset[str]
    data: int = 0
    data_size: int = 1
    tensor: int = 0
    pipeline: int = 0
    device_dtype: Callable[[torch.dtype], torch.dtype] = lambda dtype: dtype


# ---------------------------------------------------------------------------- what a reader read
@dataclass
class Pieces:
    """A parameter's state tensor (or master weight) as the ranges of it this rank installs: a
    tensor of ``shape`` and ``dtype`` (as saved), of which ``parts[start]`` holds the elements from
    ``start`` of the flattened tensor (one part per ``Slot`` of the request)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    parts: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class Whole:
    """A tensor as a file holds it whole (NxD's, torch_xla's and DCP's files; the full-state API)."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


Value = Pieces | Whole | torch.Tensor | int | float


@dataclass
class StagedOptimizer:
    """An optimizer's state as read.

    Attributes:
        groups: per param group (the live optimizer's order), the saved hyperparameters.
        state: per parameter name, its state by key: ``Pieces`` or ``Whole`` tensors, 0-dim tensors
            or numbers (``{}``: a parameter without state yet); which key is a moment and which a
            counter is the check's to decide, from the class and the hyperparameters installed.
        masters: per parameter name, its master weight (``Pieces`` or ``Whole``), or None.
        scaler: the loss scaler's state, or None.
        staging: the buffers ``Pieces`` of the moments and masters were read into, by key (``None``
            for the masters), one per bucket in the shard's layout: the install takes them as the
            shards, without a copy, where every part of every parameter is a view of them.
        source: the file(s) errors name.
        arrangement: the parameters' names per param group as saved, where the format names them
            (nxd_smp's): the check refuses groups arranged otherwise than the live ones.
    """

    groups: list[dict[str, Any]]
    state: dict[str, dict[str, Value]]
    masters: dict[str, Pieces | Whole] | None
    scaler: dict[str, Any] | None = None
    staging: dict[str | None, list[torch.Tensor]] = field(default_factory=dict)
    source: str = "the checkpoint"
    arrangement: list[list[str]] | None = None


@dataclass
class StagedModel:
    """A model's entries as read, for a live ``nn.Module``.

    Attributes:
        shapes: every entry the checkpoint holds, with its shape and dtype (for missing and extra names).
        entries: the live model's keys that the checkpoint holds, each as saved (cast by the install).
        source: the file errors name.
        tensor_parallel: the DTensor layout the checkpoint was saved with (nxd_smp's format).
        exact_dtypes: the entries were saved in the device's dtypes and must match them (nxd_smp's
            format; other tools' tensors need only convert exactly).
    """

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    entries: dict[str, torch.Tensor]
    source: str
    tensor_parallel: Any = None
    exact_dtypes: bool = False


@dataclass
class StagedTorchOptimizer:
    """A plain torch optimizer's ``state_dict()`` as read (NxD with ZeRO-1 off), and the file errors name."""

    state_dict: dict[str, Any]
    source: str


@dataclass
class StagedObjects:
    """The saved objects' states by name (the scheduler's under ``"scheduler"``), and the file errors name
    (None: the checkpoint's)."""

    states: dict[str, Any] = field(default_factory=dict)
    source: str | None = None


@dataclass
class Staged:
    """Everything one reader read for one rank, trusted nothing yet: one part per kind of target, each
    with the file its errors name.

    Attributes:
        source: the checkpoint (folder or files) errors name.
        model: the model's entries, for a live ``nn.Module``.
        optimizer: the optimizer's, for a live ``Zero1Optimizer``; ``torch_optimizer``: a plain torch
            optimizer's (NxD with ZeRO-1 off).
        objects: the saved objects' states by name (the scheduler's under ``"scheduler"``).
        extra: the caller's content (``extra``, NxD's ``user_content``), None without.
        fill: the dicts NxD Training passes to fill (``{"model": ..., "optimizer": ...}``), as read.
        replicated: what every rank of a data-parallel group reads alike, by name, as checksums (a
            file's or an entry's CRC-32): the agreement compares them.
    """

    source: str
    model: StagedModel | None = None
    optimizer: StagedOptimizer | None = None
    torch_optimizer: StagedTorchOptimizer | None = None
    objects: StagedObjects = field(default_factory=StagedObjects)
    extra: Any = None
    fill: dict[str, Any] | None = None
    replicated: dict[str, int] = field(default_factory=dict)

    @property
    def objects_source(self) -> str:
        return self.objects.source or self.source


def buffers_for(staging: dict[str | None, list[torch.Tensor]], key: str | None, request: OptimizerRequest
                ) -> list[torch.Tensor]:
    """The staging buffers of ``key`` (None: the masters), one per bucket in this rank's shard layout
    (the shard's dtype; fp32 for masters), made at first use. They are not initialised: the saved
    pieces are read into them, and ``zero_unwritten`` zeroes the rest before anything is read."""
    if key not in staging:
        staging[key] = [torch.empty(numel, dtype=torch.float32 if key is None else dtype)
                        for numel, dtype in zip(request.shard_numels, request.shard_dtypes)]
    return staging[key]


def zero_unwritten(staging: dict[str | None, list[torch.Tensor]], written: Iterable[torch.Tensor]) -> None:
    """Zero every element of the staging buffers that none of ``written`` (views of them that the load
    fills) covers: the shards' padding and the slots of parameters without saved state. Zeroing the
    buffers whole cost a fifth of a load (0.14 of 0.66 s at 50M parameters)."""
    buffers = {b.untyped_storage().data_ptr(): b for per_key in staging.values() for b in per_key}
    covered: dict[int, list[tuple[int, int]]] = {ptr: [] for ptr in buffers}
    for view in written:
        ptr = view.untyped_storage().data_ptr()
        if ptr in covered and view.numel():
            start = view.storage_offset() - buffers[ptr].storage_offset()
            covered[ptr].append((start, start + view.numel()))
    for ptr, buffer in buffers.items():
        end = 0
        for start, stop in sorted(covered[ptr]):
            if start > end:
                buffer[end:start].zero_()
            end = max(end, stop)
        if end < buffer.numel():
            buffer[end:].zero_()


def staging_slices(staging: dict[str | None, list[torch.Tensor]], key: str | None, request: OptimizerRequest,
               name: str) -> dict[int, torch.Tensor]:
    """The views of ``key``'s staging buffers where parameter ``name``'s slots lie, by slot start."""
    buffers = buffers_for(staging, key, request)
    return {slot.start: buffers[slot.bucket][slot.shard_start:slot.shard_start + slot.end - slot.start]
            for slot in request.slots.get(name, [])}


# ---------------------------------------------------------------------------- what a load installs into
def managed_param_names(model: nn.Module | None, optimizer: RankState) -> list[str]:
    """The model name of each parameter ``optimizer`` manages, in its layout order
    (``optimizer.managed_params``); without a model (a rank-local state dict), ``parameter <i>``.

    Raises:
        CheckpointError: a managed parameter is not a parameter of ``model``.
    """
    if not isinstance(model, nn.Module):
        return [f"parameter {i}" for i in range(len(optimizer.managed_params))]
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    out = []
    for i, p in enumerate(optimizer.managed_params):
        if id(p) not in names:
            raise CheckpointError(f"the optimizer's parameter {i} (shape {tuple(p.shape)}) is not a parameter of the "
                                  f"model; pass the model the optimizer was built for.")
        out.append(names[id(p)])
    return out


#: The module names that wrappers add to a parameter's name and torch's distributed state-dict API leaves out
#: of its FQNs: activation checkpointing's, FSDP's, ``torch.compile``'s, and DDP's leading ``module``.
_WRAPPERS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def canonical_name(name: str) -> str:
    """``name`` (a parameter's, as ``named_parameters`` gives it or as torch's state-dict API writes it)
    without the wrappers' module names (``_WRAPPERS``, a leading ``module.``): one parameter's two names
    compare equal."""
    parts = [part for part in name.split(".") if part not in _WRAPPERS]
    if len(parts) > 1 and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def known_names(model: nn.Module | None, optimizer: RankState) -> list[list[str]] | None:
    """The names of each param group's managed parameters where they are known: from ``model``, or from
    the ``param_names`` the optimizer was built with (``model.named_parameters()``); None where neither
    names them, or where two of them would compare equal (``canonical_name``)."""
    if isinstance(model, nn.Module):
        names = param_group_names(model, optimizer)
    elif optimizer.param_groups and all(isinstance(g.get("param_names"), list) for g in optimizer.param_groups):
        names = [list(g["param_names"]) for g in optimizer.param_groups]
    else:
        return None
    flat = [canonical_name(n) for group in names for n in group]
    return names if len(set(flat)) == len(flat) else None


def param_group_names(model: nn.Module | None, optimizer: RankState) -> list[list[str]]:
    """The names of each param group's managed parameters, group by group, in the order the optimizer
    was given them (the order torch.optim state dicts number them in)."""
    names = dict(zip(map(id, optimizer.managed_params), managed_param_names(model, optimizer)))
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


@dataclass
class Targets:
    """What one load installs into, on this rank: the targets as given, and what a load reads of them,
    each resolved once, at first use: the optimizer's ``rank_state``; the managed parameters' names,
    groups and shapes and the model's local entries at the first ``request()``, inside the pipeline's
    read, so that a refusal there is every rank's to learn. One load's: a new load builds new targets.

    Attributes:
        model: the model, or a dict to fill (NxD Training), or None.
        optimizer: the ``Zero1Optimizer`` (an object holding one resolved to it; a load reads and installs
            through its ``rank_state``), a plain torch optimizer (NxD's with ZeRO-1 off), a dict to fill, or
            None.
        objects: the scheduler (under ``"scheduler"``) and the caller's other stateful objects.
        backend: where rank, world, coordination and the device's dtypes come from.
        strict: as ``nn.Module.load_state_dict``: model entries on one side only are refused.
        coordinate: this rank's (data, data size, tensor, pipeline) place, for per-rank files.
        rebuild_masters: without saved master weights, rebuild them from the loaded parameters now
            (a checkpoint's load), or at the next step from those loaded by then (``load_state_dict``).
        discard_gradients: drop the gradients accumulated since the last step (a checkpoint's load).
    """

    model: nn.Module | MutableMapping | None
    optimizer: Any
    objects: dict[str, Any]
    backend: Backend
    strict: bool = True
    coordinate: tuple[int, int, int, int] | None = None
    rebuild_masters: bool = True
    discard_gradients: bool = True
    _request: Request | None = field(default=None, init=False, repr=False)

    def group(self) -> list | None:
        """What names this rank's data-parallel group in the agreement's digest comparison: the optimizer's
        group (its global ranks), or the tensor- and pipeline-parallel coordinate every rank of one
        data-parallel group shares; None when neither is known (no comparison)."""
        if self.rank_state is not None:
            return ["ranks", *self.rank_state.backend.global_ranks]
        if self.coordinate is not None:
            return ["coordinate", self.coordinate[2], self.coordinate[3]]
        return None

    @cached_property
    def rank_state(self) -> RankState | None:
        """The optimizer's state on this rank (``optim.rank_state.RankState``: every part a load reads and
        installs into) where the optimizer is a ``Zero1Optimizer``, else None."""
        held = getattr(self.optimizer, "rank_state", None) if not isinstance(self.optimizer, Mapping) else None
        return held if isinstance(held, RankState) else None

    @cached_property
    def groups(self) -> list[list[str]]:
        """The managed parameters' names, param group by param group (``param_group_names``)."""
        return param_group_names(self.model, self.rank_state)

    @cached_property
    def names(self) -> list[str]:
        """The managed parameters' names, in layout order."""
        return managed_param_names(self.model, self.rank_state)

    @cached_property
    def live_model(self) -> dict[str, torch.Tensor] | None:
        """The model's local entries (``core.dtensors.local_state_dict``), None where the model is no module."""
        return local_state_dict(self.model) if isinstance(self.model, nn.Module) else None

    def request(self) -> Request:
        """What this rank asks a reader for (made once)."""
        if self._request is None:
            self._request = self._make_request()
        return self._request

    def _make_request(self) -> Request:
        data, data_size, tensor, pipeline = self.coordinate or (self.backend.rank, self.backend.world_size, 0, 0)
        optimizer = None
        held = self.rank_state
        if held is not None:
            slots: dict[str, list[Slot]] = {name: [] for name in self.names}
            for name, (b, piece) in zip(self.names, held.places()):
                if piece is not None:
                    slots[name].append(Slot(piece.param_start, piece.param_end, b, piece.shard_start))
            optimizer = OptimizerRequest(
                groups=self.groups,
                shapes={name: tuple(local_shape(p)) for name, p in zip(self.names, held.managed_params)},
                slots=slots, shard_numels=[layout.shard_numel for layout in held.bucket_layouts],
                shard_dtypes=[self.backend.device_dtype(shard.dtype) for shard in held.inner_shards],
                master_weights=held.mixed_precision.use_master_weights,
                scaler_keys=tuple(held.loss_scaler.state_dict()) if held.loss_scaler is not None else ())
        return Request(model_keys=None if self.live_model is None else set(self.live_model), optimizer=optimizer,
                       objects=frozenset(self.objects), data=data, data_size=data_size, tensor=tensor,
                       pipeline=pipeline, device_dtype=self.backend.device_dtype)
