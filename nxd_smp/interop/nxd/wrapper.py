"""NxD's trainer wrapper and its factory, as neuronx-distributed lays them out (``trainer/``):

* ``initialize_parallel_optimizer``: the optimizer an NxD config asks for, in NxD's wrapper;
* ``NxDOptimizer``: that wrapper (NxD's ``trainer.optimizer.NxDOptimizer``), with its step: the
  context- and sequence-parallel reductions, and with ZeRO-1 off the data-parallel mean and clipping;
* ``ClippedOptimizer``: the wrapper's ZeRO-1-off case, built from keywords.

The groups come as one ``Topology`` (``parallel_state.nxd_topology``: NxD's parallel state fills
those left None), the reductions and the norm by role are the topology's, shared with the
``Zero1Optimizer``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ...backend import GroupSpec, NormGroupSpec
from ...core.errors import ConfigError
from ...mixed_precision_config import MixedPrecisionConfig, OptimizerConfig
from ...grad_accum import ReplicatedGrads
from ...optim.param_groups import (
    check_optimizer_class,
    inner_hyperparameters,
    managed_params,
    normalize_param_groups,
    sequence_parallel_marked,
)
from ...optim.precision import PrecisionPlan
from ...optim.topology import Topology
from ...zero1_optimizer import Zero1Optimizer
from .config import PARALLEL_SIZE_KEYS, configs_from_nxd_dict, sequence_parallel_on
from .parallel_state import missing_groups, nxd_topology


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
    With ZeRO-1 on, ``load_state_dict`` is the ``Zero1Optimizer``'s, nxd_smp's one load pipeline. With
    ZeRO-1 off it is the plain torch optimizer's own, and that is enough: every rank holds the whole,
    unsharded state, with no masters, layout or ranges to check against, so nothing nxd_smp adds applies
    (its checkpoints, ``save_checkpoint(..., optimizer=wrapper)``, refuse a plain optimizer and say how to
    save it).

    Args:
        optimizer: what the config asks for: a ``Zero1Optimizer`` with ZeRO-1 on (built with the
            config's ``sequence_parallel`` and context-parallel groups), else a plain one.
        nxd_config: ``neuronx_distributed_config(...)``'s dict.
        process_group, grad_norm_groups, pipeline_groups, context_parallel_groups: with ZeRO-1
            off, the data-, tensor-, pipeline- and context-parallel groups (any form
            ``Zero1Optimizer`` takes); with ZeRO-1 on the ``Zero1Optimizer`` holds its own.
        topology: those groups as one ``Topology`` instead (ZeRO-1 off).
        grad_reduction: with ZeRO-1 off, ``"mean"`` (NxD's, the default) or ``"sum"`` (the ranks' gradients
            summed: a loss that is each rank's sum over its tokens divided by the global token count);
            with ZeRO-1 on it is the ``Zero1Optimizer``'s.

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
        topology: Topology | None = None,
        grad_reduction: str | None = None,
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
        sequence_parallel = sequence_parallel_on(nxd_config)
        groups_given = topology is not None or any(g is not None for g in (process_group, grad_norm_groups,
                                                                            pipeline_groups, context_parallel_groups))
        self._zero1 = opt_cfg.zero_one_enabled
        if opt_cfg.zero_one_enabled:
            if not isinstance(optimizer, Zero1Optimizer):
                raise ConfigError(
                    f"the config has ZeRO-1 on, but the optimizer is a {type(optimizer).__name__}; build it "
                    f"with initialize_parallel_optimizer(config, optimizer_class, params, ...)."
                )
            if groups_given or grad_reduction is not None:
                raise TypeError("with ZeRO-1 on the Zero1Optimizer holds the groups and the grad_reduction; pass them "
                                "when building it.")
            if (sequence_parallel and not optimizer.sequence_parallel and optimizer.tensor_parallel_size > 1
                    and any(sequence_parallel_marked(p) for p in optimizer.managed_params)):
                raise ConfigError(
                    "the config has sequence_parallel on, but the Zero1Optimizer was built without it: the "
                    "gradients of the parameters marked sequence_parallel_enabled would not be summed over the "
                    "tensor-parallel group. Build it with initialize_parallel_optimizer, or with "
                    "NeuronZero1Optimizer(..., sequence_parallel=True, grad_norm_groups=...)."
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
        grad_reduction = "mean" if grad_reduction is None else grad_reduction
        device = self.params[0].device if self.params else torch.device("cpu")
        topology = Topology.build(
            device, data=process_group, tensor=grad_norm_groups, pipeline=pipeline_groups,
            context=context_parallel_groups, params=self.params, owner="NxDOptimizer", given=topology,
            # an NxD config at tensor-parallel size 1 without a group: nothing to sum over
            sequence_parallel=sequence_parallel and not (grad_norm_groups is None
                                                         and nxd_config.get("tensor_parallel_size") == 1))
        if nxd_config.get("context_parallel_size", 1) > 1 and topology.context_size == 1:
            raise ConfigError(missing_groups(["context_parallel_groups=<the context-parallel groups> "
                                              f"(context_parallel_size={nxd_config['context_parallel_size']})"]))
        self._topology = topology
        self._plan = PrecisionPlan.resolve(MixedPrecisionConfig(False, False), backend=topology.data)
        self._grads = ReplicatedGrads(lambda: self.param_groups, topology, self._plan, grad_reduction)

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
        # 1.-3. the context-, sequence- and data-parallel reductions of .grad (its gradient source), the
        # norm over the model and the clip, as every source's
        grads = self._grads.reduce()
        device = grads[0].device if grads else torch.device("cpu")
        norm, coef, _ = self._topology.norm_and_coefficient(
            self._grads.norm_roles(), sharded=False, dtype=self._plan.norm, device=device,
            grad_clipping=self._grad_clipping, max_norm=self._max_norm)  # (already means, or sums as asked)
        if grads and coef is not None:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        self._grad_norm = norm
        return self.optimizer.step(closure, **kwargs)  # 4.


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
        topology: those groups as one ``Topology`` instead.
        grad_reduction: ``"mean"`` (None, the default: NxD's) or ``"sum"`` over the data-parallel (and
            context-parallel) ranks.
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
        topology: Topology | None = None,
        grad_reduction: str | None = None,
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
                         pipeline_groups=pipeline_groups, context_parallel_groups=context_parallel_groups,
                         topology=topology, grad_reduction=grad_reduction)
        if configs_from_nxd_dict(nxd_config)[0].zero_one_enabled:
            raise ConfigError("ClippedOptimizer is the ZeRO-1-off wrapper; this nxd_config has ZeRO-1 on: use "
                              "initialize_parallel_optimizer.")


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

    ``grad_reduction`` among ``defaults`` (``"mean"``, NxD's, or ``"sum"``) is the ``Zero1Optimizer``'s with
    ZeRO-1 on and the wrapper's with it off, never the inner class's.

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
    check_optimizer_class(optimizer_class, sharded=opt_cfg.zero_one_enabled)  # (before any group is built)
    groups = normalize_param_groups(parameters)
    device = managed_params(groups)[1] if opt_cfg.zero_one_enabled else next(
        (p.device for group in groups for p in group["params"]), torch.device("cpu"))  # (a group may be empty)
    topology = nxd_topology(
        device, data=process_group, tensor=grad_norm_groups, pipeline=pipeline_groups, context=context_parallel_groups,
        sequence_parallel=sequence_parallel_on(nxd_config), sharded=opt_cfg.zero_one_enabled,
        config_sizes={k: nxd_config.get(k, 1) for k in PARALLEL_SIZE_KEYS},
        params=[p for group in groups for p in group["params"] if p.requires_grad],
        owner="Zero1Optimizer" if opt_cfg.zero_one_enabled else "NxDOptimizer")
    if opt_cfg.zero_one_enabled:
        zero1 = Zero1Optimizer(groups, optimizer_class, mixed_precision=mp_cfg, grad_clipping=opt_cfg.grad_clipping,
                               max_norm=opt_cfg.max_grad_norm, topology=topology, **defaults)
        return NxDOptimizer(zero1, nxd_config)
    grad_reduction = defaults.pop("grad_reduction", None)  # (the wrapper's, with ZeRO-1 off: not the class's)
    inner = optimizer_class(groups, **inner_hyperparameters(optimizer_class, defaults))
    return ClippedOptimizer(inner, nxd_config=nxd_config, topology=topology, grad_reduction=grad_reduction)
