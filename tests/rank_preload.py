"""What the fork server of the tests' children loads once, before any child forks from it
(tests/distributed.py: gloo ranks, and programs run as ``python`` or ``torchrun`` would run them):
torch, nxd_smp, the test helpers, accelerate and the Trainer, and inductor's inspection of this
CPU (a second interpreter that loads a compiled probe, ~2 s), so that a child starts in a fraction
of a second instead of importing and probing anew. Nothing here runs a tensor kernel: the server's
children may then use OpenMP freely.

Nothing here may set up CUDA either: a process forked from one that counted its CUDA devices
through the CUDA runtime cannot use CUDA, and on a machine with a GPU torch.compile in a rank asks
for the current CUDA device ("Cannot re-initialize CUDA in forked subprocess" in every rank). The
count happened here: importing inductor imports torch.utils.cpp_extension, whose search for
CUDA_HOME calls ``torch.cuda.is_available()``, which counts through the runtime and registers
torch's fork handler. With PYTORCH_NVML_BASED_CUDA_CHECK=1 it counts through NVML and registers
nothing (seen on an H200 with torch 2.11: a child of this server was in a "bad fork" without it,
and with it ranks compiled and used CUDA). The ranks get the environment of the call back
(tests/distributed.py), so the variable stays in this server."""

import os

os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
os.environ.setdefault("USE_TORCH_XLA", "0")
#: The environment the server's imports start from (they add to it: inductor sets its cache
#: folder), against which tests/distributed.py holds a program's call.
ENVIRONMENT = dict(os.environ)

import torch  # noqa: E402
import torch.distributed  # noqa: E402, F401
import torch._inductor.codecache  # noqa: E402, F401
from torch._inductor import cpu_vec_isa  # noqa: E402

import nxd_smp  # noqa: E402, F401
import tests.oracle  # noqa: E402, F401

# The frameworks the forked programs train with (tests/distributed.py's run_python, run_launched):
# ~4 s here once instead of in every child. transformers decides on torch_xla at import, from
# USE_TORCH_XLA (tests/conftest.py sets it to 0; tests/distributed.py refuses a call that differs).
from accelerate import Accelerator  # noqa: E402, F401
from transformers import LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402, F401

cpu_vec_isa.valid_vec_isa_list()
