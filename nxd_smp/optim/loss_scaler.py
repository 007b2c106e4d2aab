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
lies in the box ``check_scaler_state`` accepts (``scale`` in ``[min_scale, max_scale]``,
``growth_tracker`` in ``[0, growth_interval)``, ``hysteresis_tracker`` in ``[0, hysteresis]``),
and ``update`` never leaves that box.
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


def _fp32(value: float) -> float:
    """``value`` rounded to float32 (what the scale tensor holds, and what ``clamp`` compares with)."""
    return float(torch.tensor(value, dtype=torch.float64).to(torch.float32))


def _scale_problem(value: float, scaler: "DynamicLossScaler | None") -> str | None:
    as_fp32 = _fp32(value)
    if not (math.isfinite(as_fp32) and as_fp32 > 0):
        return (f"['scale'] = {value!r}, not a positive number finite in float32: a NaN, inf or zero scale "
                f"makes every step overflow, so every later step is skipped")
    if scaler is None:
        return None
    low, high = _fp32(scaler.min_scale), _fp32(scaler.max_scale)
    if low <= as_fp32 <= high:
        return None
    if as_fp32 > high:
        why = ("update() only backs it off on an overflow, by backoff_factor each time, so every step until it "
               "is back in range is likely skipped (near the float32 maximum every step overflows)")
    else:
        why = ("update() grows it only by growth_factor each growth_interval clean steps, while small gradients "
               "underflow to zero in fp16, and the next back-off would jump it up to min_scale")
    return (f"['scale'] = {value!r}, not in this scaler's [min_scale, max_scale] = [{low!r}, {high!r}], the "
            f"range update() keeps it in: {why}; build the DynamicLossScaler with bounds that hold it")


def _tracker_problem(key: str, value: float, scaler: "DynamicLossScaler | None") -> str | None:
    if not math.isfinite(value) or value != math.floor(value):
        return f"[{key!r}] = {value!r}, not a whole number: the tracker is an int32 count"
    if scaler is None:
        if 0 <= value <= _INT32[1]:
            return None
        return (f"[{key!r}] = {value!r}, not in [0, {_INT32[1]}]: the tracker is an int32 count that update() "
                f"never takes below 0")
    if key == "growth_tracker":
        high = scaler.growth_interval - 1
        if 0 <= value <= high:
            return None
        return (f"['growth_tracker'] = {value!r}, not in [0, growth_interval - 1] = [0, {high}]: update() resets "
                f"it to 0 on an overflow and on reaching growth_interval, so it never saves one at or above it; it "
                f"would grow the scale on the next clean step, sooner than the saving run would have (and one "
                f"near the int32 maximum wrapped the pre-clamp count negative, so the scale never grew again); "
                f"build the DynamicLossScaler with a growth_interval above it")
    high = scaler.hysteresis
    if value > high:
        return (f"['hysteresis_tracker'] = {value!r}, not in [0, hysteresis] = [0, {high}]: update() resets it to "
                f"hysteresis on each growth and counts it down on each overflow; with more, the scaler skips that "
                f"many overflowing steps before it backs off (near the int32 maximum, practically never); build "
                f"the DynamicLossScaler with a hysteresis of at least {value:.0f}")
    if value < 0:
        return (f"['hysteresis_tracker'] = {value!r}, not in [0, hysteresis] = [0, {high}]: update() stops "
                f"counting it down at 0, where every overflow backs off (only the pre-release update went below "
                f"0, and from the int32 minimum its next overflow wrapped the count to the maximum, after which "
                f"the scaler never backed off and skipped every step); set it to 0, which behaves the same")
    return None


def check_scaler_state(saved: Any, scaler: "DynamicLossScaler | None" = None) -> list[str]:
    """The problems of ``saved`` as a ``DynamicLossScaler`` state, each starting with the field
    (``['scale'] = nan, ...``) and saying the value, the range and what ``update`` would do with it;
    empty if ``load_state_dict`` takes it. Changes nothing.

    ``saved`` must hold exactly ``SCALER_KEYS``, each a 0-dim real tensor or a Python number (not a
    bool), with ``scale`` positive and finite once rounded to float32 and both trackers whole numbers.
    With ``scaler`` (the live one) the values must also lie in the box its ``update`` keeps to and can
    count from without its int32 counters wrapping:

    * ``scale`` (rounded to float32) in ``[min_scale, max_scale]`` (each rounded to float32);
    * ``growth_tracker`` in ``[0, growth_interval - 1]``;
    * ``hysteresis_tracker`` in ``[0, hysteresis]``. Negative values, which the update before the
      clamp at 0 saved after overflows in a row, are refused, not read as 0: nxd_smp has had no
      release that saved them, and the message says to set them to 0 (the same behaviour).

    Without ``scaler``: the kinds above, and both trackers in ``[0, 2**31 - 1]`` (int32, and no
    scaler counts below 0).
    """
    if not isinstance(saved, Mapping):
        return [f" is a {type(saved).__name__}, not a dict of {list(SCALER_KEYS)}"]
    if set(saved) != set(SCALER_KEYS):
        return [f" has the keys {sorted(map(str, saved))}, a loss scaler's are {sorted(SCALER_KEYS)}"]
    problems = []
    for key in SCALER_KEYS:
        value = _number(saved[key])
        if value is None:
            problem = f"[{key!r}] is a {type(saved[key]).__name__}, not a 0-dim real number"
        elif key == "scale":
            problem = _scale_problem(value, scaler)
        else:
            problem = _tracker_problem(key, value, scaler)
        if problem:
            problems.append(problem)
    return problems


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
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _INT32[1]:
                raise ConfigError(
                    f"{name} must be an int in [1, {_INT32[1]}] (its tracker is an int32 count), got {value!r}."
                )
        if _fp32(min_scale) <= 0 or not math.isfinite(_fp32(max_scale)):
            raise ConfigError(
                f"min_scale and max_scale must stay positive and finite rounded to float32 (the scale's dtype; a "
                f"zero or inf scale makes every step overflow), got min_scale={min_scale}, max_scale={max_scale} "
                f"(in float32: {_fp32(min_scale)}, {_fp32(max_scale)}); keep max_scale at most "
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
