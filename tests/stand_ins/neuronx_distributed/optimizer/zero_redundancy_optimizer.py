"""Stand-in for ``neuronx_distributed/optimizer/zero_redundancy_optimizer.py`` of
neuronx-distributed 0.18.0 (Neuron SDK 2.29): NxD's ``NeuronZero1Optimizer`` (a subclass of
torch_xla's ``ZeroRedundancyOptimizer`` there, of torch's ``Optimizer`` here) raises when built,
so only nxd_smp's can run; ``NeuronEPZero1Optimizer`` (expert parallelism) subclasses it, as in
NxD. NxD cannot be installed here."""

from __future__ import annotations

from typing import Any

import torch


class NeuronZero1Optimizer(torch.optim.Optimizer):
    """NxD's ZeRO-1 optimizer."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise RuntimeError("stand-in: NxD's own NeuronZero1Optimizer was built")


class NeuronEPZero1Optimizer(NeuronZero1Optimizer):
    """NxD's ZeRO-1 optimizer under expert parallelism."""
