"""Dynamic loss scaling for fp16 training (the Megatron / Colossal-AI rule).

The loss is multiplied by ``scale`` before backward; the optimizer divides the gradients
by it again in fp32, and a step whose gradients hold an inf or NaN is skipped on every
rank. Then the scale is updated with tensor operations only (no host sync, so it runs
inside one XLA graph):

* overflow: the clean-step count resets; after ``hysteresis`` overflows since the last
  growth the scale is multiplied by ``backoff_factor`` (not below ``min_scale``), and
  again on each further overflow until it grows;
* ``growth_interval`` clean steps in a row: the scale is multiplied by ``growth_factor``
  (not above ``max_scale``) and the overflow allowance is reset to ``hysteresis``.

The overflow allowance (``hysteresis_tracker``) counts down to 0 and stays there: Megatron's
counter goes on below zero, where every overflow backs off just as at 0, so stopping at 0
changes nothing the rule does, and neither int32 counter can wrap. Every state ``update`` reaches
lies in the box ``state_fit.check_scaler_state`` accepts (``scale`` in ``[min_scale, max_scale]``,
``growth_tracker`` in ``[0, growth_interval)``, ``hysteresis_tracker`` in ``[0, hysteresis]``),
and ``update`` never leaves that box.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..core.errors import CheckpointError, ConfigError
from .state_fit import INT32, as_fp32, check_scaler_state


class DynamicLossScaler:
    """Loss scale state and its update rule.

    Args:
        init_scale: starting scale (2**16).
        growth_factor: > 1 (2).
        backoff_factor: in (0, 1) (0.5).
        growth_interval: clean steps before growing (1000).
        hysteresis: overflows tolerated before backing off (2).
        growth_interval and hysteresis are at most 2**31 - 1 (int32 counts).
        min_scale, max_scale: bounds (1, 2**24), positive and finite in float32.
        device: where the state tensors live (the parameters' device).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        device: torch.device | str = "cpu",
    ):
        def positive(name, value):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}.")

        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            positive(name, locals()[name])
        if growth_factor <= 1:
            raise ConfigError(f"growth_factor must be > 1, got {growth_factor}.")
        if backoff_factor >= 1:
            raise ConfigError(f"backoff_factor must be < 1, got {backoff_factor}.")
        for name in ("growth_interval", "hysteresis"):
            value = locals()[name]
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32[1]:
                raise ConfigError(
                    f"{name} must be an int in [1, {INT32[1]}] (its tracker is an int32 count), got {value!r}."
                )
        if as_fp32(min_scale) <= 0 or not math.isfinite(as_fp32(max_scale)):
            raise ConfigError(
                f"min_scale and max_scale must stay positive and finite rounded to float32 (the scale's dtype; a "
                f"zero or inf scale makes every step overflow), got min_scale={min_scale}, max_scale={max_scale} "
                f"(in float32: {as_fp32(min_scale)}, {as_fp32(max_scale)}); keep max_scale at most "
                f"{torch.finfo(torch.float32).max} and min_scale at least {torch.finfo(torch.float32).tiny}."
            )
        if not min_scale <= init_scale <= max_scale:
            raise ConfigError(
                f"init_scale {init_scale} must lie in [min_scale, max_scale] = [{min_scale}, {max_scale}]."
            )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.scale = torch.tensor(float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.hysteresis_tracker = torch.full((), hysteresis, dtype=torch.int32, device=device)

    def to(self, device: torch.device | str) -> "DynamicLossScaler":
        self.scale = self.scale.to(device)
        self.growth_tracker = self.growth_tracker.to(device)
        self.hysteresis_tracker = self.hysteresis_tracker.to(device)
        return self

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (in the loss's dtype if it is at least fp32, else fp32)."""
        return loss.float() * self.scale.to(loss.device)

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the state after a step; ``found_inf`` is a 0-dim bool tensor. Tensor ops only (no
        host sync); the trackers stay in ``[0, growth_interval)`` and ``[0, hysteresis]``."""
        found = found_inf.to(self.scale.device).reshape(())
        # Both counts saturate instead of wrapping, whatever they hold: a growth count of at least
        # growth_interval - 1 grows on the next clean step either way, and an overflow allowance
        # stops at 0, where (as anywhere below it in Megatron's rule) every overflow backs off.
        growth = torch.where(found, torch.zeros_like(self.growth_tracker),
                             self.growth_tracker.clamp(max=self.growth_interval - 1) + 1)
        hysteresis = torch.where(found, self.hysteresis_tracker.clamp(min=1) - 1, self.hysteresis_tracker)
        back_off = found & (hysteresis <= 0)
        grow = ~found & (growth >= self.growth_interval)
        scale = torch.where(back_off, (self.scale * self.backoff_factor).clamp(min=self.min_scale), self.scale)
        scale = torch.where(grow, (scale * self.growth_factor).clamp(max=self.max_scale), scale)
        self.growth_tracker = torch.where(grow, torch.zeros_like(growth), growth)
        self.hysteresis_tracker = torch.where(grow, torch.full_like(hysteresis, self.hysteresis), hysteresis)
        self.scale = scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale.detach().clone(),
            "growth_tracker": self.growth_tracker.detach().clone(),
            "hysteresis_tracker": self.hysteresis_tracker.detach().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Install ``state`` (``state_dict()``'s), checked first (``check_scaler_state``): all of it
        or, refused, nothing.

        Raises:
            CheckpointError (a ``ValueError``): naming each field that is not a scaler's.
        """
        problems = check_scaler_state(state, self)
        if problems:
            raise CheckpointError("loss scaler state: " + "; ".join(f"loss_scaler{p}" for p in problems) + ".")
        device = self.scale.device
        new = [torch.as_tensor(state[key], dtype=dtype).to(device).clone() for key, dtype in
               (("scale", torch.float32), ("growth_tracker", torch.int32), ("hysteresis_tracker", torch.int32))]
        self.scale, self.growth_tracker, self.hysteresis_tracker = new
