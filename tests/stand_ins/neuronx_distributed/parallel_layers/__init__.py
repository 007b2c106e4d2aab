"""Stand-in for ``neuronx_distributed/parallel_layers/__init__.py`` of neuronx-distributed 0.18.0
(Neuron SDK 2.29): its submodules, and the functions it binds that the stand-ins use. NxD cannot
be installed here."""

from . import grads, mappings, parallel_state
from .grads import clip_grad_norm
from .mappings import reduce_from_tensor_model_parallel_region
