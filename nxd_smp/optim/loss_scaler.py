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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..core.errors import CheckpointError, ConfigError

#: The keys of a ``DynamicLossScaler`` state.
SCALER_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")
_INT32 = (-(2**31), 2**31 - 1)


def _number(value: Any) -> float | None:
    """A 0-dim real tensor's or a Python number's value (never a bool), else None."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_complex or value.dtype == torch.bool:
            return None
        return float(value.detach().to("cpu", torch.float64))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def check_scaler_state(saved: Any, scaler: "DynamicLossScaler | None" = None) -> list[str]:
    """The problems of ``saved`` as a ``DynamicLossScaler`` state, each starting with the field
    (``['scale'] = nan, ...``); empty if ``load_state_dict`` takes it as a state the scaler could
    have reached: exactly ``SCALER_KEYS``, each a 0-dim real tensor or a Python number; ``scale``
    positive and finite in float32 (what the constructor asks of ``init_scale``: a NaN or inf
    scale skips every later step, and training stalls silently); the trackers whole numbers in
    int32, ``growth_tracker`` non-negative (``hysteresis_tracker`` goes below zero by itself while
    overflows continue). ``scaler``: the live one (its bounds are not imposed: the next update
    clamps, and a run may change them). Changes nothing."""
    if not isinstance(saved, Mapping):
        return [f" is a {type(saved).__name__}, not a dict of {list(SCALER_KEYS)}"]
    if set(saved) != set(SCALER_KEYS):
        return [f" has the keys {sorted(map(str, saved))}, a loss scaler's are {sorted(SCALER_KEYS)}"]
    problems = []
    for key in SCALER_KEYS:
        value = _number(saved[key])
        if value is None:
            problems.append(f"[{key!r}] is a {type(saved[key]).__name__}, not a 0-dim real number")
        elif key == "scale":
            as_fp32 = float(torch.tensor(value, dtype=torch.float64).to(torch.float32))
            if not (math.isfinite(as_fp32) and as_fp32 > 0):
                problems.append(f"['scale'] = {value!r}, not a positive number finite in float32")
        elif not math.isfinite(value) or value != math.floor(value):
            problems.append(f"[{key!r}] = {value!r}, not a whole number")
        elif not _INT32[0] <= value <= _INT32[1] or (key == "growth_tracker" and value < 0):
            low = 0 if key == "growth_tracker" else _INT32[0]
            problems.append(f"[{key!r}] = {value!r}, not in [{low}, {_INT32[1]}]")
    return problems


class DynamicLossScaler:
    """Loss scale state and its update rule.

    Args:
        init_scale: starting scale (2**16).
        growth_factor: > 1 (2).
        backoff_factor: in (0, 1) (0.5).
        growth_interval: clean steps before growing (1000).
        hysteresis: overflows tolerated before backing off (2).
        min_scale, max_scale: bounds (1, 2**24).
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
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}.")
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
        """Advance the state after a step; ``found_inf`` is a 0-dim bool tensor."""
        found = found_inf.to(self.scale.device).reshape(())
        growth = torch.where(found, torch.zeros_like(self.growth_tracker), self.growth_tracker + 1)
        hysteresis = torch.where(found, self.hysteresis_tracker - 1, self.hysteresis_tracker)
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

    def check_state(self, state: Any) -> list[str]:
        """``check_scaler_state(state, self)``: the problems of ``state`` as this scaler's state."""
        return check_scaler_state(state, self)

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
