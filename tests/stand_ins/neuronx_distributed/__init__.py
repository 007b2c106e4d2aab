"""Stand-in for ``neuronx_distributed/__init__.py`` of neuronx-distributed 0.18.0 (Neuron SDK
2.29): the package root binds the trainer API's functions from ``.trainer.checkpoint`` and
``.trainer.trainer``, so ``nxd.save_checkpoint`` and ``nxd.initialize_parallel_optimizer`` are
attributes of their own here. NxD cannot be installed here (PyPI's package is an empty
placeholder)."""

from . import parallel_layers
from .trainer.checkpoint import CheckpointIOState, finalize_checkpoint, has_checkpoint, load_checkpoint, save_checkpoint
from .trainer.trainer import initialize_parallel_optimizer, neuronx_distributed_config
