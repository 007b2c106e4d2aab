"""``nxd_smp.loop_checkpoints`` moved to ``nxd_smp.interop.loop_checkpoints and nxd_smp.interop.accelerate``; this import path stays for one release."""

import warnings

from .interop.loop_checkpoints import (
    load_beside,
    read_reference,
    save_beside,
)
from .interop.accelerate import register_accelerate_hooks

__all__ = ["load_beside", "read_reference", "register_accelerate_hooks", "save_beside"]

warnings.warn("nxd_smp.loop_checkpoints moved to nxd_smp.interop.loop_checkpoints and nxd_smp.interop.accelerate; this path goes in the next release.",
              DeprecationWarning, stacklevel=2)
