"""One-pass Adam/AdamW update of flat fp32 shards on CPU, compiled with torch.compile.

``torch.optim.AdamW(fused=True)`` followed by the cast into the bf16 parameters reads the
fp32 master twice, and applying the clip coefficient through its ``grad_scale`` writes
the gradient back: three passes over memory where one will do. This module compiles
"scale the gradient, AdamW step, cast into the parameter buffer" into one loop; with parameter
remainders, "rebuild the fp32 master from the bf16 parameter and its int16 remainder, step,
split it back" into one loop, so no fp32 shard is ever in memory.

It is a drop-in for ``inner.step()`` of a ``torch.optim.Adam``/``AdamW`` built over the
shards: it reads and updates that optimizer's own state tensors (``step``, ``exp_avg``,
``exp_avg_sq``) with torch's formulas, so its ``state_dict()`` stays torch's. Used only
where it applies (see ``applies_to``); if compiling fails it says so once and the
caller falls back to the stock step.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from typing import Any

import torch

from ..core.errors import ConfigError
from ..core.memory import is_staggered, plain_alias, staggered_empty
from .rounding import join_master, split_master



def _adamw(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: torch.Tensor,
    decoupled: bool,
) -> torch.Tensor:
    """torch.optim.Adam(W)'s update: the moments in place, the new ``param`` returned.

    ``scalars`` (one fp32 tensor, so a changing learning rate does not recompile) holds
    what ``_scalars`` derives on the host in double, each rounded once to fp32 as torch's
    fused CPU kernel does: [grad_coef, decay (AdamW: 1 - lr * wd; Adam: wd), 1 - beta1,
    beta2, 1 - beta2, sqrt(bias_correction2), eps, -lr / bias_correction1, skip]. The
    arithmetic follows that kernel's order; ``skip`` = 1 leaves everything as it was (an
    overflow under loss scaling)."""
    coef, decay, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, skip = scalars.unbind()
    keep = skip > 0
    grad = grad * coef
    if decoupled:
        new_param = param * decay
    else:
        new_param = param
        grad = grad + param * decay
    new_avg = exp_avg.lerp(grad, one_minus_beta1)
    new_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * grad * grad
    denom = new_avg_sq.sqrt() / bc2_sqrt + eps
    new_param = new_param + neg_step_size * new_avg / denom
    exp_avg.copy_(torch.where(keep, exp_avg, new_avg))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, new_avg_sq))
    return torch.where(keep, param, new_param)


def _adamw_and_cast(param, grad, exp_avg, exp_avg_sq, out, scalars, decoupled) -> None:
    """``_adamw`` of the fp32 ``param`` in place, then ``out.copy_(param)``."""
    param.copy_(_adamw(param, grad, exp_avg, exp_avg_sq, scalars, decoupled))
    out.copy_(param)


def _adamw_remainders(param, remainder, grad, exp_avg, exp_avg_sq, scalars, decoupled) -> None:
    """``_adamw`` of the fp32 master that bf16 ``param`` and int16 ``remainder`` hold
    (``precision_ops.join_master``), split back into them: one pass, no fp32 shard in memory."""
    master = join_master(param, remainder)
    new_param, low = split_master(_adamw(master, grad, exp_avg, exp_avg_sq, scalars, decoupled))
    param.copy_(new_param)
    remainder.copy_(low)


def _scalars(group: dict[str, Any], step: float, decoupled: bool) -> list[float]:
    """The kernel's constants for one param group at ``step``, in double (Python floats):
    ``1 - beta2`` in fp32 would be off by 1.3e-5 relative for beta2 = 0.999."""
    beta1, beta2 = (float(b) for b in group["betas"])
    lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
    return [
        1.0,
        1.0 - lr * weight_decay if decoupled else weight_decay,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        math.sqrt(1.0 - beta2**step),
        float(group["eps"]),
        -lr / (1.0 - beta1**step),
        0.0,
    ]


def compiler_unavailable() -> tuple[type[BaseException], ...]:
    """The errors that mean "the kernel cannot be compiled here" (no working C++ compiler,
    an inductor code-generation failure): torch.compile raises them, wrapped, as
    ``BackendCompilerFailed``. Anything else a kernel raises is a real error and surfaces."""
    from torch._dynamo.exc import BackendCompilerFailed

    return (BackendCompilerFailed,)


def compile_cpu_kernel(fn: Any) -> Any:
    """``torch.compile`` of ``fn``, an element-wise CPU kernel over flat tensors of any size;
    ``fn`` itself, as plain torch, while a user's ``TorchDispatchMode`` is active (torch's
    FlopCounterMode, CommDebugMode, a profiler's mode: from torch 2.10 dynamo compiles nothing
    under one, and with ``fullgraph=True`` raises).

    Inductor picks serial or OpenMP-parallel code from the first size it compiles for, and
    its on-disk cache keeps that choice for every later size: a small first tensor (a
    test, a tiny model) would leave every later 20M-element step on one core. A chunk of
    one element keeps the loop parallel; OpenMP's cost on a small tensor is microseconds.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    # inductor's C++ build says "No CUDA runtime is found" on CPU-only machines: noise here.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    compiled = torch.compile(fn, dynamic=True, fullgraph=True, options={"cpp.min_chunk_size": 1})

    @functools.wraps(fn)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        return (fn if _get_current_dispatch_mode() is not None else compiled)(*args, **kwargs)

    return kernel


