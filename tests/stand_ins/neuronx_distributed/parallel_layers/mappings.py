"""Stand-in for ``neuronx_distributed/parallel_layers/mappings.py`` of neuronx-distributed 0.18.0
(Neuron SDK 2.29): the sum over the tensor-parallel group that optimum-neuron applies to the
gradients of sequence-parallel parameters. A no-op at tensor-parallel size 1, the only size these
stand-ins run at. NxD cannot be installed here."""

from __future__ import annotations

import torch

from . import parallel_state


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, process_group=None) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_size() > 1:
        raise NotImplementedError("stand-in: tensor-parallel size 1 only")
    return input_
