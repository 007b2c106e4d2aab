"""NxD's trainer API, laid out as neuronx-distributed lays it out (``trainer/``).

* ``neuronx_distributed_config``: NxD's config dict builder, validated, inputs never mutated;
* ``configs_from_nxd_dict``: the two configs nxd_smp interprets, from such a dict;
* ``initialize_parallel_optimizer``: the optimizer an NxD config asks for;
* ``ClippedOptimizer``: what it returns with ZeRO-1 off (a plain optimizer that clips).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .grad_norm import clip_coefficient, sum_of_squares
from .mixed_precision_config import ConfigError, MixedPrecisionConfig, OptimizerConfig, validate_max_norm
from .runtime_env import check_no_xla_downcast, set_stochastic_rounding
from .zero1_optimizer import GroupSpec, NormGroupSpec, Zero1Optimizer, check_optimizer_class

__all__ = [
    "neuronx_distributed_config",
    "configs_from_nxd_dict",
    "initialize_parallel_optimizer",
    "ClippedOptimizer",
]

# NxD's ``neuronx_distributed_config`` keyword arguments other than the two configs we
# interpret, with NxD's defaults. They are recorded as given so an NxD script's call works.
_NXD_OTHER_DEFAULTS: dict[str, Any] = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "context_parallel_size": 1,
    "expert_parallel_size": 1,
    "pipeline_config": None,
    "activation_checkpoint_config": None,
    "pad_model": False,
    "sequence_parallel": False,
    "model_init_config": None,
    "lora_config": None,
}
_PARALLEL_SIZE_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "context_parallel_size",
    "expert_parallel_size",
)
def neuronx_distributed_config(
    *,
    optimizer_config: Mapping[str, Any] | None = None,
    mixed_precision_config: Mapping[str, Any] | None = None,
    **nxd_kwargs: Any,
) -> dict[str, Any]:
    """Build the NxD-shaped config dict, validated, without mutating the inputs.

    ``optimizer_config`` and ``mixed_precision_config`` are filled with NxD's defaults
    (the mixed precision flags follow ``zero_one_enabled``) and checked. NxD's other
    keyword arguments (``tensor_parallel_size``, ``pipeline_parallel_size``, ...) are
    recorded as given, with NxD's defaults for the ones left out; nxd_smp does not set
    up model parallelism itself. With master weights on, it sets
    ``NEURON_RT_STOCHASTIC_ROUNDING_EN=0``, so call it before the first use of the
    device: once a Neuron runtime has started with stochastic rounding on, it refuses (on
    other XLA devices, which have no such rounding, it only warns).

    Returns:
        A new plain dict: ``{"optimizer_config": {...}, "mixed_precision_config": {...},
        "tensor_parallel_size": 1, ...}``.

    Raises:
        ConfigError: for every rule in DESIGN.md section 4.
    """
    unknown = sorted(k for k in nxd_kwargs if k not in _NXD_OTHER_DEFAULTS)
    if unknown:
        raise ConfigError(
            f"neuronx_distributed_config got unknown argument(s) {unknown}; the accepted "
            f"ones are optimizer_config, mixed_precision_config and "
            f"{sorted(_NXD_OTHER_DEFAULTS)}."
        )
    for key in _PARALLEL_SIZE_KEYS:
        value = nxd_kwargs.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive int, got {value!r}.")

    opt = OptimizerConfig.from_dict(optimizer_config)
    mp = MixedPrecisionConfig.from_dict(
        mixed_precision_config, zero_one_enabled=opt.zero_one_enabled
    )
    if mp.use_master_weights:
        check_no_xla_downcast()
        # SMP: the Neuron runtime must round to nearest. It reads this once at start-up.
        set_stochastic_rounding(False, strict=False)
    config: dict[str, Any] = {**_NXD_OTHER_DEFAULTS, **nxd_kwargs}
    config["optimizer_config"] = opt.to_dict()
    config["mixed_precision_config"] = mp.to_dict()
    return config


def configs_from_nxd_dict(nxd_config: Mapping[str, Any]) -> tuple[OptimizerConfig, MixedPrecisionConfig]:
    """Validate an NxD config dict (built by hand or by ``neuronx_distributed_config``).

    Raises:
        ConfigError: when it is not a dict, or either config breaks a rule.
    """
    if not isinstance(nxd_config, Mapping):
        raise ConfigError(
            f"nxd_config must be the dict returned by neuronx_distributed_config(...), got "
            f"{type(nxd_config).__name__}."
        )
    opt = OptimizerConfig.from_dict(nxd_config.get("optimizer_config"))
    mp = MixedPrecisionConfig.from_dict(
        nxd_config.get("mixed_precision_config"), zero_one_enabled=opt.zero_one_enabled
    )
    return opt, mp


class ClippedOptimizer(torch.optim.Optimizer):
    """A plain (unsharded) optimizer that clips the global gradient norm first.

    What ``initialize_parallel_optimizer`` returns with ZeRO-1 off: it shares
    ``param_groups`` and ``state`` with the inner optimizer, so LR schedulers and
    checkpoints see the inner optimizer's. ``grad_norm`` is the fp32 norm of the last
    step before clipping. Gradients are not averaged over data-parallel ranks here
    (that is DDP's job when ZeRO-1 is off).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, grad_clipping: bool = True, max_norm: float = 1.0):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if not isinstance(grad_clipping, bool):
            raise ConfigError(f"grad_clipping must be True or False, got {grad_clipping!r}.")
        self.optimizer = optimizer
        self._grad_clipping = grad_clipping
        self._max_norm = validate_max_norm(max_norm, "max_norm")
        self._grad_norm: torch.Tensor | None = None
        super().__init__(optimizer.param_groups, optimizer.defaults)  # shares the group dicts
        self.state = optimizer.state

    @property
    def grad_norm(self) -> torch.Tensor | None:
        return self._grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        norm = sum_of_squares(grads, device).sqrt()
        coef = clip_coefficient(norm, self._grad_clipping, self._max_norm)
        if grads and coef is not None:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        self.optimizer.step()
        self._grad_norm = norm
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def initialize_parallel_optimizer(
    nxd_config: dict[str, Any],
    optimizer_class: type[torch.optim.Optimizer],
    parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    process_group: GroupSpec = None,
    grad_norm_groups: NormGroupSpec = None,
    **defaults: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer an NxD config asks for.

    ZeRO-1 on: a ``Zero1Optimizer`` with the config's mixed precision, clipping and
    ``max_grad_norm`` (which NxD drops; we pass it). ZeRO-1 off: a ``ClippedOptimizer``
    over ``optimizer_class(parameters, **defaults)``. ``process_group`` is the
    data-parallel group (default: all ranks); with tensor or pipeline parallelism in the
    config it must be given, since nxd_smp does not own model-parallel state.
    """
    opt_cfg, mp_cfg = configs_from_nxd_dict(nxd_config)
    if opt_cfg.zero_one_enabled:
        model_parallel = {
            k: nxd_config.get(k, 1)
            for k in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")
        }
        if any(v != 1 for v in model_parallel.values()) and process_group is None:
            raise ConfigError(
                f"the config has model parallelism {model_parallel}; pass the data-parallel "
                f"group as process_group=... (and the tensor-parallel groups as "
                f"grad_norm_groups=...), since nxd_smp does not set up model parallelism."
            )
        return Zero1Optimizer(
            parameters,
            optimizer_class,
            mixed_precision=mp_cfg,
            grad_clipping=opt_cfg.grad_clipping,
            max_norm=opt_cfg.max_grad_norm,
            process_group=process_group,
            grad_norm_groups=grad_norm_groups,
            **defaults,
        )
    check_optimizer_class(optimizer_class, sharded=False)
    return ClippedOptimizer(
        optimizer_class(parameters, **defaults),
        grad_clipping=opt_cfg.grad_clipping,
        max_norm=opt_cfg.max_grad_norm,
    )
