"""The rank-local state dict of a ``Zero1Optimizer``: what ``state_dict()`` returns on one rank, what
``load_state_dict`` checks before anything changes, and how a checked state is installed
(``RankLocalState``, which the optimizer inherits these methods from).

It holds this rank's inner optimizer state (over its flat shards), the param groups'
hyperparameters, the layout it was written with, the DP size and rank, and, with
``use_master_weights_in_ckpt``, the master shards. It loads only on the same rank of the same
layout at the same DP size; nxd_smp's checkpoints move across DP sizes.

The state itself is checked by the one state-fit check (``state_fit``), against the
hyperparameters being installed. What a refusal advises beyond that (how a training loop that keeps
one rank's optimizer file loads every rank's state) is the loops' to say: the parts that write
such files register a hint here (``add_hint``), so this layer names no training loop.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..backend.agreement import agree
from ..core.errors import CheckpointError
from ..core.layout import BucketLayout
from .loss_scaler import check_scaler_state
from .param_groups import index_groups
from .state_fit import StateFit, describe, torch_group_problems, torch_state_dict

#: The ``format`` of a rank-local state dict.
STATE_DICT_FORMAT = "nxd_smp.zero1.rank_local/1"

#: Advice a refusal adds, by situation: ``"another rank"`` (a state dict of another rank), or
#: ``"format:<format>"`` (a dict of that format, which is not a rank-local state).
_HINTS: dict[str, str] = {}


def add_hint(situation: str, text: str) -> None:
    """Make refusals in ``situation`` (``"another rank"``, or ``"format:<a state dict's format>"``)
    end with ``text``: how the part that registers it loads such a state."""
    _HINTS[situation] = text


def _hint(situation: str) -> str:
    text = _HINTS.get(situation)
    return f" {text}" if text else ""


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


def rank_state(optimizer: Any) -> dict[str, Any]:
    """This rank's state of ``optimizer`` (a ``Zero1Optimizer``): its inner optimizer's state dict,
    its param groups (parameters numbered as torch.optim numbers them), layout, DP size and rank,
    the master shards (copies) with ``use_master_weights_in_ckpt``, the loss scaler's state."""
    ids = index_groups([len(g["params"]) for g in optimizer.param_groups])
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": i}
              for g, i in zip(optimizer.param_groups, ids)]
    state = {
        "format": STATE_DICT_FORMAT,
        "world_size": optimizer.world_size,
        "rank": optimizer.rank,
        "mixed_precision": optimizer.mixed_precision.to_dict(),
        "layout": layout_signature(optimizer.bucket_layouts),
        "param_groups": groups,
        "inner": optimizer.inner_optimizer.state_dict(),
    }
    if optimizer.mixed_precision.use_master_weights_in_ckpt:
        state["master_weights"] = [m.detach().clone() for m in optimizer.master_shards]
    if optimizer.loss_scaler is not None:
        state["loss_scaler"] = optimizer.loss_scaler.state_dict()
    return state


def check_rank_state(optimizer: Any, state_dict: Any) -> None:
    """Raise unless ``state_dict`` is what ``rank_state(optimizer)`` returns on this rank (same
    model, layout, DP size and rank), its state fitting the hyperparameters it installs; change
    nothing.

    Raises:
        CheckpointError: naming every way it does not fit, and the fix.
    """
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
        found = state_dict.get("format") if isinstance(state_dict, dict) else None
        raise CheckpointError(
            f"not a Zero1Optimizer state dict (missing format {STATE_DICT_FORMAT!r}); pass what "
            f"Zero1Optimizer.state_dict() returned." + (_hint(f"format:{found}") if isinstance(found, str) else "")
        )
    layouts = optimizer.bucket_layouts
    problems = []
    for key, mine in (("world_size", optimizer.world_size), ("rank", optimizer.rank)):
        if state_dict.get(key) != mine:
            problems.append(f"{key} {state_dict.get(key)} (this optimizer: {mine})")
    if state_dict.get("layout") != layout_signature(layouts):
        problems.append("bucket layout (parameters, shapes, dtypes, groups or bucket size differ)")
    masters = state_dict.get("master_weights")
    if masters is not None and (
        not isinstance(masters, (list, tuple)) or len(masters) != len(layouts) or any(
            not isinstance(a, torch.Tensor) or not a.dtype.is_floating_point or tuple(a.shape) != (layout.shard_numel,)
            for a, layout in zip(masters, layouts))):
        problems.append("master weight shard shapes")
    problems += _inner_state_problems(optimizer, state_dict.get("inner"), state_dict.get("param_groups"))
    if optimizer.loss_scaler is not None and "loss_scaler" in state_dict:
        problems += [f"loss_scaler{p}" for p in check_scaler_state(state_dict["loss_scaler"], optimizer.loss_scaler)]
    if problems:
        raise CheckpointError(
            "this state dict does not fit the optimizer: " + "; ".join(problems) + ". Rank-local state dicts load "
            "only into the same model, DP size and rank; use nxd_smp.checkpoint to change the DP size."
            + (_hint("another rank") if state_dict.get("rank") != optimizer.rank else "")
        )


