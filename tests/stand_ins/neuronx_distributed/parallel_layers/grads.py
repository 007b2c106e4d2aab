"""Stand-in for ``neuronx_distributed/parallel_layers/grads.py`` of neuronx-distributed 0.18.0
(Neuron SDK 2.29): the data-parallel all-reduce and the clipping that optimum-neuron runs when
its optimizer is not a ``NeuronZero1Optimizer``. At world size 1 (the only size these stand-ins
run at) the all-reduce has nothing to do. NxD cannot be installed here."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from . import parallel_state


def _single_process() -> None:
    if parallel_state.get_data_parallel_size() * parallel_state.get_tensor_model_parallel_size() > 1:
        raise NotImplementedError("stand-in: world size 1 only")


def bucket_allreduce_gradients(grads_list: list[torch.Tensor], reduce_over_ep_group: bool = False) -> None:
    _single_process()


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2, **kwargs) -> torch.Tensor:
    _single_process()
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
