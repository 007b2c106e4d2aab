"""``nxd_smp.xla_state_dict`` moved to ``nxd_smp.interop.torch_xla``; this import path stays for one release."""

import warnings

from .interop.torch_xla import export_xla, full_state, import_xla

__all__ = ["export_xla", "full_state", "import_xla"]

warnings.warn("nxd_smp.xla_state_dict moved to nxd_smp.interop.torch_xla; this path goes in the next release.",
              DeprecationWarning, stacklevel=2)
