"""``nxd_smp.runtime_env`` moved to ``nxd_smp.core.environment``; this path stays for one release."""

import warnings

from .core.environment import (
    SR_VARIABLE,
    XLA_DOWNCAST_BF16,
    XLA_USE_BF16,
    check_master_weights_storage,
    set_stochastic_rounding,
    xla_bf16_variable,
    xla_device_type,
    xla_runtime_started,
)

__all__ = ["SR_VARIABLE", "XLA_DOWNCAST_BF16", "XLA_USE_BF16", "check_master_weights_storage",
           "set_stochastic_rounding", "xla_bf16_variable", "xla_device_type", "xla_runtime_started"]

warnings.warn("nxd_smp.runtime_env moved to nxd_smp.core.environment; this path goes in the next release.",
              DeprecationWarning, stacklevel=2)
