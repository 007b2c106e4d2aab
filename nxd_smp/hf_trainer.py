"""``nxd_smp.hf_trainer`` moved to ``nxd_smp.interop.hf_trainer``; this import path stays for one release."""

import warnings

from .interop.hf_trainer import Zero1TrainerCallback, skip_ddp_allreduce

__all__ = ["Zero1TrainerCallback", "skip_ddp_allreduce"]

warnings.warn("nxd_smp.hf_trainer moved to nxd_smp.interop.hf_trainer; this path goes in the next release.",
              DeprecationWarning, stacklevel=2)
