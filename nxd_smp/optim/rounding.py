"""How an fp32 value becomes a lower-precision one, where nxd_smp chooses: stochastic rounding
(legacy mode's bf16 update) and the exact split of an fp32 master into a bf16 parameter and an
int16 remainder (``use_param_remainders``, whose parameters round to nearest with ties away from
zero). Round to nearest even, the default, is torch's own cast. Which one a run uses is the
precision plan's (``optim.precision``); ``nxd_smp.precision_ops`` re-exports these for users.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.errors import ConfigError

_F32 = torch.float32


# ---------------------------------------------------------------------------- stochastic rounding
def stochastic_round(x: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 ``x`` to bf16 stochastically: to the bf16 neighbour on the far side with
    probability equal to the fraction of the way to it, so the result is unbiased
    (``E[round(x)] = x``). Seeded through ``generator`` (on ``x``'s device). inf and NaN
    are kept.

    Float arithmetic only (no bit views of the tensor, which XLA would run on the host): the
    nearest bf16 value, the spacing of bf16 values there (2^(e-7) for |value| in [2^e,
    2^(e+1)), half that below a power of two, 2^-133 among subnormals), one uniform draw.
    """
    if x.dtype != _F32:
        raise ConfigError(f"stochastic_round takes fp32 input, got {x.dtype}.")
    nearest = x.to(torch.bfloat16).float()
    diff = x - nearest  # exact: both are fp32 and close
    exponent = torch.floor(torch.log2(nearest.abs())).clamp(min=-126)  # log2(0) = -inf -> -126
    spacing = torch.pow(2.0, exponent - 7)
    toward_zero = (torch.sign(diff) != torch.sign(nearest)) & (nearest != 0)
    below_power_of_two = toward_zero & (nearest.abs() == torch.pow(2.0, exponent)) & (exponent > -126)
    spacing = torch.where(below_power_of_two, spacing * 0.5, spacing)
    draw = torch.rand(x.shape, generator=generator, device=x.device)
    rounded = torch.where(draw < diff.abs() / spacing, nearest + torch.sign(diff) * spacing, nearest)
    return torch.where(torch.isfinite(x), rounded, x).to(torch.bfloat16)


# ---------------------------------------------------------------------------- parameter remainders
def _view(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.view(dtype)


Bitcast = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def split_master(master: torch.Tensor, bitcast: Bitcast = _view) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` as a bf16 value and an int16 remainder, exactly (``join_master``
    inverts it): the bf16 is the upper half of the fp32 bit pattern, rounded on the bit
    pattern as TransformerEngine does (up in magnitude when the lower half is 0x8000 or more:
    to nearest, ties away from zero), and the remainder is the lower half.

    Sixteen bits cannot tell which fp32 values round to nearest-even onto a bf16 (an even
    bf16 has 65,537 of them); with this rounding every bf16 has exactly 65,536, so the pair
    is the fp32 value. It differs from nearest-even only on ties (lower half exactly 0x8000
    under an even upper half). A NaN stays NaN.

    ``bitcast(tensor, dtype)`` reinterprets bits (``Tensor.view(dtype)`` by default; the
    backends give one that stays on the device).
    """
    if master.dtype != _F32:
        raise ConfigError(f"split_master takes an fp32 tensor, got {master.dtype}.")
    bits = bitcast(master, torch.int32)
    # Right shifts only of multiples of 2^16 (torch_xla shifts negative numbers toward zero).
    low = (bits << 16) >> 16  # the lower half, sign-extended: negative when it is 0x8000 or more
    high = (bits - low) >> 16  # the upper half, plus one where ``low`` is negative: the rounding
    param = bitcast(high.to(torch.int16), torch.bfloat16)
    param = torch.where(torch.isnan(master), master.to(torch.bfloat16), param)  # 0x7FFF + 1 is no NaN
    return param, low.to(torch.int16)


def join_master(param: torch.Tensor, remainder: torch.Tensor, bitcast: Bitcast = _view) -> torch.Tensor:
    """The fp32 value that ``split_master`` turned into bf16 ``param`` and int16 ``remainder``.
    A remainder of zero gives ``param`` itself."""
    if param.dtype != torch.bfloat16 or remainder.dtype != torch.int16:
        raise ConfigError(
            f"join_master takes a bf16 parameter and an int16 remainder, got {param.dtype} and {remainder.dtype}."
        )
    high = bitcast(param, torch.int16).to(torch.int32)
    return bitcast((high << 16) + remainder.to(torch.int32), _F32)  # undoes the rounding of a negative low half


def round_ties_away(x: torch.Tensor, bitcast: Bitcast = _view) -> torch.Tensor:
    """fp32 ``x`` to bf16, to nearest with ties away from zero (the parameter that
    ``split_master`` keeps)."""
    return split_master(x, bitcast)[0]
