"""Stand-in for ``neuronx_distributed/trainer/trainer.py`` of neuronx-distributed 0.18.0 (Neuron
SDK 2.29): like NxD's, it binds ``NeuronZero1Optimizer`` (and ``NeuronEPZero1Optimizer``) at
module level from ``neuronx_distributed.optimizer`` and builds it in
``initialize_optimizer_from_class``, with the keywords NxD passes, under NxD's
``initialize_parallel_optimizer``; ``neuronx_distributed_config`` fills NxD's defaults into the
caller's dicts as NxD does. NxD cannot be installed here."""

from __future__ import annotations

import os
from typing import Any

import torch

from neuronx_distributed.optimizer import NeuronEPZero1Optimizer, NeuronZero1Optimizer
from neuronx_distributed.parallel_layers import parallel_state
from neuronx_distributed.trainer.optimizer import NxDOptimizer


def neuronx_distributed_config(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_config: dict | None = None,
    optimizer_config: dict | None = None,
    activation_checkpoint_config: Any = None,
    pad_model: bool = False,
    sequence_parallel: bool = False,
    model_init_config: dict | None = None,
    lora_config: Any = None,
    mixed_precision_config: dict | None = None,
    sequential_move_factor: int = 11,
    lnc_size: int = 1,
) -> dict[str, Any]:
    """NxD's config dict; missing keys of the dicts passed are filled in them (NxD updates them
    in place). ``max_grad_norm`` is filled only with clipping on, so NxD Training's null
    ``gradient_clip_val`` stays None."""
    if optimizer_config is None:
        optimizer_config = {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0}
    else:
        optimizer_config.setdefault("zero_one_enabled", False)
        optimizer_config.setdefault("grad_clipping", True)
        if optimizer_config["grad_clipping"]:
            optimizer_config.setdefault("max_grad_norm", 1.0)
    zero1 = optimizer_config["zero_one_enabled"]
    if mixed_precision_config is None:
        mixed_precision_config = {}
    for key, default in (("use_master_weights", zero1), ("use_fp32_grad_acc", zero1),
                         ("use_master_weights_in_ckpt", False)):
        mixed_precision_config.setdefault(key, default)
    if model_init_config is None:
        model_init_config = {"param_init_fn": None}
    model_init_config.setdefault("sequential_move_factor", sequential_move_factor)
    model_init_config.setdefault("meta_device_init", False)
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "expert_parallel_size": expert_parallel_size,
        "context_parallel_size": context_parallel_size,
        "pipeline_config": pipeline_config,
        "optimizer_config": optimizer_config,
        "activation_checkpoint_config": activation_checkpoint_config,
        "pad_model": pad_model,
        "sequence_parallel": sequence_parallel,
        "model_init_config": model_init_config,
        "lora_config": lora_config,
        "mixed_precision_config": mixed_precision_config,
        "lnc_size": lnc_size,
    }


def initialize_parallel_optimizer(nxd_config: dict[str, Any], optimizer_class: type, parameters: Any,
                                  **defaults: Any) -> NxDOptimizer:
    """NxD's: the optimizer of ``initialize_optimizer_from_class`` in NxD's wrapper."""
    return NxDOptimizer(initialize_optimizer_from_class(nxd_config, optimizer_class, parameters, **defaults),
                        nxd_config)


def initialize_optimizer_from_class(nxd_config: dict[str, Any], optimizer_class: type, parameters: Any,
                                    model: Any = None, **defaults: Any) -> torch.optim.Optimizer:
    """With ZeRO-1, the module-level ``NeuronZero1Optimizer`` built with NxD's keywords (no
    ``max_norm``: torch_xla's default applies); without, ``optimizer_class`` itself."""
    optimizer_config = nxd_config["optimizer_config"]
    mixed = nxd_config["mixed_precision_config"]
    if not optimizer_config["zero_one_enabled"]:
        return optimizer_class(parameters, **defaults)
    cls = NeuronEPZero1Optimizer if parallel_state.get_expert_model_parallel_size() > 1 else NeuronZero1Optimizer
    if parallel_state.get_context_model_parallel_size() > 1:
        sharding_groups = parallel_state.get_zero1_sharding_groups()
    else:
        sharding_groups = parallel_state.get_data_parallel_replica_groups()
    bucket_cap = 65 if os.environ.get("XLA_DOWNCAST_BF16") == "0" and mixed["use_master_weights"] else 130
    kwargs: dict[str, Any] = {
        "grad_clipping": optimizer_config["grad_clipping"],
        "pin_layout": False,
        "sharding_groups": sharding_groups,
        "grad_norm_groups": parallel_state.get_tensor_model_parallel_replica_groups(),
        "bucket_cap_mb_all_gather": max(1, bucket_cap // parallel_state.get_data_parallel_size()),
        "bucket_cap_mb_reduce_scatter": bucket_cap,
        "save_master_weights": bool(mixed["use_master_weights_in_ckpt"]),
    }
    if mixed["use_master_weights"] and os.environ.get("XLA_DOWNCAST_BF16") == "1":
        defaults["optimizer_dtype"] = torch.double
    if mixed["use_fp32_grad_acc"]:
        kwargs.update(use_grad_acc_hook=True, higher_cc_precision=True)
    defaults.pop("decoupled_weight_decay", None)
    return cls(parameters, optimizer_class, **kwargs, **defaults)
