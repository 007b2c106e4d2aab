"""``nxd_smp.native_torch`` moved to ``nxd_smp.interop.native_torch``; this import path stays for one release."""

import warnings

from .interop.native_torch import export_safetensors, export_torch, import_torch

__all__ = ["export_safetensors", "export_torch", "import_torch"]

warnings.warn("nxd_smp.native_torch moved to nxd_smp.interop.native_torch; this path goes in the next release.",
              DeprecationWarning, stacklevel=2)
