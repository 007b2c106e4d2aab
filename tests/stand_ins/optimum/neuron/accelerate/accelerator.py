"""Stand-in for ``optimum/neuron/accelerate/accelerator.py`` of optimum-neuron 0.4.6.dev4: it binds
``NeuronZero1Optimizer`` at module level from ``neuronx_distributed.optimizer`` and, with ZeRO-1
(optimum-neuron's default), builds it from the user's optimizer: its ``param_groups`` (holding the
hyperparameters) and its class, with the groups of NxD's parallel state, NxD's bucket caps and the
mixed precision flags; ``prepare_optimizer`` wraps the result in ``NeuronAcceleratedOptimizer``.
optimum-neuron cannot be installed here."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from neuronx_distributed.optimizer import NeuronZero1Optimizer
from neuronx_distributed.parallel_layers.parallel_state import (
    get_context_model_parallel_size,
    get_data_parallel_replica_groups,
    get_data_parallel_size,
    get_tensor_model_parallel_replica_groups,
)

from .optimizer import NeuronAcceleratedOptimizer


@dataclass
class MixedPrecisionConfig:
    """The flags of optimum-neuron's mixed precision config that reach the optimizer, with its
    defaults (its mode and stochastic rounding, which set the environment, are left out)."""

    optimizer_use_master_weights: bool = False
    optimizer_use_fp32_grad_acc: bool = False
    optimizer_save_master_weights_in_ckpt: bool = False


def _prepare_optimizer_for_zero_1(optimizer: torch.optim.Optimizer,
                                  mixed_precision_config: MixedPrecisionConfig) -> torch.optim.Optimizer:
    """The accelerator's method of that name."""
    if get_context_model_parallel_size() > 1:
        raise RuntimeError("context parallelism is not supported with ZeRO-1")
    bucket_cap = int(os.getenv("ALL_GATHER_REDUCE_SCATTER_BUCKET_CAP_MB", 130))
    master_weights = mixed_precision_config.optimizer_use_master_weights
    return NeuronZero1Optimizer(
        optimizer.param_groups,
        optimizer.__class__,
        pin_layout=False,
        sharding_groups=get_data_parallel_replica_groups(),
        grad_norm_groups=get_tensor_model_parallel_replica_groups(),
        bucket_cap_mb_all_gather=max(1, bucket_cap // get_data_parallel_size()),
        bucket_cap_mb_reduce_scatter=bucket_cap,
        optimizer_dtype=torch.float32 if master_weights else torch.bfloat16,
        use_grad_acc_hook=mixed_precision_config.optimizer_use_fp32_grad_acc,
        higher_cc_precision=mixed_precision_config.optimizer_use_fp32_grad_acc,
        save_master_weights=mixed_precision_config.optimizer_save_master_weights_in_ckpt,
    )


def prepare_optimizer(optimizer: torch.optim.Optimizer, mixed_precision_config: MixedPrecisionConfig,
                      sequence_parallel_enabled: bool = False) -> NeuronAcceleratedOptimizer:
    """The accelerator's ``prepare_optimizer`` with ZeRO-1 on."""
    return NeuronAcceleratedOptimizer(_prepare_optimizer_for_zero_1(optimizer, mixed_precision_config),
                                      sequence_parallel_enabled=sequence_parallel_enabled)
