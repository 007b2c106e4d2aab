"""Stand-in for ``neuronx_distributed/trainer/__init__.py`` of neuronx-distributed 0.18.0
(Neuron SDK 2.29): it binds ``load_checkpoint`` and ``save_checkpoint`` (not ``has_checkpoint``
or ``finalize_checkpoint``) and the trainer's functions; optimum-neuron calls
``neuronx_distributed.trainer.save_checkpoint`` through it. NxD cannot be installed here."""

from .checkpoint import load_checkpoint, save_checkpoint
from .trainer import initialize_parallel_optimizer, neuronx_distributed_config
