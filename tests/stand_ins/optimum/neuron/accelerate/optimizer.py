"""Stand-in for ``optimum/neuron/accelerate/optimizer.py`` of optimum-neuron 0.4.6.dev4: it binds
``NeuronZero1Optimizer`` at module level from ``neuronx_distributed.optimizer`` and its
``NeuronAcceleratedOptimizer.step`` tests ``isinstance(self.optimizer, NeuronZero1Optimizer)``:
then it switches the optimizer's clipping on with the caller's ``max_norm``, steps, reads
``_grad_norm`` and switches clipping off again; otherwise it all-reduces and clips ``.grad``
itself. Under sequence parallelism it first sums the marked parameters' ``.grad`` (only
``.grad``) over the tensor-parallel group. A plain class here (accelerate's
``AcceleratedOptimizer`` there, which needs an Accelerator's state). optimum-neuron cannot be
installed here."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from neuronx_distributed.optimizer import NeuronZero1Optimizer
from neuronx_distributed.parallel_layers.grads import bucket_allreduce_gradients, clip_grad_norm
from neuronx_distributed.parallel_layers.mappings import reduce_from_tensor_model_parallel_region


def allreduce_sequence_parallel_gradients(optimizer: torch.optim.Optimizer) -> None:
    """Sum the ``.grad`` of the parameters marked ``sequence_parallel_enabled`` over the
    tensor-parallel group."""
    for group in optimizer.__getstate__()["param_groups"]:
        for p in group["params"]:
            if p.grad is not None and getattr(p, "sequence_parallel_enabled", False):
                reduce_from_tensor_model_parallel_region(p.grad.data)


class NeuronAcceleratedOptimizer:
    """optimum-neuron's optimizer wrapper: the optimizer it wraps is ``.optimizer``."""

    def __init__(self, optimizer: torch.optim.Optimizer, sequence_parallel_enabled: bool = False):
        self.optimizer = optimizer
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.clip_grad_norm_to_perform: dict[str, Any] | None = None
        self.grad_norm: torch.Tensor | None = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def prepare_clip_grad_norm(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> None:
        """What the accelerator's ``clip_grad_norm_`` does: clip at the next step."""
        self.clip_grad_norm_to_perform = {"parameters": parameters, "max_norm": max_norm, "norm_type": norm_type}

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if self.sequence_parallel_enabled:
            allreduce_sequence_parallel_gradients(self.optimizer)
        if isinstance(self.optimizer, NeuronZero1Optimizer):
            if self.clip_grad_norm_to_perform is not None:
                self.optimizer.grad_clipping = True
                self.optimizer.max_norm = self.clip_grad_norm_to_perform["max_norm"]
            else:
                self.optimizer.grad_clipping = False
            self.optimizer.step(closure=closure)
            self.grad_norm = self.optimizer._grad_norm
            self.optimizer.grad_clipping = False
            self.clip_grad_norm_to_perform = None
            return
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        bucket_allreduce_gradients(grads)
        if self.clip_grad_norm_to_perform is not None:
            clip = self.clip_grad_norm_to_perform
            self.grad_norm = clip_grad_norm(clip["parameters"], clip["max_norm"], clip["norm_type"])
            self.clip_grad_norm_to_perform = None
        self.optimizer.step(closure=closure)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """accelerate's: ``set_to_none`` defaults to True."""
        self.optimizer.zero_grad(set_to_none=True if set_to_none is None else set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