_compiled: dict[Any, Any] = {}
_MOMENTS = ("exp_avg", "exp_avg_sq")


def _kernel(fn=_adamw_and_cast):
    if fn not in _compiled:
        _compiled[fn] = compile_cpu_kernel(fn)
    return _compiled[fn]


def applies_to(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """True for a stock Adam/AdamW on CPU whose groups use no option the kernel lacks."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or device.type != "cpu":
        return False
    return _options_fit(optimizer) and all(p.dtype == torch.float32 for g in optimizer.param_groups
                                           for p in g["params"])


def _options_fit(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every group uses only what the kernel computes: no amsgrad, maximize or
    differentiable, a Python-number lr and a tuple of betas. A load can install other values (a
    checkpoint saved with ``maximize=True``), so every load asks again (``CompiledAdamW.fits``)."""
    for group in optimizer.param_groups:
        if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
            return False
        if isinstance(group.get("lr"), torch.Tensor) or not isinstance(group.get("betas"), tuple):
            return False
    return True


def _plain_aliases(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """``plain_alias`` of each tensor; tensors over the same memory (a master shard that
    is the parameter shard) get the same alias, so the kernel sees that they are one."""
    seen: dict[int, torch.Tensor] = {}
    return [seen.setdefault(t.data_ptr(), plain_alias(t)) for t in tensors]


# Where nxd_smp chooses (``compile_update=None``), the kernel runs only for at least this many shard
# elements on the rank, or with parameter remainders (whose promise, no fp32 shard in memory, it
# keeps). Below it, it is no faster than torch's fused kernel plus the cast (median of
# 30 steps on 2 cores: 1.02 against 0.77 ms at 64K elements, 3.05 against 3.04 ms at 768K, 3.20
# against 3.43 ms at 1M, 33.8 against 38.8 ms at 16M), while its first step in a process costs 6.5 s
# with inductor's cache warm (loading dynamo and inductor) and several times that cold.
COMPILE_MIN_NUMEL = 1 << 20


class CompiledAdamW:
    """Steps a stock Adam/AdamW over flat fp32 shards and casts them into ``outs``."""

    @classmethod
    def where_it_applies(cls, optimizer: torch.optim.Optimizer, device: torch.device,
                         required: bool | None, shard_numel: int, remainders: bool) -> "CompiledAdamW | None":
        """The compiled update of ``optimizer`` where it applies (``applies_to``) and, unless
        ``required``, where it is faster (``shard_numel``, this rank's shard elements over every
        bucket, at least ``COMPILE_MIN_NUMEL``) or where it keeps the fp32 shards out of memory
        (``remainders``); else None.

        Raises:
            ValueError: ``required`` (``compile_update=True``) and it does not apply.
        """
        if applies_to(optimizer, device):
            faster = bool(required) or shard_numel >= COMPILE_MIN_NUMEL
            # (remainders compile the update at any size, for memory; the norm's kernel only where it pays, so
            # a small run's norm is the eager one whatever its memory options)
            return cls(optimizer, with_norm=faster) if faster or remainders else None
        if required:
            raise ConfigError(
                "compile_update=True needs torch.optim.Adam or AdamW on CPU with fp32 master shards and "
                "without amsgrad, maximize or differentiable; pass compile_update=None to use it only where "
                "it applies."
            )
        return None

    def __init__(self, optimizer: torch.optim.Optimizer, with_norm: bool = True):
        self.optimizer = optimizer
        self.with_norm = with_norm  # the gradient norm's compiled kernel runs beside it (where compiling pays)
        self.enabled = True
        self.fits = True  # the groups hold only what the kernel computes (asked again at each load)
        optimizer.register_load_state_dict_post_hook(lambda opt: self._loaded())

    def _loaded(self) -> None:
        """After a load: its state's allocations moved where the step wants them, and its groups
        asked whether the kernel still computes them (else torch's own step does)."""
        self.place_state()
        self.fits = _options_fit(self.optimizer)

    def step(
        self,
        grads: list[torch.Tensor],
        outs: list[torch.Tensor],
        coef: torch.Tensor | float | None,
        found_inf: torch.Tensor | None = None,
        remainders: list[torch.Tensor] | None = None,
    ) -> bool:
        """One step: ``grads[i]`` (scaled by ``coef``) updates the optimizer's i-th shard,
        which is then cast into ``outs[i]``; where ``found_inf`` nothing changes (and
        ``step`` does not advance). With ``remainders`` the i-th fp32 master is bf16
        ``outs[i]`` plus int16 ``remainders[i]`` (the optimizer's shards hold no data), updated
        in place. Returns False (nothing changed) if the kernel cannot be compiled here; the
        caller then uses the stock step."""
        if not (self.enabled and self.fits):
            return False
        kernel = _kernel(_adamw_and_cast if remainders is None else _adamw_remainders)
        index = 0
        for group in self.optimizer.param_groups:
            decoupled = bool(group.get("decoupled_weight_decay", type(self.optimizer) is torch.optim.AdamW))
            for shard in group["params"]:
                grad, out = grads[index], outs[index]
                index += 1
                state = self.create_state(shard, grad.numel())
                step = float(state["step"]) + 1  # a CPU tensor: no device sync
                scalars = torch.tensor(_scalars(group, step, decoupled), dtype=torch.float32)
                if coef is not None:
                    scalars[0] = coef
                if found_inf is not None:
                    scalars[8] = found_inf
                try:
                    with torch.no_grad():
                        if remainders is None:
                            kernel(*_plain_aliases(shard, grad, state["exp_avg"], state["exp_avg_sq"], out),
                                   scalars, decoupled)
                        else:
                            kernel(*_plain_aliases(out, remainders[index - 1], grad, state["exp_avg"],
                                                   state["exp_avg_sq"]), scalars, decoupled)
                except compiler_unavailable() as e:
                    if index > 1:
                        raise  # it ran for earlier shards: a real error, not a missing compiler
                    warnings.warn(
                        f"nxd_smp: compiling the one-pass AdamW update failed ({type(e).__name__}: "
                        f"{e}); using the inner optimizer's own step instead.",
                        stacklevel=3,
                    )
                    self.enabled = False
                    return False
                state["step"].add_(1 if found_inf is None else (~found_inf).float())
        return True

    def create_state(self, shard: torch.Tensor, numel: int) -> dict[str, Any]:
        """The optimizer's state for ``shard`` (of ``numel`` elements: a shard that holds no
        data between steps has none), created as torch.optim.Adam(W) creates it (its moments
        placed as ``nxd_smp.core.memory`` says)."""
        state = self.optimizer.state[shard]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device=shard.device)
            for key in _MOMENTS:
                state[key] = staggered_empty(numel, shard.dtype, shard.device, key).zero_()
        return state

    def place_state(self) -> None:
        """Move each shard's moments that do not start where ``nxd_smp.core.memory`` wants
        them (a loaded state) there: one copy per tensor, the old one freed right away."""
        for group in self.optimizer.param_groups:
            for shard in group["params"]:
                state = self.optimizer.state.get(shard, {})
                for key in _MOMENTS:
                    value = state.get(key)
                    if isinstance(value, torch.Tensor) and value.is_contiguous() and not is_staggered(value, key):
                        placed = staggered_empty(value.numel(), value.dtype, value.device, key).view(value.shape)
                        state[key] = placed.copy_(value)
                        del value
