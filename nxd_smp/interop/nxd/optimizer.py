"""NxD's ``NeuronZero1Optimizer``: torch_xla's and NxD's ``ZeroRedundancyOptimizer`` signature,
mapped onto ``Zero1Optimizer`` (``nxd_smp.NeuronZero1Optimizer``)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch

from ...backend import GroupSpec, NormGroupSpec
from ...core.errors import ConfigError
from ...mixed_precision_config import MixedPrecisionConfig, require_bool
from ...optim.param_groups import check_optimizer_class, managed_params, normalize_param_groups
from ...zero1_optimizer import Zero1Optimizer
from .parallel_state import nxd_topology


class NeuronZero1Optimizer(Zero1Optimizer):
    """torch_xla's / NxD's ``ZeroRedundancyOptimizer`` signature mapped onto
    ``Zero1Optimizer``, with the protocol NxD's and optimum-neuron's own code use.

    ``optimizer_dtype`` is the master/state dtype (None, fp32 or fp64: fp32 masters, which
    under ``XLA_DOWNCAST_BF16=1`` are torch float64, as NxD asks with ``torch.double``;
    bf16/fp16: none); ``use_grad_acc_hook`` turns on fp32 gradient accumulation;
    ``higher_cc_precision`` reduces gradients in the master dtype instead of the
    parameter dtype; ``save_master_weights`` puts master weights in the state dict;
    ``max_norm=None`` means 1.0; ``sharding_groups`` / ``grad_norm_groups`` are replica
    groups or process groups. Where NxD's parallel state is initialised, groups left None
    come from it as NxD's own optimizer takes them: sharding over the data-parallel replica
    groups (the ZeRO-1 sharding groups with context parallelism), the norm over the tensor-
    and pipeline-parallel groups. The bucket caps are MB per collective as in torch_xla (0: one
    collective per parameter). ``zero_grad`` keeps gradients allocated by default, as torch_xla
    does. ``grad_clipping`` and ``max_norm`` can be set between steps, and ``_grad_norm`` is
    the last step's norm (optimum-neuron sets and reads them around each step).

    Beyond torch_xla's signature (keywords): ``pipeline_groups`` spans the norm over pipeline
    stages (NxD does that through its parallel state); ``sequence_parallel`` and
    ``context_parallel_groups`` are ``Zero1Optimizer``'s. Their default (None) does what no
    caller can do instead: with ``use_grad_acc_hook`` the hooks take each ``.grad`` into the
    fp32 accumulation, where the sequence-parallel sum of NxD's and optimum-neuron's own code
    (which read ``.grad``) cannot see it, so this optimizer sums the marked parameters over
    ``grad_norm_groups`` itself (refused if no tensor-parallel group is known), and averages
    over NxD's context-parallel groups where its parallel state has them. Without the hook,
    ``.grad`` stays where those callers sum it, and this optimizer leaves it alone, as NxD's.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        optimizer_dtype: torch.dtype | None = None,
        grad_clipping: bool = True,
        max_norm: float | None = None,
        pin_layout: bool = True,
        sharding_groups: GroupSpec = None,
        grad_norm_groups: NormGroupSpec = None,
        lazy_init: bool = False,
        bucket_cap_mb_all_gather: float = 0,
        bucket_cap_mb_reduce_scatter: float = 0,
        use_grad_acc_hook: bool = False,
        save_master_weights: bool = False,
        higher_cc_precision: bool = False,
        *,
        pipeline_groups: NormGroupSpec = None,
        sequence_parallel: bool | None = None,
        context_parallel_groups: NormGroupSpec = None,
        **defaults: Any,
    ):
        if optimizer_dtype in (None, torch.float32, torch.float64):
            use_master_weights = True
        elif optimizer_dtype in (torch.bfloat16, torch.float16):
            use_master_weights = False
        else:
            raise ConfigError(
                f"optimizer_dtype must be None, torch.float32, torch.float64, torch.bfloat16 "
                f"or torch.float16, got {optimizer_dtype!r}."
            )
        for name, value in (("save_master_weights", save_master_weights),
                            ("use_grad_acc_hook", use_grad_acc_hook),
                            ("higher_cc_precision", higher_cc_precision)):
            require_bool("NeuronZero1Optimizer", name, value)
        if sequence_parallel is not None:
            require_bool("NeuronZero1Optimizer", "sequence_parallel", sequence_parallel)
        if save_master_weights and not use_master_weights:
            raise ConfigError(
                f"save_master_weights=True needs fp32 master weights, but optimizer_dtype="
                f"{optimizer_dtype} keeps none; use optimizer_dtype=torch.float32."
            )
        check_optimizer_class(optimizer_class)  # (the arguments first, then the groups)
        bucket_cap_mb = _torch_xla_bucket_cap(bucket_cap_mb_reduce_scatter, bucket_cap_mb_all_gather)
        groups = normalize_param_groups(params)
        managed, device = managed_params(groups)
        # NxD's parallel state, where it is initialised, gives the groups left None, as NxD's own
        # optimizer takes them; the context-parallel mean and the sequence-parallel sum are this
        # optimizer's where its hook takes ``.grad`` away from the callers that do them
        topology = nxd_topology(
            device, data=sharding_groups, tensor=grad_norm_groups, pipeline=pipeline_groups,
            context=context_parallel_groups, context_mean_here=use_grad_acc_hook,
            sequence_parallel=use_grad_acc_hook if sequence_parallel is None else sequence_parallel,
            params=managed, owner=type(self).__name__, pin_layout=pin_layout)
        super().__init__(
            groups,
            optimizer_class,
            mixed_precision=MixedPrecisionConfig(
                use_master_weights=use_master_weights,
                use_fp32_grad_acc=use_grad_acc_hook,
                use_master_weights_in_ckpt=save_master_weights,
            ),
            grad_clipping=grad_clipping,
            max_norm=1.0 if max_norm is None else max_norm,
            # torch_xla: the gradient travels in the parameter dtype unless higher_cc_precision asks
            # for the optimizer dtype
            reduce_dtype="master" if higher_cc_precision else "param",
            bucket_cap_mb=bucket_cap_mb,
            topology=topology,
            pin_layout=pin_layout,
            lazy_init=lazy_init,
            **defaults,
        )
        if optimizer_dtype is torch.float64 and self.precision.fp32 is not torch.float64:
            warnings.warn(
                "optimizer_dtype=torch.float64: nxd_smp keeps fp32 master weights (NxD asks for float64 "
                "under XLA_DOWNCAST_BF16=1, where the device stores float64 as fp32).", stacklevel=2)

    def zero_grad(self, set_to_none: bool = False) -> None:
        super().zero_grad(set_to_none=set_to_none)


def _torch_xla_bucket_cap(reduce_scatter_mb: float, all_gather_mb: float) -> float:
    """One bucket size (MiB of fp32) that honours both torch_xla caps.

    torch_xla counts the reduce-scatter cap on the full gradient and the all-gather cap
    on the shards; 0 disables coalescing, i.e. one bucket per parameter.
    """
    for name, value in (("bucket_cap_mb_reduce_scatter", reduce_scatter_mb),
                        ("bucket_cap_mb_all_gather", all_gather_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ConfigError(f"{name} must be a number >= 0, got {value!r}.")
    if reduce_scatter_mb == 0 or all_gather_mb == 0:
        return 0.0
    return float(min(reduce_scatter_mb, all_gather_mb))
