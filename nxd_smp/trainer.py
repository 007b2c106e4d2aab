"""NxD's trainer API, laid out as neuronx-distributed lays it out (``trainer/``).

* ``neuronx_distributed_config``: NxD's config dict builder, validated, inputs never mutated;
* ``configs_from_nxd_dict``: the two configs nxd_smp interprets, from such a dict;
* ``initialize_parallel_optimizer``: the optimizer an NxD config asks for, in NxD's wrapper;
* ``NxDOptimizer``: that wrapper (NxD's ``trainer.optimizer.NxDOptimizer``), with its step:
  the context- and sequence-parallel reductions, and with ZeRO-1 off the data-parallel mean
  and clipping;
* ``ClippedOptimizer``: the wrapper's ZeRO-1-off case, built from keywords.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .backend import GroupSpec, NormGroupSpec, norm_backends, select_backend
from .grad_norm import NORM_ROLES, clip_coefficient, global_norm, norm_role, sum_of_squares
from .mixed_precision_config import ConfigError, MixedPrecisionConfig, OptimizerConfig
from .param_groups import check_optimizer_class, check_sequence_parallel, inner_hyperparameters, sequence_parallel_marked
from .parallel_state import nxd_parallel_groups
from .runtime_env import check_master_weights_storage, set_stochastic_rounding
from .zero1_optimizer import Zero1Optimizer

__all__ = [
    "neuronx_distributed_config",
    "configs_from_nxd_dict",
    "initialize_parallel_optimizer",
    "NxDOptimizer",
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
    sequence_parallel: bool | int = False,
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
    if not isinstance(pad_model, bool):
        raise ConfigError(f"pad_model must be True or False, got {pad_model!r}.")
    if not isinstance(sequence_parallel, (bool, int)):  # NxD's run_llama_nxd.py passes an int (default 1)
        raise ConfigError(
            f"sequence_parallel must be True or False (or an int, as NxD's scripts pass it), got "
            f"{sequence_parallel!r} ({type(sequence_parallel).__name__})."
        )
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
        check_master_weights_storage()
        # SMP: the Neuron runtime must round to nearest. It reads this once at start-up.
        set_stochastic_rounding(False, strict=False)
    return {
        **sizes,
        "pipeline_config": _optional_dict("pipeline_config", pipeline_config),
        "optimizer_config": opt.to_dict(),
        "activation_checkpoint_config": activation_checkpoint_config,
        "pad_model": pad_model,
        "sequence_parallel": bool(sequence_parallel),
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


def _sequence_parallel_on(nxd_config: Mapping[str, Any]) -> bool:
    value = nxd_config.get("sequence_parallel", False)
    if not isinstance(value, (bool, int)):
        raise ConfigError(f"nxd_config['sequence_parallel'] must be True or False (or an int), got {value!r}.")
    return bool(value)


class NxDOptimizer(torch.optim.Optimizer):
    """NxD's trainer wrapper (``neuronx_distributed.trainer.optimizer.NxDOptimizer``): what
    ``initialize_parallel_optimizer`` returns, a ``torch.optim.Optimizer`` around the optimizer
    that does the update.

    ``step()`` does what NxD's does, in NxD's order:

    1. context parallelism (``context_parallel_size > 1``): every gradient averaged over the
       context-parallel group;
    2. ``sequence_parallel``: the gradients of the parameters marked
       ``sequence_parallel_enabled=True`` summed over the tensor-parallel group;
    3. ZeRO-1 off: the data-parallel mean (bucketed, last parameters first), then clipping at
       ``max_grad_norm`` with the norm over the tensor- and pipeline-parallel groups;
    4. the inner step.

    With ZeRO-1 the gradients are the optimizer's fp32 accumulation, out of ``.grad``'s
    reach, so steps 1 and 2 are the ``Zero1Optimizer``'s own (``initialize_parallel_optimizer``
    builds it with them), and it averages over data parallelism and clips itself. With ZeRO-1
    off they act on ``.grad``.

    Attributes:
        optimizer: the ``Zero1Optimizer`` (ZeRO-1 on) or the plain torch optimizer.
        nxd_config: the config dict it was built from.
        params: every parameter of its param groups, in order.

    ``state``, ``param_groups`` and ``defaults`` are the inner optimizer's (settable, as in
    NxD), so LR schedulers act on it; ``state_dict``, ``load_state_dict``, ``add_param_group``
    and ``zero_grad`` (``set_to_none=False`` by default, as NxD's) go to it; any other attribute
    is looked up on it (``master_shards``, ``init_zero``, ``backend``, ``mixed_precision``...).

    Args:
        optimizer: what the config asks for: a ``Zero1Optimizer`` with ZeRO-1 on (built with the
            config's ``sequence_parallel`` and context-parallel groups), else a plain one.
        nxd_config: ``neuronx_distributed_config(...)``'s dict.
        process_group, grad_norm_groups, pipeline_groups, context_parallel_groups: with ZeRO-1
            off, the data-, tensor-, pipeline- and context-parallel groups (any form
            ``Zero1Optimizer`` takes); with ZeRO-1 on the ``Zero1Optimizer`` holds its own.

    Raises:
        ConfigError: the optimizer does not fit the config, or a reduction the config asks for
            has no group to run over.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        nxd_config: Mapping[str, Any],
        *,
        process_group: GroupSpec = None,
        grad_norm_groups: NormGroupSpec = None,
        pipeline_groups: NormGroupSpec = None,
        context_parallel_groups: NormGroupSpec = None,
    ):
        opt_cfg, _ = configs_from_nxd_dict(nxd_config)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        self.optimizer = optimizer
        self.nxd_config = nxd_config
        self._grad_norm: torch.Tensor | None = None
        # torch.optim.Optimizer's own bookkeeping (its __init__ would reset the inner optimizer's
        # param_groups and state through the properties below)
        for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                     "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                     "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.params = [p for group in self.param_groups for p in group["params"]]
        self._sequence_parallel = _sequence_parallel_on(nxd_config)
        groups_given = any(g is not None for g in (process_group, grad_norm_groups, pipeline_groups,
                                                    context_parallel_groups))
        self._zero1 = opt_cfg.zero_one_enabled
        if opt_cfg.zero_one_enabled:
            if not isinstance(optimizer, Zero1Optimizer):
                raise ConfigError(
                    f"the config has ZeRO-1 on, but the optimizer is a {type(optimizer).__name__}; build it "
                    f"with initialize_parallel_optimizer(config, optimizer_class, params, ...)."
                )
            if groups_given:
                raise TypeError("with ZeRO-1 on the Zero1Optimizer holds the groups; pass them when building it.")
            if (self._sequence_parallel and not optimizer.sequence_parallel and optimizer.tensor_parallel_size > 1
                    and any(sequence_parallel_marked(p) for p in optimizer.managed_params)):
                raise ConfigError(
                    "the config has sequence_parallel on, but the Zero1Optimizer was built without it: the "
                    "gradients of the parameters marked sequence_parallel_enabled would not be summed over the "
                    "tensor-parallel group. Build it with initialize_parallel_optimizer, or with "
                    "Zero1Optimizer(..., sequence_parallel=True, grad_norm_groups=...)."
                )
            if nxd_config.get("context_parallel_size", 1) > 1 and optimizer.context_parallel_size == 1:
                raise ConfigError(
                    f"the config has context_parallel_size={nxd_config['context_parallel_size']}, but the "
                    f"Zero1Optimizer averages over no context-parallel group. Build it with "
                    f"initialize_parallel_optimizer, or with Zero1Optimizer(..., context_parallel_groups=...)."
                )
            return
        if isinstance(optimizer, Zero1Optimizer):
            raise ConfigError(
                "the config has ZeRO-1 off (optimizer_config['zero_one_enabled'] is False), but the optimizer is a "
                "Zero1Optimizer; set zero_one_enabled=True, or pass a plain torch optimizer."
            )
        self._grad_clipping, self._max_norm = opt_cfg.grad_clipping, opt_cfg.max_grad_norm
        device = self.params[0].device if self.params else torch.device("cpu")
        self._data = select_backend(device, process_group)
        self._tensor = norm_backends(grad_norm_groups, device)
        self._pipeline = norm_backends(pipeline_groups, device)
        self._context = norm_backends(context_parallel_groups, device)
        if nxd_config.get("context_parallel_size", 1) > 1 and not self._context:
            raise ConfigError(_missing_groups(["context_parallel_groups=<the context-parallel groups> "
                                               f"(context_parallel_size={nxd_config['context_parallel_size']})"]))
        if self._sequence_parallel and not self._tensor and nxd_config.get("tensor_parallel_size") == 1:
            self._sequence_parallel = False  # an NxD config at tensor-parallel size 1: nothing to sum over
        if self._sequence_parallel:
            check_sequence_parallel(self.params, tensor_parallel_known=bool(self._tensor), owner="NxDOptimizer")

    def __repr__(self) -> str:
        return f"NxDOptimizer({self.optimizer!r})"

    def __getattr__(self, name: str) -> Any:
        # only reached for names this object lacks: those of the wrapped optimizer
        if name == "optimizer" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    # ---------------------------------------------------------------- delegated, as NxD's
    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's gradient norm before clipping (a tensor; None before the first
        step)."""
        return self._grad_norm

    @property
    def grad_clipping(self) -> bool:
        """Whether the step clips at ``max_norm``; settable between steps, validated."""
        return self.optimizer.grad_clipping if self._zero1 else self._grad_clipping

    @grad_clipping.setter
    def grad_clipping(self, value: bool) -> None:
        self._set_clipping(value, self.max_norm)

    @property
    def max_norm(self) -> float | None:
        """The clipping threshold (the config's ``max_grad_norm``); settable between steps."""
        return self.optimizer.max_norm if self._zero1 else self._max_norm

    @max_norm.setter
    def max_norm(self, value: float) -> None:
        self._set_clipping(self.grad_clipping, value)

    def _set_clipping(self, grad_clipping: bool, max_norm: float | None) -> None:
        if self._zero1:
            self.optimizer.set_clipping(grad_clipping, max_norm)
        else:
            checked = OptimizerConfig(False, grad_clipping, max_norm)
            self._grad_clipping, self._max_norm = checked.grad_clipping, checked.max_grad_norm

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getstate__(self) -> dict[str, Any]:
        return self.optimizer.__getstate__()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.optimizer.__setstate__(state)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """NxD's step (the class docstring); every rank calls it. ``closure`` and ``kwargs`` go
        to the inner optimizer's ``step``."""
        if self._zero1:
            loss = self.optimizer.step(closure, **kwargs)
            self._grad_norm = self.optimizer.grad_norm
            return loss
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        for group in self._context:  # 1. the mean over context parallelism
            if group.world_size > 1:
                torch._foreach_div_(grads, float(group.world_size))
                group.all_reduce_many_(grads)
        if self._sequence_parallel:  # 2. the sum over tensor parallelism, of the marked parameters
            marked = [p.grad for group in self.param_groups for p in group["params"]
                      if p.grad is not None and sequence_parallel_marked(p)]
            for group in self._tensor:
                if group.world_size > 1:
                    group.all_reduce_many_(marked)
        if self._data.world_size > 1:  # 3. the data-parallel mean, last parameters first
            torch._foreach_div_(grads, float(self._data.world_size))
            self._data.all_reduce_many_(grads[::-1])
        self._grad_norm = self._clip()
        return self.optimizer.step(closure, **kwargs)  # 4.

    def _clip(self) -> torch.Tensor:
        """The norm of ``.grad`` over the model (tensor- and pipeline-parallel groups), fp32,
        before clipping; the gradients clipped at ``max_grad_norm`` where clipping is on."""
        pipeline = bool(self._pipeline)
        by_role: dict[str, list[torch.Tensor]] = {role: [] for role in NORM_ROLES}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_role[norm_role(p, pipeline_parallel=pipeline)].append(p.grad)
        grads = [g for role in NORM_ROLES for g in by_role[role]]
        device = grads[0].device if grads else torch.device("cpu")
        dtype = self._data.fp32  # (float64 under XLA_DOWNCAST_BF16: fp32 on the device)
        norm = global_norm(
            sum_of_squares(by_role["replicated"], device, dtype=dtype),
            sum_of_squares(by_role["split"], device, dtype=dtype) if by_role["split"] else None,
            tensor_parallel=self._tensor,
            pipeline_parallel=self._pipeline,
        )
        coef = clip_coefficient(norm, self._grad_clipping, self._max_norm)
        if grads and coef is not None:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm


class ClippedOptimizer(NxDOptimizer):
    """NxD's trainer wrapper with ZeRO-1 off, built from keywords: a plain (unsharded) torch
    optimizer whose ``step()`` averages the gradients over the data-parallel group (every rank
    holds the whole gradient), clips the global norm, then steps (``NxDOptimizer``'s step,
    context and sequence parallelism included). What ``initialize_parallel_optimizer`` returns
    with ZeRO-1 off. Do not wrap the model in DDP as well: the mean would be taken twice.

    Args:
        optimizer: the torch optimizer over the parameters.
        grad_clipping, max_norm: clip the global norm at ``max_norm`` (None only with clipping
            off).
        sequence_parallel: sum the marked parameters' gradients over ``grad_norm_groups``.
        process_group: the data-parallel group (None: every rank, or one process).
        grad_norm_groups, pipeline_groups: the tensor- and pipeline-parallel groups of the norm.
        context_parallel_groups: average every gradient over these first.
        nxd_config: the config to take the clipping and ``sequence_parallel`` from instead of the
            keywords (``initialize_parallel_optimizer`` passes its own).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        grad_clipping: bool = True,
        max_norm: float | None = 1.0,
        sequence_parallel: bool = False,
        process_group: GroupSpec = None,
        grad_norm_groups: NormGroupSpec = None,
        pipeline_groups: NormGroupSpec = None,
        context_parallel_groups: NormGroupSpec = None,
        nxd_config: Mapping[str, Any] | None = None,
    ):
        if nxd_config is None:
            if not isinstance(sequence_parallel, bool):
                raise ConfigError(f"sequence_parallel must be True or False, got {sequence_parallel!r}.")
            nxd_config = {
                "optimizer_config": OptimizerConfig(False, grad_clipping, max_norm).to_dict(),
                "sequence_parallel": sequence_parallel,
            }
        elif (grad_clipping, max_norm, sequence_parallel) != (True, 1.0, False):
            raise TypeError("pass grad_clipping, max_norm and sequence_parallel in nxd_config or as keywords, not both.")
        super().__init__(optimizer, nxd_config, process_group=process_group, grad_norm_groups=grad_norm_groups,
                         pipeline_groups=pipeline_groups, context_parallel_groups=context_parallel_groups)
        if configs_from_nxd_dict(nxd_config)[0].zero_one_enabled:
            raise ConfigError("ClippedOptimizer is the ZeRO-1-off wrapper; this nxd_config has ZeRO-1 on: use "
                              "initialize_parallel_optimizer.")


def _missing_groups(needed: list[str]) -> str:
    return ("the config has model parallelism, which nxd_smp does not set up; pass " + "; ".join(needed)
            + " (or initialise NxD's parallel state), so that the gradient reductions, the sharding and the "
              "clipped norm cover the whole model.")


def initialize_parallel_optimizer(
    nxd_config: Mapping[str, Any],
    optimizer_class: type[torch.optim.Optimizer],
    parameters: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    *,
    process_group: GroupSpec = None,
    grad_norm_groups: NormGroupSpec = None,
    pipeline_groups: NormGroupSpec = None,
    context_parallel_groups: NormGroupSpec = None,
    **defaults: Any,
) -> NxDOptimizer:
    """Build the optimizer an NxD config asks for, in NxD's wrapper (NxD's
    ``initialize_parallel_optimizer``): an ``NxDOptimizer`` whose ``.optimizer`` is

    * ZeRO-1 on: a ``Zero1Optimizer`` with the config's mixed precision, clipping and
      ``max_grad_norm`` (which NxD drops; we pass it), summing the sequence-parallel
      parameters' gradients over the tensor-parallel group when ``sequence_parallel`` is on,
      and averaging over the context-parallel groups;
    * ZeRO-1 off: ``optimizer_class(parameters, **defaults)``, in a ``ClippedOptimizer``.

    ``defaults`` are the inner optimizer's hyperparameters; NxD Training passes
    ``**torch_optimizer.defaults``, so ``decoupled_weight_decay`` is dropped where the class
    does not take it, and kernel options at the class's default (``fused=None``...) choose
    nothing. The groups are ``process_group`` (data parallel; with ZeRO-1 the sharding group;
    default all ranks), ``grad_norm_groups`` (tensor parallel), ``pipeline_groups`` and
    ``context_parallel_groups``; where NxD's parallel state is initialised (``neuronx_distributed``
    installed, ``initialize_model_parallel`` called), those left None come from it as NxD takes
    them (ZeRO-1: the ZeRO-1 sharding groups). Otherwise a config with tensor, pipeline or
    context parallelism needs the matching groups passed, or the reductions and the clipped
    norm would cover part of the model only.

    Raises:
        ConfigError: the config breaks a rule, or a group the config needs is missing.
    """
    opt_cfg, mp_cfg = configs_from_nxd_dict(nxd_config)
    nxd = nxd_parallel_groups()
    if nxd is not None:
        if process_group is None:
            process_group = nxd.sharding if opt_cfg.zero_one_enabled else nxd.data
        grad_norm_groups = nxd.tensor if grad_norm_groups is None else grad_norm_groups
        pipeline_groups = nxd.pipeline if pipeline_groups is None else pipeline_groups
        context_parallel_groups = nxd.context if context_parallel_groups is None else context_parallel_groups
    sizes = {k: nxd_config.get(k, 1) for k in _PARALLEL_SIZE_KEYS}
    sequence_parallel = _sequence_parallel_on(nxd_config)
    needed = []
    if sizes["tensor_parallel_size"] > 1 and grad_norm_groups is None:
        needed.append(f"grad_norm_groups=<the tensor-parallel groups> (tensor_parallel_size="
                      f"{sizes['tensor_parallel_size']}{', sequence_parallel' if sequence_parallel else ''})")
    if sizes["pipeline_parallel_size"] > 1 and pipeline_groups is None:
        needed.append(f"pipeline_groups=<the pipeline-parallel groups> (pipeline_parallel_size={sizes['pipeline_parallel_size']})")
    if sizes["context_parallel_size"] > 1 and context_parallel_groups is None:
        needed.append(f"context_parallel_groups=<the context-parallel groups> (context_parallel_size="
                      f"{sizes['context_parallel_size']})")
    model_parallel = any(sizes[k] > 1 for k in ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size"))
    if model_parallel and process_group is None:
        needed.append("process_group=<this rank's data-parallel group>")
    if needed:
        raise ConfigError(_missing_groups(needed))
    # At tensor-parallel size 1 there is nothing to sum the sequence-parallel gradients over.
    sequence_parallel = sequence_parallel and grad_norm_groups is not None
    if opt_cfg.zero_one_enabled:
        zero1 = Zero1Optimizer(
            parameters,
            optimizer_class,
            mixed_precision=mp_cfg,
            grad_clipping=opt_cfg.grad_clipping,
            max_norm=opt_cfg.max_grad_norm,
            process_group=process_group,
            grad_norm_groups=grad_norm_groups,
            pipeline_groups=pipeline_groups,
            sequence_parallel=sequence_parallel,
            context_parallel_groups=context_parallel_groups,
            **defaults,
        )
        return NxDOptimizer(zero1, nxd_config)
    check_optimizer_class(optimizer_class, sharded=False)
    inner = optimizer_class(parameters, **inner_hyperparameters(optimizer_class, defaults))
    return ClippedOptimizer(inner, nxd_config=nxd_config, process_group=process_group,
                            grad_norm_groups=grad_norm_groups, pipeline_groups=pipeline_groups,
                            context_parallel_groups=context_parallel_groups)
