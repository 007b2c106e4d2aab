"""``nxd_smp.trainer`` moved to ``nxd_smp.interop.nxd``; this import path stays for one release."""

import warnings

from .interop.nxd import (
    ClippedOptimizer,
    NxDOptimizer,
    configs_from_nxd_dict,
    initialize_parallel_optimizer,
    neuronx_distributed_config,
)

__all__ = ["ClippedOptimizer", "NxDOptimizer", "configs_from_nxd_dict", "initialize_parallel_optimizer",
           "neuronx_distributed_config"]

warnings.warn("nxd_smp.trainer moved to nxd_smp.interop.nxd; this path goes in the next release.",
              DeprecationWarning, stacklevel=2)