def _inner_state_problems(optimizer: Any, inner: Any, groups: Any) -> list[str]:
    """What in a state dict's ``inner`` (the inner optimizer's own state dict) and ``param_groups``
    does not fit: both lists of groups as torch's ``load_state_dict`` checks them and as the
    optimizer numbers its parameters and shards (``torch_group_problems``), their hyperparameters,
    and per shard, by the id the checked groups give it, the state its installed group keeps."""
    if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) \
            or not isinstance(inner.get("param_groups"), list) or not isinstance(groups, list):
        return ["the inner optimizer's state (not a torch.optim state dict)"]
    live_inner = optimizer.inner_optimizer
    problems = (torch_group_problems(groups, optimizer.param_groups, "param_groups")
                + torch_group_problems(inner["param_groups"], live_inner.param_groups, "inner param_groups"))
    if problems:
        return problems
    # each id the inner groups list is one shard of the inner optimizer, in its order: each
    # group's buckets (the ids were checked to be the inner optimizer's own numbering)
    shard_of = {i: (g, tuple(p.shape)) for g, (saved, live) in enumerate(zip(inner["param_groups"],
                                                                             live_inner.param_groups))
                for i, p in zip(saved["params"], live["params"])}
    inner_fit = StateFit(type(live_inner), live_inner.param_groups, [_without_params(g) for g in inner["param_groups"]])
    problems += [f"inner {p}" for p in inner_fit.group_problems()]
    fit = StateFit(type(live_inner), live_inner.param_groups, [_without_params(g) for g in groups])
    entries = []
    for index, entry in inner["state"].items():
        if isinstance(index, bool) or index not in shard_of:
            problems.append(f"inner state for shard {describe(index)}, which this optimizer does not have")
        else:
            entries.append((shard_of[index][0], f"inner state of shard {index}", entry, shard_of[index][1]))
    return problems + fit.problems(entries)


def _without_params(group: Any) -> Any:
    """A saved param group's hyperparameters: all but the parameters' numbers."""
    return {k: v for k, v in group.items() if k != "params"} if isinstance(group, dict) else group


class _StateLoaded:
    def __repr__(self) -> str:
        return "nxd_smp.zero1_optimizer.STATE_LOADED"


#: A ``load_state_dict`` pre-hook returns this when it has installed the state itself (from a
#: checkpoint the dict it was given refers to): nothing more is loaded.
STATE_LOADED = _StateLoaded()


