"""The whole per-parameter state, as torch's ``full_state_dict`` option gives it: each parameter's
moments (and master) gathered from every rank's flat range, and under tensor parallelism joined over
its mesh into the global shape.

torch's ``get_optimizer_state_dict`` gathers only DTensors and ShardedTensors and hands every other
tensor through: the one call it makes on every rank is ``optimizer.state_dict()``, which is not told the
options. ``torch_get_options`` reads them from torch's own frame (the ``info`` that
``_get_optim_state_dict`` holds while it calls ``state_dict()``), so ``Zero1Optimizer.state_dict`` gathers
exactly when torch asked for a full state, and refuses when torch's code has changed under it rather than
return one rank's ranges as the whole.

Memory (``gather``): one parameter at a time. A rank's pieces of a parameter are padded to the longest
one's length and all-gathered over the data-parallel group (``Backend.all_gather``): the gathered buffer
is at most the DP size times the parameter and at most its bucket, beside the parameter's whole tensor
(and the collective's own staging): a few times the largest parameter, whatever the model's size
(``scripts/bench_full_state.py``). Kept on the device, or moved
to the host as soon as it is whole (``cpu``), or dropped where this rank keeps nothing (``keep=False``,
torch's ``cpu_offload``: rank 0 alone holds the result).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import torch

from ..core.dtensors import is_dtensor, local_shape
from ..core.errors import CheckpointError
from ..core.layout import BucketLayout, intersect

#: The module of torch's distributed state-dict API, and its functions that call ``state_dict()``.
TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"
_GET = "_get_optim_state_dict"  # get_optimizer_state_dict / get_state_dict: the state asked for
_SET = "_load_optim_state_dict"  # set_optimizer_state_dict / set_state_dict: the template to fill
_SEARCH_DEPTH = 8


class TorchOptions(NamedTuple):
    """What torch's ``get_optimizer_state_dict`` was asked for (``StateDictOptions``)."""

    full_state_dict: bool
    cpu_offload: bool
    flatten: bool


def torch_get_options() -> TorchOptions | None:
    """The options of torch's ``get_optimizer_state_dict`` (or ``get_state_dict``) when it is what called the
    optimizer's ``state_dict()``; None when something else did (the set side's template, a training loop,
    the user).

    Raises:
        RuntimeError: torch's state-dict API called ``state_dict()`` from a function this version of nxd_smp
            does not know, with ``full_state_dict`` asked for: a newer torch, where the options cannot be
            read. Refused rather than returning one rank's ranges as the whole state.
    """
    frame = sys._getframe(1)
    for _ in range(_SEARCH_DEPTH):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_globals.get("__name__") != TORCH_STATE_DICT:
            continue
        info = frame.f_locals.get("info")
        name = frame.f_code.co_name
        if name == _SET:
            return None
        if name == _GET and info is not None:
            return TorchOptions(bool(info.full_state_dict), bool(info.cpu_offload),
                                bool(getattr(info, "flatten_optimizer_state_dict", False)))
        if info is None or getattr(info, "full_state_dict", True):
            raise RuntimeError(
                f"torch's {TORCH_STATE_DICT}.{name} called Zero1Optimizer.state_dict(), which this version of "
                f"nxd_smp does not know (torch {torch.__version__}): it cannot tell whether a full state was asked "
                f"for, and one rank's ranges returned as the whole state would be silently wrong. Save with "
                f"nxd_smp.save_checkpoint and read the whole state with nxd_smp.checkpoint.read_checkpoint.")
        return None
    return None


def gather(value: torch.Tensor, layout: BucketLayout, position: int, backend: Any, param: torch.Tensor, *,
           join: bool = True) -> torch.Tensor:
    """The whole of one tensor of a parameter's state (a moment, its master) in the parameter's global
    shape, from ``value``: this rank's flat range of it (1-D, empty where it holds none). ``position``: the
    parameter's place in ``layout``, its bucket. Every rank of the data-parallel group calls it for the
    same parameter at once (and the parameter's tensor-parallel peers, for a DTensor). ``join=False``: this
    rank's tensor-parallel part, in the shape of the parameter's local part (no collective over its mesh)."""
    start, end = layout.param_range(position)
    spans = [intersect((start, end), layout.shard_range(r)) or (0, 0) for r in range(layout.world_size)]
    longest = max(hi - lo for lo, hi in spans)
    if layout.world_size == 1 or longest == 0:
        whole = value.detach().clone()
    else:
        padded = value.new_zeros(longest)
        padded[:value.numel()] = value.detach()
        gathered = backend.all_gather(padded)
        whole = torch.cat([gathered[r * longest:r * longest + hi - lo] for r, (lo, hi) in enumerate(spans)])
        del gathered
    whole = whole.view(local_shape(param))
    if join and is_dtensor(param):
        from torch.distributed.tensor import DTensor

        whole = DTensor.from_local(whole, param.device_mesh, param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride()).full_tensor()
    return whole


def asked_by_torch(has_loss_scaler: bool) -> dict[str, bool] | None:
    """How ``state_dict()`` answers torch's ``get_optimizer_state_dict`` when that is its caller: None for this
    rank's ranges (no caller of torch's, or no ``full_state_dict``), else ``full_state_dict``'s keywords,
    ``keep`` and ``cpu``, as torch places the whole state: on every rank's device, or under ``cpu_offload``
    on rank 0's host alone (torch empties the other ranks' dicts).

    Raises:
        CheckpointError: ``flatten_optimizer_state_dict`` with a loss scaler: torch's set side rebuilds each
            group's keys from the live groups, so the scaler's state (kept in the first group) would be lost
            on the way back.
    """
    options = torch_get_options()
    if options is None:
        return None
    if options.flatten and has_loss_scaler:
        raise CheckpointError(
            "flatten_optimizer_state_dict=True over a Zero1Optimizer with a loss scaler: torch's set side "
            "rebuilds each param group's keys from the live groups, so the scaler's state (in the first group, "
            "'loss_scaler') would be lost on resume. Use the nested layout (flatten_optimizer_state_dict=False) "
            "or nxd_smp.save_checkpoint.")
    if not options.full_state_dict:
        return None
    import torch.distributed as dist

    rank0_only = options.cpu_offload and dist.is_available() and dist.is_initialized()
    return {"keep": not rank0_only or dist.get_rank() == 0, "cpu": options.cpu_offload}
