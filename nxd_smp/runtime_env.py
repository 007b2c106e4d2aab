"""Every environment variable nxd_smp reads or sets, and what the XLA runtime has done.

* ``XLA_USE_BF16`` / ``XLA_DOWNCAST_BF16`` (read): make torch_xla store fp32 tensors as
  bf16 on the device, which would silently turn the fp32 master weights into bf16 ones.
  ``check_no_xla_downcast`` refuses them while master weights are on.
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

from .mixed_precision_config import ConfigError

__all__ = [
    "SR_VARIABLE",
    "XLA_DOWNCAST_VARIABLES",
    "check_no_xla_downcast",
    "set_stochastic_rounding",
    "xla_runtime_started",
    "xla_device_type",
]

#: Environment variables that make torch_xla store fp32 tensors as bf16 on the device.
XLA_DOWNCAST_VARIABLES = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")

#: The Neuron runtime's switch for stochastic rounding ("0" = round to nearest).
SR_VARIABLE = "NEURON_RT_STOCHASTIC_ROUNDING_EN"
_NEURON_SR_DEFAULT = "1"  # the Neuron runtime rounds stochastically unless told otherwise


def check_no_xla_downcast(environ: Mapping[str, str] | None = None) -> None:
    """Refuse master weights when torch_xla would silently store fp32 tensors as bf16.

    Called by ``neuronx_distributed_config`` when its config has master weights, and by
    the optimizers when they are built with master weights.

    Raises:
        ConfigError: naming the variable that is set and the fix.
    """
    env = os.environ if environ is None else environ
    for name in XLA_DOWNCAST_VARIABLES:
        value = env.get(name, "")
        if value.strip() not in ("", "0"):
            raise ConfigError(
                f"{name}={value!r} is set while use_master_weights=True: it makes torch_xla "
                f"store the fp32 master weights as bf16, which defeats them. Unset {name} "
                f"(or set it to 0) and cast the model instead with model.to(torch.bfloat16)."
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