class RankLocalState:
    """``state_dict``, ``load_state_dict`` and ``install_state`` of a ``Zero1Optimizer``, with
    torch's optimizer state-dict hooks around the first two."""

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
        layout, DP size and rank, a state the hyperparameters it installs keep); change nothing.

        Raises:
            CheckpointError (a ``ValueError``): naming every way it does not fit, and the fix.
        """
        self._require_initialized()
        check_rank_state(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned on the same rank at the same DP size; every rank calls
        it. Everything is checked first, on every rank: if one rank's state dict does not fit, every
        rank refuses and nothing changes. With master weights in it the parameters become
        ``master.to(param dtype)``; without, the masters are rebuilt at the next step from the
        parameters loaded by then (a warning says precision was lost). torch's load-state-dict hooks
        run around it; a pre-hook that installs the state itself returns ``STATE_LOADED``.

        Raises:
            CheckpointError (a ``ValueError``): the state dict does not fit, naming how.
        """
        self._require_initialized()
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):  # (a hook may add one)
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        if state_dict is not STATE_LOADED:
            # every rank loads (the masters are published to all): one refusing means all refuse.
            # Everything that could refuse is checked here, the scaler's state and torch's own
            # group checks included, so that what follows cannot fail on one rank alone.
            agree(self.backend.coordinator, lambda: (self.check_state_dict(state_dict), None), what="its state dict")
            scaler_state = state_dict.get("loss_scaler") if self.loss_scaler is not None else None
            # (copied: torch.optim keeps given tensors where dtype and device match, and training
            # would write into the caller's state dict)
            self.install_state(copy.deepcopy(state_dict["inner"]["state"]),
                               [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]],
                               state_dict.get("master_weights"), rebuild=False, discard_gradients=False,
                               scaler_state=scaler_state)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def install_state(self, state: Mapping[int, Mapping[str, torch.Tensor]],
                      hyperparameters: Sequence[Mapping[str, Any]], masters: Sequence[torch.Tensor] | None, *,
                      rebuild: bool = True, discard_gradients: bool = True, scaler_state: Any = None) -> None:
        """Install a checked state: the inner optimizer's state by shard index (its tensors become
        the optimizer's own), each param group's ``hyperparameters`` (over the live group; kernel
        options stay the live ones), and the master shards, published into the parameters. Without
        masters (under master weights) they are rebuilt from the current parameters now
        (``rebuild``), or else at the next step from those loaded by then, with a warning that
        precision below the parameter dtype was lost. ``discard_gradients``: drop the gradients
        accumulated since the last step (a checkpoint's load does; ``load_state_dict`` keeps them, as
        torch's optimizers do). ``scaler_state``: the loss scaler's, checked (``check_scaler_state``).
        Every rank calls it, once the ranks agreed (the masters' publication is a collective).

        What is local (torch's ``load_state_dict`` of the inner optimizer, the groups, the scaler)
        runs first, under a second agreement: the checks made it unable to fail, and should it fail
        all the same on one rank (an optimizer class that could not be probed), every rank puts its
        own back and raises a ``CheckpointError``, rather than the others waiting in the masters'
        collective."""
        inner = self.inner_optimizer
        before = (inner.state, inner.param_groups, [dict(g) for g in self.param_groups],
                  None if self.loss_scaler is None else self.loss_scaler.state_dict())

        def install_locally() -> tuple[None, Any]:
            try:
                # (torch's load_state_dict replaces ``state`` and ``param_groups`` with new objects:
                # the old ones, kept above, are what the undo puts back)
                loaded = torch_state_dict(inner.param_groups, hyperparameters, state)
                inner.load_state_dict(loaded)
                for group, installed in zip(self.param_groups, loaded["param_groups"]):
                    group.update({k: v for k, v in installed.items() if k != "params"})
                if scaler_state is not None:
                    self.loss_scaler.load_state_dict(scaler_state)
            except BaseException:
                undo()
                raise
            return None, undo

        def undo() -> None:
            inner.__dict__.update(state=before[0], param_groups=before[1])
            for group, old in zip(self.param_groups, before[2]):
                group.clear()
                group.update(old)
            if before[3] is not None:
                self.loss_scaler.load_state_dict(before[3])

        agree(self.backend.coordinator, install_locally, what="the checked state")
        if discard_gradients:
            self.zero_grad()
        self._state_changed()
        if not self.mixed_precision.use_master_weights:
            return
        if masters is not None:
            self.load_master_shards(masters)
        elif rebuild or state:
            if rebuild:
                self.rebuild_master_from_params()
            warnings.warn(
                "the loaded state has no master weights: they were rebuilt from the parameters "
                + ("loaded" if rebuild else "you load into the model (before or after this call), at the next step")
                + ", so precision below the parameter dtype is lost. Save with use_master_weights_in_ckpt=True to "
                "keep it.", stacklevel=3)
