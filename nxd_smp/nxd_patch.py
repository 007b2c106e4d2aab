"""``nxd_smp.nxd_patch`` moved to ``nxd_smp.interop.nxd``; this import path stays for one release."""

import warnings

from .interop.nxd.patch import NXD_NAMES, patch_neuronx_distributed

__all__ = ["NXD_NAMES", "patch_neuronx_distributed"]

warnings.warn("nxd_smp.nxd_patch moved to nxd_smp.interop.nxd; this path goes in the next release.",
              DeprecationWarning, stacklevel=2)
