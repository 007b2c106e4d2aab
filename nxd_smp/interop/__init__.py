"""nxd_smp with the tools around it: the top layer of the library, which nothing below imports.

* ``nxd``: neuronx-distributed's names and files (``NeuronZero1Optimizer``, the trainer API and
  its wrapper, NxD's parallel state, its checkpoint folders and NxD Training's state dicts, the
  patch that puts nxd_smp under NxD's callers);
* ``torch_xla``: torch_xla's and NxD's per-rank ZeRO-1 state dicts, out and in;
* ``native_torch``: the way out to native PyTorch (DCP in ``get_state_dict``'s layout,
  safetensors) and back;
* ``loop_checkpoints``: nxd_smp's checkpoint beside a training loop's one-rank optimizer file,
  through torch's optimizer hooks; ``hf_trainer`` (the Hugging Face Trainer's callback) and
  ``accelerate`` (its save/load hooks) use it.

Importing this package registers NxD's tag folders with the checkpoint entry points and the loops'
advice with the optimizer's refusals; it imports neither transformers nor accelerate.
"""

from . import loop_checkpoints  # noqa: F401 - importing it registers the loops' advice with the refusals
from .nxd import checkpoint_format  # noqa: F401 - importing it registers NxD's tag folders with checkpointing
