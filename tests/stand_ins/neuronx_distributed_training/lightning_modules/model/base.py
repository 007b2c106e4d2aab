"""Stand-in for ``neuronx_distributed_training/lightning_modules/model/base.py`` of NxD Training
1.6.0: what its model base class does with NxD, through ``import neuronx_distributed as nxd``.
``_initialize_nxd_config`` turns the YAML's precision type, ``zero1`` and Lightning's
``gradient_clip_val`` (None: clipping off, ``max_grad_norm`` None) into ``nxd.neuronx_distributed_
config``; ``configure_optimizers`` has NeMo build the torch optimizer over the param groups first
(which fills every group with the class's hyperparameters), then calls
``nxd.initialize_parallel_optimizer(cfg, cls, param_groups, **torch_optimizer.defaults)``. No
Lightning, NeMo or YAML here: only what reaches NxD. NxD Training cannot be installed here."""

from __future__ import annotations

from typing import Any

import neuronx_distributed as nxd
import torch

MIXED_PRECISION_TYPES = ("mixed_precision", "mixed_precisionSR", "autocast")


class BaseModelModule:
    """The optimizer setup of NxD Training's model base class.

    Args:
        model: the model (its parameters make one param group).
        config: the YAML's keys used here: ``precision.type`` (and ``master_weights``,
            ``fp32_grad_acc`` with ``manual``), ``distributed_strategy`` (``zero1``, default True;
            the parallel sizes; ``sequence_parallel``), ``use_master_weights_in_ckpt``.
        gradient_clip_val: Lightning's trainer setting; None turns clipping off.
        optimizer_class, optimizer_kwargs: the optimizer NeMo's ``get_optimizer`` names, and its
            keywords.
    """

    def __init__(self, model: torch.nn.Module, config: dict[str, Any], gradient_clip_val: float | None,
                 optimizer_class: type[torch.optim.Optimizer], optimizer_kwargs: dict[str, Any]):
        self.model = model
        self.config = config
        self.gradient_clip_val = gradient_clip_val
        self._optimizer_class = optimizer_class
        self._optimizer_kwargs = optimizer_kwargs
        self._optimizer_param_groups = [{"params": list(model.parameters())}]
        self._optimizer: Any = None
        self._initialize_nxd_config()

    def _initialize_nxd_config(self) -> None:
        precision = self.config.get("precision", {})
        strategy = self.config.get("distributed_strategy", {})
        if precision.get("type") == "manual":
            master_weights = precision.get("master_weights", False)
            fp32_grad_acc = precision.get("fp32_grad_acc", False)
        else:
            master_weights = fp32_grad_acc = precision.get("type") in MIXED_PRECISION_TYPES
        zero1 = strategy.get("zero1", True)
        self.nxd_config = nxd.neuronx_distributed_config(
            tensor_parallel_size=strategy.get("tensor_model_parallel_size", 1),
            pipeline_parallel_size=strategy.get("pipeline_model_parallel_size", 1),
            optimizer_config={
                "zero_one_enabled": zero1,
                "grad_clipping": self.gradient_clip_val is not None,
                "max_grad_norm": self.gradient_clip_val,
            },
            sequence_parallel=strategy.get("sequence_parallel", False),
            mixed_precision_config={
                "use_master_weights": master_weights and zero1,
                "use_fp32_grad_acc": fp32_grad_acc and zero1,
                "use_master_weights_in_ckpt": self.config.get("use_master_weights_in_ckpt", False) and zero1,
            },
        )

    def setup_optimization(self) -> None:
        """NeMo's: the torch optimizer over the param groups."""
        self._optimizer = self._optimizer_class(self._optimizer_param_groups, **self._optimizer_kwargs)

    def configure_optimizers(self) -> Any:
        self.setup_optimization()
        self._optimizer = nxd.initialize_parallel_optimizer(
            self.nxd_config,
            self._optimizer_class,
            self._optimizer_param_groups,
            **self._optimizer.defaults,
        )
        return self._optimizer
