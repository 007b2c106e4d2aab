"""What the gloo ranks' fork server loads once, before any rank forks from it (tests/distributed.py):
torch, nxd_smp and the test helpers, and inductor's inspection of this CPU (a second interpreter
that loads a compiled probe, ~2 s), so that a rank starts in a fraction of a second instead of
importing and probing anew. Nothing here runs a tensor kernel: the server's children may then use
OpenMP freely."""

import torch
import torch.distributed  # noqa: F401
import torch._inductor.codecache  # noqa: F401
from torch._inductor import cpu_vec_isa

import nxd_smp  # noqa: F401
import tests.oracle  # noqa: F401

cpu_vec_isa.valid_vec_isa_list()
