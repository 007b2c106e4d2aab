"""NxD's trainer API, laid out as neuronx-distributed lays it out (``trainer/``).

* ``neuronx_distributed_config``: NxD's config dict builder, validated, inputs never mutated;
* ``configs_from_nxd_dict``: the two configs nxd_smp interprets, from such a dict;
* ``initialize_parallel_optimizer``: the optimizer an NxD config asks for;
* ``ClippedOptimizer``: what it returns with ZeRO-1 off (a plain optimizer that clips).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .grad_norm import NORM_ROLES, clip_coefficient, global_norm, norm_role, sum_of_squares
from .mixed_precision_config import ConfigError, MixedPrecisionConfig, OptimizerConfig, validate_max_norm
from .runtime_env import check_no_xla_downcast, set_stochastic_rounding
from .backend import GroupSpec, NormGroupSpec, norm_backends
from .param_groups import check_optimizer_class
from .parallel_state import nxd_parallel_groups
from .zero1_optimizer import Zero1Optimizer

__all__ = [
    "neuronx_distributed_config",
    "configs_from_nxd_dict",
    "initialize_parallel_optimizer",
    "ClippedOptimizer",
]

_PARALLEL_SIZE_KEYS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "expert_parallel_size",
    "context_parallel_size",
)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}.")
    return value


def _optional_dict(name: str, value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict or None, got {type(value).__name__}.")
    return dict(value)


def neuronx_distributed_config(
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_config: Mapping[str, Any] | None = None,
    optimizer_config: Mapping[str, Any] | None = None,
    activation_checkpoint_config: Any = None,
    pad_model: bool = False,
    sequence_parallel: bool = False,
    model_init_config: Mapping[str, Any] | None = None,
    lora_config: Any = None,
    mixed_precision_config: Mapping[str, Any] | None = None,
    sequential_move_factor: int = 11,
    lnc_size: int = 1,
    **unknown: Any,
) -> dict[str, Any]:
    """NxD 2.29's ``neuronx_distributed_config``: the same arguments, in the same order, and
    the same dict back, validated and built without mutating the inputs.

    ``optimizer_config`` and ``mixed_precision_config`` are filled with NxD's defaults
    (the mixed precision flags follow ``zero_one_enabled``) and checked; they are what
    nxd_smp interprets. ``model_init_config`` is filled as NxD fills it
    (``sequential_move_factor``, ``meta_device_init=False``, ``param_init_fn=None``). The
    rest (parallel sizes, ``pipeline_config``, ``lora_config``, ``lnc_size`` for Trn2, ...)
    is checked for type and recorded; nxd_smp does not set up model parallelism itself.
    With master weights on it sets ``NEURON_RT_STOCHASTIC_ROUNDING_EN=0``, so call it before
    the first use of the device: once a Neuron runtime has started with stochastic rounding
    on, it refuses (on other XLA devices, which have no such rounding, it only warns).

    Returns:
        A new plain dict with NxD's keys: the four parallel sizes, ``pipeline_config``,
        ``optimizer_config``, ``activation_checkpoint_config``, ``pad_model``,
        ``sequence_parallel``, ``model_init_config``, ``lora_config``,
        ``mixed_precision_config`` and ``lnc_size``.

    Raises:
        ConfigError: an unknown argument (a typo NxD would reject too) or any rule of
            docs/design.md ("Options, validated once"), naming the field.
    """
    if unknown:
        raise ConfigError(
            f"neuronx_distributed_config got unknown argument(s) {sorted(unknown)}; NxD 2.29's "
            f"arguments are {list(inspect.signature(neuronx_distributed_config).parameters)[:-1]}."
        )
    sizes = {
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
        "expert_parallel_size": expert_parallel_size,
        "context_parallel_size": context_parallel_size,
    }
    for name, value in sizes.items():
        _positive_int(name, value)
    _positive_int("lnc_size", lnc_size)
    _positive_int("sequential_move_factor", sequential_move_factor)
    for name, value in (("pad_model", pad_model), ("sequence_parallel", sequence_parallel)):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be True or False, got {value!r}.")
    init = _optional_dict("model_init_config", model_init_config)
    if init is None:
        init = {"sequential_move_factor": sequential_move_factor, "meta_device_init": False, "param_init_fn": None}
    else:
        init.setdefault("sequential_move_factor", sequential_move_factor)
        init.setdefault("meta_device_init", False)
        if init["meta_device_init"] and init.get("param_init_fn") is None:
            raise ConfigError(
                "model_init_config['param_init_fn'] must be given when meta_device_init is True "
                "(the parameters are created on the meta device and need it to be initialised)."
            )

    opt = OptimizerConfig.from_dict(optimizer_config)
    mp = MixedPrecisionConfig.from_dict(mixed_precision_config, zero_one_enabled=opt.zero_one_enabled)
    if mp.use_master_weights:
        check_no_xla_downcast()
        # SMP: the Neuron runtime must round to nearest. It reads this once at start-up.
        set_stochastic_rounding(False, strict=False)
    return {
        **sizes,
        "pipeline_config": _optional_dict("pipeline_config", pipeline_config),
        "optimizer_config": opt.to_dict(),
        "activation_checkpoint_config": activation_checkpoint_config,
        "pad_model": pad_model,
        "sequence_parallel": sequence_parallel,
        "model_init_config": init,
        "lora_config": lora_config,
        "mixed_precision_config": mp.to_dict(),
        "lnc_size": lnc_size,
    }


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
    step before clipping, over the whole model when ``grad_norm_groups`` (tensor parallel)
    and ``pipeline_groups`` are given as in ``Zero1Optimizer``. Gradients are not averaged
    over data-parallel ranks here (that is DDP's job when ZeRO-1 is off).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_clipping: bool = True,
        max_norm: float = 1.0,
        grad_norm_groups: NormGroupSpec = None,
        pipeline_groups: NormGroupSpec = None,
    ):
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
        params = [p for g in self.param_groups for p in g["params"]]
        device = params[0].device if params else torch.device("cpu")
        self._norm_backends = norm_backends(grad_norm_groups, device)
        self._pipeline_backends = norm_backends(pipeline_groups, device)

    @property
    def grad_norm(self) -> torch.Tensor | None:
        return self._grad_norm

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        by_role: dict[str, list[torch.Tensor]] = {role: [] for role in NORM_ROLES}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_role[norm_role(p, pipeline_parallel=bool(self._pipeline_backends))].append(p.grad)
        grads = [g for role in NORM_ROLES for g in by_role[role]]
        device = grads[0].device if grads else torch.device("cpu")
        norm = global_norm(
            sum_of_squares(by_role["replicated"], device),
            sum_of_squares(by_role["split"], device) if by_role["split"] else None,
            tensor_parallel=self._norm_backends,
            pipeline_parallel=self._pipeline_backends,
        )
        coef = clip_coefficient(norm, self._grad_clipping, self._max_norm)
        if grads and coef is not None:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        self.optimizer.step(**kwargs)
        self._grad_norm = norm
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def initialize_parallel_optimizer(
    nxd_config: Mapping[str, Any],
    optimizer_class: type[torch.optim.Optimizer],
    parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    process_group: GroupSpec = None,
    grad_norm_groups: NormGroupSpec = None,
    pipeline_groups: NormGroupSpec = None,
    **defaults: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer an NxD config asks for (NxD's ``initialize_parallel_optimizer``).

    ZeRO-1 on: a ``Zero1Optimizer`` with the config's mixed precision, clipping and
    ``max_grad_norm`` (which NxD drops; we pass it). ZeRO-1 off: a ``ClippedOptimizer``
    over ``optimizer_class(parameters, **defaults)``. The groups are ``process_group``
    (data parallel; default all ranks), ``grad_norm_groups`` (tensor parallel) and
    ``pipeline_groups``; where NxD's parallel state is initialised (``neuronx_distributed``
    installed, ``initialize_model_parallel`` called), those left None come from it as NxD
    takes them (the ZeRO-1 sharding groups, the tensor- and pipeline-parallel replica
    groups). Otherwise a config with tensor or pipeline parallelism needs the matching
    groups passed, or the clipped norm would cover part of the model only.

    Raises:
        ConfigError: the config breaks a rule, or a group the config needs is missing.
    """
    opt_cfg, mp_cfg = configs_from_nxd_dict(nxd_config)
    nxd = nxd_parallel_groups()
    if nxd is not None:
        if opt_cfg.zero_one_enabled and process_group is None:
            process_group = nxd.data
        grad_norm_groups = nxd.tensor if grad_norm_groups is None else grad_norm_groups
        pipeline_groups = nxd.pipeline if pipeline_groups is None else pipeline_groups
    sizes = {k: nxd_config.get(k, 1) for k in _PARALLEL_SIZE_KEYS}
    needed = []
    if sizes["tensor_parallel_size"] > 1 and grad_norm_groups is None:
        needed.append(f"grad_norm_groups=<the tensor-parallel groups> (tensor_parallel_size={sizes['tensor_parallel_size']})")
    if sizes["pipeline_parallel_size"] > 1 and pipeline_groups is None:
        needed.append(f"pipeline_groups=<the pipeline-parallel groups> (pipeline_parallel_size={sizes['pipeline_parallel_size']})")
    model_parallel = any(sizes[k] > 1 for k in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"))
    if opt_cfg.zero_one_enabled and model_parallel and process_group is None:
        needed.append("process_group=<this rank's data-parallel group>")
    if needed:
        raise ConfigError(
            "the config has model parallelism, which nxd_smp does not set up; pass "
            + "; ".join(needed) + ", so that sharding and the clipped norm cover the whole model."
        )
    if opt_cfg.zero_one_enabled:
        return Zero1Optimizer(
            parameters,
            optimizer_class,
            mixed_precision=mp_cfg,
            grad_clipping=opt_cfg.grad_clipping,
            max_norm=opt_cfg.max_grad_norm,
            process_group=process_group,
            grad_norm_groups=grad_norm_groups,
            pipeline_groups=pipeline_groups,
            **defaults,
        )
    check_optimizer_class(optimizer_class, sharded=False)
    return ClippedOptimizer(
        optimizer_class(parameters, **defaults),
        grad_clipping=opt_cfg.grad_clipping,
        max_norm=opt_cfg.max_grad_norm,
        grad_norm_groups=grad_norm_groups,
        pipeline_groups=pipeline_groups,
    )
