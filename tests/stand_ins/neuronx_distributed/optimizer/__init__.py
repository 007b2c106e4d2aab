"""Stand-in for ``neuronx_distributed/optimizer/__init__.py`` of neuronx-distributed 0.18.0
(Neuron SDK 2.29), which binds NxD's ZeRO-1 optimizers; optimum-neuron and NxD's trainer import
``NeuronZero1Optimizer`` from here. NxD cannot be installed here."""

from .zero_redundancy_optimizer import NeuronEPZero1Optimizer, NeuronZero1Optimizer
