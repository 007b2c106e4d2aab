"""The precision plan: every dtype one optimizer uses and how it rounds, decided once.

From the mixed-precision flags, the wire-dtype choice, stochastic rounding and one fact of the
device (which torch dtype it holds as fp32: ``torch.float32``, or ``torch.float64`` on an XLA device
under ``XLA_DOWNCAST_BF16=1``), per parameter dtype:

* ``master``: the master weights and the optimizer states (the inner optimizer's shards): the
  device's fp32 with ``use_master_weights``, else the parameter dtype;
* ``accumulation``: the gradient summed over micro-batches: the device's fp32 with
  ``use_fp32_grad_acc``, else the parameter dtype (autograd's ``.grad``);
* ``wire``: the gradient's reduce-scatter: ``reduce_dtype`` if given (a dtype; ``"param"``: the
  parameter dtype; ``"master"``: the master dtype, torch_xla's ``higher_cc_precision``), else the
  accumulation dtype;
* ``norm``: the global gradient norm: the device's fp32;
* ``rounding``: how the master becomes the parameter: ``"nearest_even"`` (torch's cast),
  ``"ties_away"`` (``use_param_remainders``: the bf16 half of the fp32 bit pattern) or
  ``"stochastic"`` (legacy mode with ``stochastic_rounding``: the bf16 update computed in fp32 and
  rounded stochastically).

Nothing else in nxd_smp decides a dtype of the optimizer step; everything asks the plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..backend import Backend
from ..core.environment import XLA_DOWNCAST_BF16
from ..core.errors import ConfigError
from ..mixed_precision_config import MixedPrecisionConfig

ROUNDINGS = ("nearest_even", "ties_away", "stochastic")


@dataclass(frozen=True)
class PrecisionPlan:
    """Every dtype of one optimizer's step; build it with ``resolve``.

    Attributes:
        fp32: the torch dtype the device holds as fp32.
        master_weights: fp32 master weights and states (``use_master_weights``).
        fp32_accumulation: fp32 gradient accumulation (``use_fp32_grad_acc``).
        reduce: ``reduce_dtype`` as configured (None, a torch dtype, ``"param"`` or ``"master"``).
        rounding: one of ``ROUNDINGS``.
    """

    fp32: torch.dtype = torch.float32
    master_weights: bool = True
    fp32_accumulation: bool = True
    reduce: torch.dtype | str | None = None
    rounding: str = "nearest_even"

    def __post_init__(self) -> None:
        if self.rounding not in ROUNDINGS:
            raise ConfigError(f"rounding must be one of {ROUNDINGS}, got {self.rounding!r}.")

    @classmethod
    def resolve(
        cls,
        mixed_precision: MixedPrecisionConfig,
        *,
        backend: Backend | None = None,
        param_dtypes: Iterable[torch.dtype] = (),
        reduce_dtype: torch.dtype | str | None = None,
        stochastic_rounding: bool = False,
    ) -> "PrecisionPlan":
        """The plan of an optimizer over parameters of ``param_dtypes`` on ``backend``'s device (which
        says what torch dtype the device holds as fp32; None: torch.float32).

        Raises:
            ConfigError: parameter remainders where they cannot be exact (parameters that are
                not bf16; ``XLA_DOWNCAST_BF16``, where the parameters are torch float32).
        """
        device_fp32 = torch.float32 if backend is None else backend.fp32
        rounding = "nearest_even"
        if mixed_precision.use_param_remainders:
            rounding = "ties_away"
            if device_fp32 != torch.float32:
                raise ConfigError(
                    f"use_param_remainders=True keeps fp32 masters as bf16 parameters plus 16 bits, but under "
                    f"{XLA_DOWNCAST_BF16}=1 the parameters are torch float32 (bf16 on the device) and the masters "
                    f"float64. Turn use_param_remainders off, or unset {XLA_DOWNCAST_BF16} and cast the model to "
                    f"torch.bfloat16."
                )
            others = sorted({str(d) for d in param_dtypes if d != torch.bfloat16})
            if others:
                raise ConfigError(
                    f"use_param_remainders=True keeps fp32 masters as bf16 parameters plus 16 bits; these "
                    f"parameters are {others}. Cast the model to torch.bfloat16, or turn use_param_remainders off."
                )
        elif stochastic_rounding:
            rounding = "stochastic"
        return cls(device_fp32, mixed_precision.use_master_weights, mixed_precision.use_fp32_grad_acc,
                   reduce_dtype, rounding)

    def master(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the master weights and the optimizer states of parameters of ``param_dtype``."""
        return self.fp32 if self.master_weights else param_dtype

    def accumulation(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradient of parameters of ``param_dtype`` is summed over micro-batches in."""
        return self.fp32 if self.fp32_accumulation else param_dtype

    def wire(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype the gradient of parameters of ``param_dtype`` is reduce-scattered in."""
        if self.reduce is None:
            return self.accumulation(param_dtype)
        if self.reduce == "param":
            return param_dtype
        if self.reduce == "master":
            return self.master(param_dtype)
        return self.reduce

    @property
    def norm(self) -> torch.dtype:
        """The dtype of the global gradient norm: the device's fp32."""
        return self.fp32

    @property
    def remainders(self) -> bool:
        """The master is the bf16 parameter plus an int16 remainder (``rounding == "ties_away"``)."""
        return self.rounding == "ties_away"

    @property
    def stochastic(self) -> bool:
        """The low-precision update is rounded stochastically."""
        return self.rounding == "stochastic"

    def fp32_shards(self, param_dtypes: Iterable[torch.dtype]) -> bool:
        """Whether every shard of parameters of ``param_dtypes`` is the device's fp32 and rounds to
        nearest: where a fused kernel computes exactly what the stock one does."""
        return not self.stochastic and all(self.master(d) == self.fp32 for d in param_dtypes)
