"""The model-side half of standard mixed precision.

* fp32 precision-sensitive ops that take bf16/fp16 input, compute in fp32 and return the
  caller's dtype unless asked otherwise: ``softmax``, ``log_softmax``, ``cross_entropy``,
  ``layer_norm``, ``rms_norm``, ``residual_add``;
* fp32 modules: ``set_fp32_attr_to_module`` marks a submodule, ``cast_model`` casts the
  rest and keeps marked ones fp32 (inputs cast to fp32, outputs back), ``NaiveAMPModel``
  wraps a model to cast its inputs (and optionally return fp32 outputs);
* dtype names: ``parse_dtype`` / ``apply_dtype`` (``"torch.tf32"`` is fp32 storage with
  TF32 matmuls on CUDA);
* ``stochastic_round``: fp32 -> bf16, unbiased and seeded, the software stand-in for
  Neuron's hardware stochastic rounding on other devices;
* ``split_master`` / ``join_master``: an fp32 value as a bf16 value plus an int16 remainder
  and back, exactly (TransformerEngine's parameter remainders); ``round_ties_away`` is the
  rounding that split makes.

Numerics only: nothing here knows about sharding or reads the environment (the Neuron
runtime's stochastic rounding is ``nxd_smp.core.environment.set_stochastic_rounding``). The
rounding functions live with the optimizer parts that use them (``nxd_smp.optim.rounding``) and
are re-exported here.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_map_only

from .core.errors import ConfigError
from .optim.rounding import join_master, round_ties_away, split_master, stochastic_round

__all__ = [
    "softmax",
    "log_softmax",
    "cross_entropy",
    "layer_norm",
    "rms_norm",
    "residual_add",
    "set_fp32_attr_to_module",
    "is_fp32_module",
    "cast_model",
    "NaiveAMPModel",
    "parse_dtype",
    "apply_dtype",
    "stochastic_round",
    "split_master",
    "join_master",
    "round_ties_away",
]

log = logging.getLogger(__name__)
_F32 = torch.float32


def _wide(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype: fp32, or fp64 for fp64 input (so gradcheck can run)."""
    return torch.float64 if dtype == torch.float64 else _F32


def _masked_scores(x: torch.Tensor, scale: float | None, mask: torch.Tensor | None) -> torch.Tensor:
    wide = _wide(x.dtype)
    y = x.to(wide)
    if scale is not None:
        y = y * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            # True = may attend (torch's scaled_dot_product_attention convention). A fully
            # masked row gets the finite minimum, so it is uniform rather than NaN.
            y = y.masked_fill(~mask, torch.finfo(wide).min)
        else:
            y = y + mask.to(wide)  # an additive mask, e.g. 0 / -inf
    return y


