"""Every environment variable nxd_smp reads or sets, and what the XLA runtime has done.

* ``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16`` (read, by ``xla_bf16_variable`` alone): torch_xla's
  deprecated switches that change what an XLA device stores for torch's float types.
  ``XLA_DOWNCAST_BF16=1`` stores float32 as bf16 and float64 as fp32: NxD Training's default
  precision (``mixed_precision``) and NxD's Llama launch scripts use it, with the model in
  torch fp32 and the masters, states and accumulation in torch float64 (fp32 on the device),
  which nxd_smp does too (its XLA backend reads this). ``XLA_USE_BF16=1`` stores float64 as
  bf16 as well, so no fp32 master could exist: ``check_master_weights_storage`` refuses it
  while master weights are on.
* ``NEURON_RT_STOCHASTIC_ROUNDING_EN`` (set): the Neuron runtime's stochastic rounding,
  read once when the runtime starts; standard mixed precision wants it off (``0``).
  ``set_stochastic_rounding`` sets it, and refuses a change the runtime would ignore.

Nothing else in nxd_smp touches ``os.environ``.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, MutableMapping

from .errors import ConfigError

#: torch_xla: float32 and float64 both stored as bf16 on an XLA device.
XLA_USE_BF16 = "XLA_USE_BF16"
#: torch_xla: float32 stored as bf16 and float64 as fp32 on an XLA device.
XLA_DOWNCAST_BF16 = "XLA_DOWNCAST_BF16"

#: The Neuron runtime's switch for stochastic rounding ("0" = round to nearest).
SR_VARIABLE = "NEURON_RT_STOCHASTIC_ROUNDING_EN"
_NEURON_SR_DEFAULT = "1"  # the Neuron runtime rounds stochastically unless told otherwise


def xla_bf16_variable(environ: Mapping[str, str] | None = None) -> str | None:
    """Which of torch_xla's bf16 switches is on: ``"XLA_USE_BF16"`` (it wins when both are:
    float64 is then bf16 too), ``"XLA_DOWNCAST_BF16"``, or None. A value other than empty or
    ``0`` counts as on, as torch_xla reads it. The only place these variables are read."""
    env = os.environ if environ is None else environ
    for name in (XLA_USE_BF16, XLA_DOWNCAST_BF16):
        if env.get(name, "").strip() not in ("", "0"):
            return name
    return None


def check_master_weights_storage(environ: Mapping[str, str] | None = None) -> None:
    """Refuse master weights where no torch dtype is fp32 on an XLA device (``XLA_USE_BF16``).

    Called by ``neuronx_distributed_config`` when its config has master weights, and by the
    optimizers when they are built with master weights. ``XLA_DOWNCAST_BF16`` is accepted: the
    masters are then torch float64, fp32 on the device.

    Raises:
        ConfigError: naming the variable and the fix.
    """
    if xla_bf16_variable(environ) == XLA_USE_BF16:
        value = (os.environ if environ is None else environ)[XLA_USE_BF16]
        raise ConfigError(
            f"{XLA_USE_BF16}={value!r} is set while use_master_weights=True: it makes torch_xla store "
            f"float32 and float64 alike as bf16, so the master weights could not be fp32. Unset "
            f"{XLA_USE_BF16} (or set it to 0) and cast the model with model.to(torch.bfloat16), or use "
            f"{XLA_DOWNCAST_BF16}=1 (NxD's mixed precision: fp32 masters as torch float64)."
        )


def xla_runtime_started() -> bool:
    """Whether torch_xla's runtime (PJRT client) exists in this process. False when
    torch_xla was never imported: then its runtime cannot have started."""
    torch_xla = sys.modules.get("torch_xla")
    return torch_xla is not None and bool(torch_xla._XLAC._xla_runtime_is_initialized())


def xla_device_type() -> str | None:
    """The XLA device type (``"CPU"``, ``"NEURON"``, ...), or None without torch_xla."""
    if sys.modules.get("torch_xla") is None:
        return None
    import torch_xla.runtime as xr

    return xr.device_type()


def set_stochastic_rounding(
    enabled: bool, *, environ: MutableMapping[str, str] | None = None, strict: bool = True
) -> None:
    """Set ``NEURON_RT_STOCHASTIC_ROUNDING_EN`` (``0`` under SMP) for the Neuron runtime,
    which reads it once when it starts.

    Args:
        enabled: stochastic rounding on (``1``) or off (``0``).
        environ: the mapping to write (default ``os.environ``).
        strict: refuse a change after the runtime started on any device. False (what
            ``neuronx_distributed_config`` uses): refuse only on Neuron, where the change
            would silently not happen; on other XLA devices the variable means nothing
            and a warning says it was set late.

    Raises:
        ConfigError: the XLA runtime has already started with a different value (it
            would ignore the change): set it at the top of the script or in the launcher.
    """
    if not isinstance(enabled, bool):
        raise ConfigError(f"enabled must be True or False, got {enabled!r}.")
    env = os.environ if environ is None else environ
    wanted = "1" if enabled else "0"
    current = env.get(SR_VARIABLE, _NEURON_SR_DEFAULT).strip() or _NEURON_SR_DEFAULT
    if current == wanted:
        env[SR_VARIABLE] = wanted
        return
    if xla_runtime_started():
        message = (
            f"the XLA runtime has already started with {SR_VARIABLE}={current}, so setting it to "
            f"{wanted} now has no effect. Set {SR_VARIABLE}={wanted} before the first use of the "
            f"XLA device: at the top of the training script, or in the launch command."
        )
        device = xla_device_type()
        if strict or device == "NEURON":
            raise ConfigError(message)
        warnings.warn(
            f"{message} (Harmless on this {device} device, which has no hardware stochastic rounding.)",
            stacklevel=3,
        )
    env[SR_VARIABLE] = wanted
