"""The global gradient norm and the clip coefficient, as tensors (no host sync).

* ``norm_role``: how a parameter counts in the model-wide norm under model parallelism:
  ``"replicated"`` (the same on every tensor-parallel rank: counted once), ``"split"``
  (``tensor_model_parallel=True``: each rank holds a part, the parts add up) or
  ``"shared"`` (``shared=True`` under pipeline parallelism, NxD's mark for the copy of a
  tied weight that another stage already counts: not counted here);
* ``sum_of_squares``: the local part, fp32, accurate on CPU;
* ``global_norm``: the local parts added up over the tensor-, data- and pipeline-parallel
  groups, so every rank ends with the same norm of the whole model;
* ``clip_coefficient``: ``min(1, max_norm / (norm + 1e-6))``, as torch, NxD and torch_xla;
  ``gradient_coefficient``: that over the mean's size and the loss scale, what a step applies.

The groups are passed in as objects with an in-place ``all_reduce_`` (sum), such as
``nxd_smp.backend.Backend``; nothing here picks a backend.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..core.dtensors import is_split
from ..core.memory import plain_alias
from .compiled_adamw import compile_cpu_kernel, compiler_unavailable


#: How a parameter counts in the global norm; see ``norm_role``.
NORM_ROLES = ("replicated", "split", "shared")


class _AllReduce(Protocol):
    def all_reduce_(self, tensor: torch.Tensor) -> None: ...


def norm_role(param: torch.Tensor, pipeline_parallel: bool) -> str:
    """``"shared"`` for a parameter NxD marks ``shared=True`` when the norm spans pipeline
    stages (another stage holds and counts the same weight), ``"split"`` for one marked
    ``tensor_model_parallel=True`` or a DTensor sharded on its mesh, else ``"replicated"``."""
    if pipeline_parallel and getattr(param, "shared", False):
        return "shared"
    return "split" if getattr(param, "tensor_model_parallel", False) or is_split(param) else "replicated"

# torch's CPU norm kernel accumulates each thread's share in one fp32 running sum: at 20M
# elements its relative error is ~1e-3, and a sum of fp32 norms of pieces (~1e-6) changes with
# where the shards cut the gradient, so a run at DP 2 would clip by another last bit than at DP 1.
# Each element's fp32 square is the same wherever it falls, and their sum in fp64 is exact to
# ~1e-16: the fp32 norm is the same at any DP size (~1e-11 from the exact one). Pieces of 256K
# elements keep the squares' scratch at 1 MB (13 ms for 21M fp32 elements on 2 cores, against 8 ms
# for fp32 norms of the pieces; 15 ms against 16 ms for bf16).
_CPU_NORM_PIECE = 1 << 18

# The compiled CPU path sums squares along rows of 256 in fp32 (exact to ~1e-7) and the
# row sums in fp64: ~1e-10 relative error, and at memory speed (2.5 ms for 21M elements
# on 2 cores, against 4.6 ms for the pieces above).
_ROW = 256
_compiled_rows: Any = None  # the compiled kernel; False once compiling failed here


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    return rows.float().square().sum(1).sum(dtype=torch.float64)


def _rows_kernel() -> Any:
    global _compiled_rows
    if _compiled_rows is None:
        _compiled_rows = compile_cpu_kernel(_row_sums)
    return _compiled_rows


def _compiled_sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``sum_of_squares`` on CPU through the compiled row kernel, in fp64; None if it cannot be
    compiled here (said once; the caller uses the eager pieces)."""
    global _compiled_rows
    if _compiled_rows is False:
        return None
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        flat = t.reshape(-1)
        # (fewer than two rows: eager, as the compiler would specialise on one row)
        whole = flat.numel() - flat.numel() % _ROW if flat.numel() >= 2 * _ROW else 0
        if whole:
            try:
                with torch.no_grad():
                    total = total + _rows_kernel()(plain_alias(flat[:whole].view(-1, _ROW)))
            except compiler_unavailable() as e:
                warnings.warn(
                    f"nxd_smp: compiling the gradient-norm kernel failed ({type(e).__name__}: {e}); "
                    f"using torch's norm instead.",
                    stacklevel=4,
                )
                _compiled_rows = False
                return None
        if whole < flat.numel():
            total = total + flat[whole:].double().square().sum()
    return total


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def sum_of_squares(tensors: list[torch.Tensor], device: torch.device, compiled: bool = False,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of squared elements over ``tensors``, accumulated in fp32 or better (a 0-dim
    tensor of ``dtype`` on ``device``; zero for an empty list). On CPU the same at any cut of the
    gradient into shards (``_CPU_NORM_PIECE``); ``compiled``: use the compiled kernel there (one
    read of the gradient at memory speed; its fp32 rows of 256 leave ~1e-10, so a cut can flip a
    last bit, rarely). ``dtype``: the torch dtype the
    device holds as fp32 (float64 on an XLA device under ``XLA_DOWNCAST_BF16``)."""
    if not tensors:
        return torch.zeros((), dtype=dtype, device=device)
    if device.type == "cpu":
        total = _compiled_sum_of_squares(tensors) if compiled else None
        if total is None:
            total = torch.stack([_at_least_fp32(piece).square().sum(dtype=torch.float64) for t in tensors
                                 for piece in t.reshape(-1).split(_CPU_NORM_PIECE)]).sum()
        return total.to(dtype)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=dtype)).square().sum()


def global_norm(
    replicated_sq: torch.Tensor,
    split_sq: torch.Tensor | None = None,
    *,
    tensor_parallel: Sequence[_AllReduce] = (),
    data_parallel: _AllReduce | None = None,
    pipeline_parallel: Sequence[_AllReduce] = (),
) -> torch.Tensor:
    """The model-wide L2 norm from this rank's sums of squares (0-dim fp32 tensors) of its
    ``replicated`` and ``split`` parameters (``shared`` ones are left out by the caller).

    ``split_sq`` is added up over ``tensor_parallel``; ``replicated_sq`` is counted once
    (every tensor-parallel rank holds the same); then the total is added up over
    ``data_parallel`` (the ZeRO shards) and ``pipeline_parallel`` (the stages, which hold
    different parameters).
    """
    total = replicated_sq.reshape(1)
    if split_sq is not None:
        split = split_sq.reshape(1).clone()
        for group in tensor_parallel:
            group.all_reduce_(split)
        total = total + split
    if data_parallel is not None:
        data_parallel.all_reduce_(total)
    for group in pipeline_parallel:
        group.all_reduce_(total)
    return total.sqrt().reshape(())


def gradient_coefficient(norm: torch.Tensor, grad_clipping: bool, max_norm: float | None, *divisors: Any
                         ) -> torch.Tensor | float | None:
    """What summed gradients are multiplied by in a step: the clip coefficient of ``norm``, divided
    by each of ``divisors`` that is not None (the mean's size, the loss scale); None for 1."""
    coef: torch.Tensor | float | None = clip_coefficient(norm, grad_clipping, max_norm)
    for divisor in divisors:
        if divisor is not None:
            coef = 1.0 / divisor if coef is None else coef / divisor
    return coef


def clip_coefficient(norm: torch.Tensor, grad_clipping: bool, max_norm: float) -> torch.Tensor | None:
    """``min(1, max_norm / (norm + 1e-6))`` as a tensor, or None when nothing is clipped
    (clipping off, or ``max_norm`` infinite)."""
    if not grad_clipping or math.isinf(max_norm):
        return None
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