def softmax(
    x: torch.Tensor,
    dim: int = -1,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``softmax(x * scale + mask)`` computed in fp32, returned in ``out_dtype`` (default:
    ``x``'s dtype). ``mask``: bool (True = keep) or additive, broadcastable to ``x``."""
    return torch.softmax(_masked_scores(x, scale, mask), dim).to(out_dtype or x.dtype)


def log_softmax(
    x: torch.Tensor,
    dim: int = -1,
    *,
    scale: float | None = None,
    mask: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``log_softmax`` in fp32, as ``softmax``."""
    return torch.log_softmax(_masked_scores(x, scale, mask), dim).to(out_dtype or x.dtype)


# Rows of logits upcast to fp32 at a time: bounds the transient fp32 copy to ~64 MiB.
_CE_CHUNK_ELEMENTS = 1 << 24


class _CrossEntropy(torch.autograd.Function):
    """Per-row ``logsumexp(z) - z[target]`` in fp32, a few rows at a time, so that bf16
    logits over a large vocabulary never get a full-size fp32 copy; the gradient
    ``softmax(z) - onehot(target)`` is likewise built chunk by chunk in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int) -> torch.Tensor:
        rows, vocab = logits.shape
        step = max(1, _CE_CHUNK_ELEMENTS // max(vocab, 1))
        wide = _wide(logits.dtype)
        lse = torch.empty(rows, dtype=wide, device=logits.device)
        picked = torch.empty(rows, dtype=wide, device=logits.device)
        valid = target != ignore_index
        safe_target = torch.where(valid, target, torch.zeros_like(target))
        for start in range(0, rows, step):
            z = logits[start : start + step].to(wide)
            lse[start : start + step] = torch.logsumexp(z, dim=-1)
            picked[start : start + step] = z.gather(1, safe_target[start : start + step, None]).squeeze(1)
        ctx.save_for_backward(logits, safe_target, valid, lse)
        return torch.where(valid, lse - picked, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, valid, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        step = max(1, _CE_CHUNK_ELEMENTS // max(vocab, 1))
        grad = torch.empty_like(logits)
        wide = lse.dtype
        scale = (grad_loss.to(wide) * valid).unsqueeze(1)
        for start in range(0, rows, step):
            end = min(rows, start + step)
            p = torch.exp(logits[start:end].to(wide) - lse[start:end, None])
            p.scatter_add_(1, target[start:end, None], -torch.ones(end - start, 1, dtype=wide, device=p.device))
            grad[start:end] = (p * scale[start:end]).to(logits.dtype)
        return grad, None, None


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of (low-precision) ``logits`` ``[..., vocab]`` against integer
    ``target`` ``[...]``, computed in fp32 without a full-size fp32 copy of the logits.

    Returns an fp32 loss (fp64 for fp64 logits): per element (``reduction="none"``), summed, or averaged over the
    targets that are not ``ignore_index``.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ConfigError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")
    if logits.shape[:-1] != target.shape:
        raise ConfigError(
            f"logits {tuple(logits.shape)} and target {tuple(target.shape)} do not match: logits "
            f"must be target's shape plus a vocabulary dimension."
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"target must hold class indices (int64), got {target.dtype}.")
    flat = logits.reshape(-1, logits.shape[-1])
    losses = _CrossEntropy.apply(flat, target.reshape(-1).long(), ignore_index)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    count = (target != ignore_index).sum().clamp(min=1)
    return losses.sum() / count


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Layer norm over the last dimension with fp32 statistics and fp32 affine; weights
    may be in any dtype."""
    wide = _wide(x.dtype)
    w = None if weight is None else weight.to(wide)
    b = None if bias is None else bias.to(wide)
    y = F.layer_norm(x.to(wide), x.shape[-1:], w, b, eps)
    return y.to(out_dtype or x.dtype)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """RMS norm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``, in fp32."""
    xf = x.to(_wide(x.dtype))
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    return y.to(out_dtype or x.dtype)


def residual_add(
    x: torch.Tensor, residual: torch.Tensor, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x + residual`` in fp32, returned in ``out_dtype`` (default: the residual's dtype, so
    an fp32 residual stream stays fp32, as Megatron's ``fp32_residual_connection``)."""
    wide = _wide(torch.promote_types(x.dtype, residual.dtype))
    return (x.to(wide) + residual.to(wide)).to(out_dtype or residual.dtype)


# ---------------------------------------------------------------------------- fp32 modules
_FP32_MODULES: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_CAST_HOOKS: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def set_fp32_attr_to_module(module: nn.Module) -> nn.Module:
    """Mark ``module`` (and everything inside it) to stay fp32 under ``cast_model``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(module).__name__}.")
    _FP32_MODULES.add(module)
    return module


def is_fp32_module(module: nn.Module) -> bool:
    return module in _FP32_MODULES


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating tensor inside (tuples, lists, dicts, ...) cast to ``dtype``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


def cast_model(model: nn.Module, dtype: torch.dtype | str) -> nn.Module:
    """Cast ``model`` to ``dtype`` (bf16, fp16, fp32 or a name ``parse_dtype`` accepts),
    keeping modules marked with ``set_fp32_attr_to_module`` in fp32: their floating inputs
    are cast to fp32 and their floating outputs back to ``dtype``. In place; returns it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}.")
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"cast_model dtype must be bf16, fp16 or fp32, got {dtype}.")
    model.to(dtype)
    marked = [m for m in model.modules() if m in _FP32_MODULES]
    for module in marked:
        module.float()
        old = _CAST_HOOKS.pop(module, None)
        if old is not None:
            for handle in old:
                handle.remove()
        pre = module.register_forward_pre_hook(
            lambda _m, args, kwargs: (_cast_floats(args, _F32), _cast_floats(kwargs, _F32)), with_kwargs=True
        )
        post = module.register_forward_hook(lambda _m, _args, out, dtype=dtype: _cast_floats(out, dtype))
        _CAST_HOOKS[module] = (pre, post)
    return model


class NaiveAMPModel(nn.Module):
    """InternEvo's ``NaiveAMPModel``: ``model`` run in ``dtype``.

    The wrapped model is cast with ``cast_model`` (modules marked with
    ``set_fp32_attr_to_module`` stay fp32); floating inputs are cast to ``dtype`` on the way
    in, outputs to fp32 on the way out when ``output_to_fp32``. With ``sync_buffer`` the
    module's buffers (BatchNorm statistics, ...) are broadcast from the first rank of the
    data-parallel group before each forward in training mode and before the first forward
    after ``eval()``, so every rank computes with the same ones.

    Args:
        model: the module to wrap (cast in place).
        output_to_fp32: cast floating outputs to fp32.
        parallel_mode: the data-parallel ``torch.distributed`` process group (InternEvo
            passes a ``ParallelMode``; here a process group stands for it). None: the
            default group when torch.distributed is initialised, else no synchronisation.
        sync_buffer: broadcast the buffers as above.
        dtype: bf16 (default), fp16, fp32, or a name ``parse_dtype`` accepts.
    """

    def __init__(
        self,
        model: nn.Module,
        output_to_fp32: bool = True,
        parallel_mode: dist.ProcessGroup | None = None,
        sync_buffer: bool = True,
        dtype: torch.dtype | str = torch.bfloat16,
    ):
        super().__init__()
        for name, value in (("output_to_fp32", output_to_fp32), ("sync_buffer", sync_buffer)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}.")
        if parallel_mode is not None and not isinstance(parallel_mode, dist.ProcessGroup):
            raise TypeError(
                f"parallel_mode must be a torch.distributed ProcessGroup (the data-parallel group) "
                f"or None, got {type(parallel_mode).__name__}."
            )
        self.dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
        self.output_to_fp32 = output_to_fp32
        self.model = cast_model(model, self.dtype)
        distributed = dist.is_available() and dist.is_initialized()
        self._group = parallel_mode
        self._sync_buf = sync_buffer and distributed and dist.get_world_size(parallel_mode) > 1
        self._first_eval_run = False

    @property
    def sync_buffer(self) -> bool:
        """Whether buffers are broadcast before forward (False without a group of 2+ ranks)."""
        return self._sync_buf

    @sync_buffer.setter
    def sync_buffer(self, state: bool) -> None:
        self._sync_buf = bool(state)

    def train(self, mode: bool = True) -> "NaiveAMPModel":
        super().train(mode)
        self._first_eval_run = not mode
        return self

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        for buffer in self.model.buffers():
            dist.broadcast(buffer, src=src, group=self._group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_buf and (self.training or self._first_eval_run):
            self._broadcast_buffers()
            self._first_eval_run = False
        out = self.model(*_cast_floats(args, self.dtype), **_cast_floats(kwargs, self.dtype))
        return _cast_floats(out, _F32) if self.output_to_fp32 else out


# ---------------------------------------------------------------------------- dtype names
_DTYPE_NAMES = {
    "torch.float16": torch.float16,
    "torch.half": torch.float16,
    "torch.bfloat16": torch.bfloat16,
    "torch.float32": torch.float32,
    "torch.float": torch.float32,
    "torch.tf32": torch.float32,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The storage dtype for a config name (``"torch.bfloat16"``, ``"torch.half"``,
    ``"torch.tf32"`` = fp32 storage, ...) or a torch dtype.

    Raises:
        ConfigError: for anything else, listing the accepted names.
    """
    if isinstance(name, torch.dtype) and name in _DTYPE_NAMES.values():
        return name
    if isinstance(name, str) and name.strip() in _DTYPE_NAMES:
        return _DTYPE_NAMES[name.strip()]
    raise ConfigError(
        f"unknown dtype {name!r}; accepted: {sorted(_DTYPE_NAMES)} or torch.float16, "
        f"torch.bfloat16, torch.float32."
    )


def apply_dtype(name: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """``parse_dtype``, and for ``"torch.tf32"`` enable TF32 matmuls where they exist
    (``torch.backends.cuda.matmul.allow_tf32`` and ``torch.backends.cudnn.allow_tf32`` on a
    CUDA device); on CPU/XLA tf32 is plain fp32 and a log line says so."""
    dtype = parse_dtype(name)
    if isinstance(name, str) and name.strip() == "torch.tf32":
        if torch.device(device).type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        else:
            log.info("torch.tf32 on %s: TF32 matmuls exist only on CUDA; computing in fp32.", device)
    return dtype
