"""neuronx-distributed's names, as NxD's scripts, NxD Training and optimum-neuron call them:

* ``optimizer``: ``NeuronZero1Optimizer`` (torch_xla's and NxD's ZeRO-1 signature);
* ``config``: ``neuronx_distributed_config`` and the two configs nxd_smp interprets from its dict;
* ``wrapper``: ``initialize_parallel_optimizer`` and NxD's wrapper ``NxDOptimizer`` (``ClippedOptimizer``
  with ZeRO-1 off);
* ``parallel_state``: NxD's model-parallel state where it is installed, and the one reading of its
  groups (``nxd_topology``);
* ``folders``, ``state_dicts``, ``checkpoint_format``: NxD's checkpoint tag folders, read at any DP
  size, and NxD Training's state dicts written and filled in them;
* ``patch``: ``patch_neuronx_distributed()``.
"""

from .config import configs_from_nxd_dict, neuronx_distributed_config
from .optimizer import NeuronZero1Optimizer
from .patch import patch_neuronx_distributed
from .wrapper import ClippedOptimizer, NxDOptimizer, initialize_parallel_optimizer

__all__ = [
    "ClippedOptimizer",
    "NeuronZero1Optimizer",
    "NxDOptimizer",
    "configs_from_nxd_dict",
    "initialize_parallel_optimizer",
    "neuronx_distributed_config",
    "patch_neuronx_distributed",
]
