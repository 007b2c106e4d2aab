"""Stand-in for ``neuronx_distributed/trainer/optimizer.py`` of neuronx-distributed 0.18.0
(Neuron SDK 2.29): NxD's trainer wrapper ``NxDOptimizer``, which raises when built (only
nxd_smp's may run here). NxD cannot be installed here."""

from __future__ import annotations

from typing import Any

import torch


class NxDOptimizer(torch.optim.Optimizer):
    """NxD's wrapper around the optimizer ``initialize_parallel_optimizer`` builds."""

    def __init__(self, optimizer: torch.optim.Optimizer, nxd_config: dict[str, Any]):
        raise RuntimeError("stand-in: NxD's own NxDOptimizer was built")
