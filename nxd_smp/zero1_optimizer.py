"""ZeRO-1 sharded optimizer with standard mixed precision.

``Zero1Optimizer`` wraps any element-wise ``torch.optim`` optimizer. Parameters are packed into
flat buckets (``core.layout``); each data-parallel rank owns one contiguous shard of every bucket
and keeps, for its shard only, the master weights and the inner optimizer's states. One
``step()``, as its code reads:

1. reduce: the gradient source (``grad_accum``) hands over this rank's shard of each bucket's
   gradient, summed over micro-batches and ranks (NxD's context- and sequence-parallel sums
   included: ``optim.topology``);
2. norm: the global gradient norm in fp32, over the shards and every group of the topology;
3. clip: the coefficient ``min(1, max_norm / (norm + 1e-6))`` over the mean's size and the loss
   scale, applied while the inner step reads the gradient;
4. inner step: the inner optimizer on the master shards (``optim.inner_step``; on CPU a compiled
   one-pass Adam/AdamW, ``optim.compiled_adamw``);
5. publish: each shard cast to the parameter dtype and all-gathered into the parameters.

Decided once at construction: the options (a validated ``Zero1Config``), the precision plan (every
dtype, ``optim.precision``), the topology (every group, ``optim.topology``), and the backend (the
device: storage, collectives, ranks). Built by ``init_zero``, it holds its parts: the master weights
(``optim.masters``), the gradient source (``grad_accum``), the inner step (``optim.inner_step``) and
this rank's state (``optim.rank_state``: the state dict, ``opt.state``'s view, the installs). NxD's
``NeuronZero1Optimizer`` signature and the training loops' checkpoints live in ``nxd_smp.interop``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .core.errors import ConfigError
from .backend import GroupSpec, NormGroupSpec
from .core.dtensors import local_tensor
from .core.environment import check_master_weights_storage
from .core.layout import BucketKey, BucketLayout, plan_buckets
from .grad_accum import AutogradGrads, GradientSource, MainGradBuffers, ShardedMainGrads
from .mixed_precision_config import MixedPrecisionConfig, Zero1Config
from .optim.compiled_adamw import CompiledAdamW
from .optim.frozen import FrozenParams
from .optim.inner_step import InnerStep
from .optim.loading.run import load_rank_state
from .optim.loss_scaler import DynamicLossScaler
from .optim.masters import MasterWeights
from .optim.norm import NORM_ROLES, norm_role
from .optim.param_groups import (
    check_optimizer_class,
    group_kernel_choices,
    inner_settings,
    managed_params,
    normalize_param_groups,
    sequence_parallel_marked,
)
from .optim.precision import PrecisionPlan
from .optim import full_state
from .optim.rank_state import STATE_LOADED, Generation, ParamStates, RankState
from .optim.topology import Topology

__all__ = ["Zero1Optimizer", "STATE_LOADED"]


class Zero1Optimizer(torch.optim.Optimizer):
    """A ZeRO-1 optimizer with standard mixed precision (docs/design.md says what it computes).

    Args:
        params: parameters or param-group dicts (each group may carry its own hyperparameters).
            Parameters with ``requires_grad=False`` are not managed (no masters, no fp32 buffers),
            and ``step()`` refuses to run once one of them requires a gradient; the managed ones
            share one device and are bf16, fp16 or fp32. A managed parameter frozen at step time
            (``requires_grad=False``) is not touched, as in torch.optim (``optim.frozen``).
        optimizer_class: an element-wise ``torch.optim.Optimizer`` subclass (AdamW, Adam, SGD, ...),
            built over this rank's flat shards with ``**defaults``; on CPU/CUDA with fp32 shards it
            gets ``fused=True`` unless the caller chose ``fused``, ``foreach``, ``capturable`` or
            ``differentiable``.
        mixed_precision: ``MixedPrecisionConfig`` (None: SMP on).
        grad_clipping, max_norm: clip the global gradient norm at ``max_norm`` (positive; ``inf``
            measures the norm without clipping).
        process_group: the data-parallel group: a process group, a one-dimensional ``DeviceMesh``
            (``mesh["dp"]``), torch_xla replica groups (a list of lists of ranks), or None (every rank); on
            an XLA device every form becomes replica groups.
        reduce_dtype: the gradient's reduce-scatter dtype: None (fp32 with fp32 accumulation, else
            the parameter dtype), a floating dtype, or ``"param"`` / ``"master"`` (torch_xla's two).
        bucket_cap_mb: the largest bucket in MiB of fp32 elements (``0``: a bucket per parameter,
            ``inf``: one per group and dtype); None: 128 on CPU/CUDA, 16 on XLA devices.
        grad_norm_groups: the tensor-parallel groups, in the same forms or a list of process groups:
            parameters marked ``tensor_model_parallel=True`` count each member's part in the norm,
            the others once.
        pipeline_groups: the pipeline-parallel groups: the stages' squares add up (a parameter marked
            ``shared=True``, NxD's tied weight, is counted by another stage).
        context_parallel_groups: average every gradient over them first (NxD's wrapper under context
            parallelism, a mesh's ``"cp"`` dimension); where the data-parallel group spans them, its
            mean already does. NxD's sequence parallelism (the sum of the parameters its layers mark
            ``sequence_parallel_enabled``) comes with NxD's call shapes: ``initialize_parallel_optimizer``
            with a config that has it on, or ``NeuronZero1Optimizer(..., sequence_parallel=True)``.
        device_mesh: a ``DeviceMesh`` instead of the groups, its dimensions by name: ZeRO-1 over ``"dp"`` (or
            TorchTitan's ``"dp_replicate"``, or its flattened ``"dp"``), the norm over ``"tp"`` (optional);
            other dimensions of size 1 ignored. DTensor parameters are managed through their local parts.
        topology: all those groups as one ``nxd_smp.optim.topology.Topology`` (then pass none of them).
        pin_layout: passed to torch_xla's collectives.
        lazy_init: build the shards at ``init_zero()`` instead of now.
        compile_update: Adam/AdamW on CPU with fp32 shards: the update, the gradient scaling and the
            cast as one compiled pass. None: where nxd_smp chose the fused kernel and this rank's shards
            hold at least ``COMPILE_MIN_NUMEL`` (1M) elements, where it is faster, or with parameter
            remainders (no fp32 shard in memory); True: required; False: never.
        loss_scaler: a ``DynamicLossScaler`` for fp16 (``scale_loss(loss).backward()``): unscaled
            in fp32 on the shards; a step with an inf/NaN on any rank is skipped on every rank.
        grad_reduction: ``"mean"`` (default: the ranks' gradients averaged, as NxD and DDP do) or
            ``"sum"`` (summed: a loss normalised by the global token count, as TorchTitan's and Megatron's
            ``calculate_per_token_loss``); the norm and the clip see the combined gradient.
        stochastic_rounding, sr_seed: legacy mode only: the bf16 shard update computed in fp32 and
            rounded stochastically, as Neuron's hardware does, seeded by ``sr_seed`` and the rank.
        **defaults: hyperparameters for ``optimizer_class`` (lr, weight_decay, ...).

    The options are validated once into ``config`` (a ``Zero1Config``); the dtypes are ``precision``
    (the precision plan), the groups ``topology``, the device ``backend``.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        optimizer_class: type[torch.optim.Optimizer],
        *,
        mixed_precision: MixedPrecisionConfig | None = None,
        grad_clipping: bool = True,
        max_norm: float = 1.0,
        process_group: GroupSpec = None,
        reduce_dtype: torch.dtype | str | None = None,
        bucket_cap_mb: float | None = None,
        grad_norm_groups: NormGroupSpec = None,
        pipeline_groups: NormGroupSpec = None,
        context_parallel_groups: NormGroupSpec = None,
        topology: Topology | None = None,
        device_mesh: Any = None,
        pin_layout: bool = True,
        lazy_init: bool = False,
        compile_update: bool | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        stochastic_rounding: bool = False,
        sr_seed: int = 0,
        grad_reduction: str = "mean",
        **defaults: Any,
    ):
        _install_eager_step()
        config = Zero1Config(
            grad_clipping=grad_clipping, max_grad_norm=max_norm, mixed_precision=mixed_precision,
            reduce_dtype=reduce_dtype, bucket_cap_mb=bucket_cap_mb, pin_layout=pin_layout, lazy_init=lazy_init,
            compile_update=compile_update, stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
            grad_reduction=grad_reduction,
        )
        check_optimizer_class(optimizer_class)
        if "sequence_parallel" in defaults:  # (else the inner class would refuse it without saying where it goes)
            raise TypeError(
                "Zero1Optimizer takes no sequence_parallel: NxD's sequence parallelism (the parameters its layers "
                "mark sequence_parallel_enabled) comes with NxD's call shapes: initialize_parallel_optimizer with a "
                "config that has sequence_parallel=True, or NeuronZero1Optimizer(..., sequence_parallel=True, "
                "grad_norm_groups=...).")
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}.")
        if config.mixed_precision.use_master_weights:
            check_master_weights_storage()

        groups, group_choices = group_kernel_choices(optimizer_class, normalize_param_groups(params))
        self._managed, device = managed_params(groups)
        self._topology = Topology.build(
            device, data=process_group, tensor=grad_norm_groups, pipeline=pipeline_groups,
            context=context_parallel_groups, device_mesh=device_mesh,
            params=self._managed, owner=type(self).__name__, pin_layout=config.pin_layout, given=topology)
        self._backend = self._topology.data
        self._plan = PrecisionPlan.resolve(config.mixed_precision, backend=self._backend,
                                           param_dtypes={p.dtype for p in self._managed},
                                           reduce_dtype=config.reduce_dtype, stochastic_rounding=stochastic_rounding)
        if config.bucket_cap_mb is None:
            config = dataclasses.replace(config, bucket_cap_mb=self._backend.default_bucket_cap_mb)
        self._config = config
        self._scaler = None if loss_scaler is None else loss_scaler.to(device)
        self._optimizer_class = optimizer_class
        self._inner_settings = inner_settings(
            optimizer_class, defaults, kernel_chosen=bool(group_choices),
            has_fused_kernels=self._backend.has_fused_kernels, fp32_shards=self._plan.fp32_shards(
                p.dtype for p in self._managed), step_counter_on_device=self._backend.step_counter_on_device
            and loss_scaler is not None, compile_update=config.compile_update, device=device)
        managed_ids = {id(p) for p in self._managed}
        self._frozen = FrozenParams(self._managed, [p for group in groups for p in group["params"]
                                                    if id(p) not in managed_ids])
        wrapper_groups = [{**group, "params": [p for p in group["params"] if id(p) in managed_ids],
                           **({"param_names": [n for n, p in zip(group["param_names"], group["params"])
                                               if id(p) in managed_ids]} if "param_names" in group else {})}
                          for group in groups]
        self._layout_frozen = False
        super().__init__(wrapper_groups, self._inner_settings.group_defaults)
        self._layout_frozen = True
        self._initialized = False
        self._grad_norm: torch.Tensor | None = None
        self._generation = Generation()
        if not config.lazy_init:
            self.init_zero()

    # ------------------------------------------------------------------ what it was built with
    @property
    def config(self) -> Zero1Config:
        """The validated options."""
        return self._config

    @property
    def mixed_precision(self) -> MixedPrecisionConfig:
        return self._config.mixed_precision

    @property
    def precision(self) -> PrecisionPlan:
        """The precision plan: every dtype of the step, the rounding."""
        return self._plan

    @property
    def topology(self) -> Topology:
        """Every group the step communicates over; this rank's place."""
        return self._topology

    @property
    def backend(self) -> Any:
        """The device: storage, collectives, ranks, coordination."""
        return self._backend

    @property
    def world_size(self) -> int:
        """The data-parallel size."""
        return self._backend.world_size

    @property
    def rank(self) -> int:
        """This rank in the data-parallel group."""
        return self._backend.rank

    @property
    def process_group(self) -> Any:
        """The torch.distributed data-parallel group (None: the default one, or XLA replicas)."""
        return self._backend.process_group

    @property
    def sequence_parallel(self) -> bool:
        """Whether marked parameters' gradients are summed over the tensor-parallel group."""
        return self._topology.sequence_parallel

    @property
    def context_parallel_size(self) -> int:
        """The context-parallel size the gradients are averaged over (1: none)."""
        return self._topology.context_size

    @property
    def tensor_parallel_size(self) -> int:
        """The tensor-parallel size (``grad_norm_groups``; 1: none)."""
        return self._topology.tensor_size

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        return self._scaler

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's global gradient norm before clipping (an fp32 tensor); None before."""
        return self._grad_norm

    @property
    def state_generation(self) -> int:
        """Changes whenever the state does (a step, a load): what a saved copy stands for."""
        return self._generation.value

    @property
    def state(self) -> ParamStates:
        """Per managed parameter, its optimizer state as this rank holds it (``optim.rank_state.ParamStates``:
        views of this rank's range of each moment, its own counters), read-only; never empty once
        built (the state is made at construction), so no framework steps the optimizer to create one
        (empty before ``init_zero`` under ``lazy_init``)."""
        held = self.__dict__.get("_param_states")
        return held if held is not None else ParamStates()

    @state.setter
    def state(self, value: Any) -> None:
        if not getattr(self, "_layout_frozen", True) and isinstance(value, Mapping) and not value:
            return  # (torch.optim.Optimizer's constructor)
        raise TypeError("Zero1Optimizer.state is a read-only view of this rank's shards: load a state with "
                        "load_state_dict (or nxd_smp.checkpoint), which checks it.")

    @property
    def grad_clipping(self) -> bool:
        """Whether ``step()`` clips at ``max_norm``; settable between steps (optimum-neuron sets it, and
        ``max_norm``, around each step), validated as in the constructor."""
        return self._config.grad_clipping

    @grad_clipping.setter
    def grad_clipping(self, value: bool) -> None:
        self.set_clipping(value)

    @property
    def max_norm(self) -> float | None:
        """The clipping threshold (None only while clipping is off); settable between steps."""
        return self._config.max_grad_norm

    @max_norm.setter
    def max_norm(self, value: float) -> None:
        self.set_clipping(self._config.grad_clipping, value)

    def set_clipping(self, grad_clipping: bool, max_norm: float | None = None) -> None:
        """Change gradient clipping between steps (``max_norm`` None: keep it); validated as in the
        constructor."""
        self._config = dataclasses.replace(self._config, grad_clipping=grad_clipping,
                                           max_grad_norm=self._config.max_grad_norm if max_norm is None else max_norm)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (unchanged without a loss scaler)."""
        return loss if self._scaler is None else self._scaler.scale_loss(loss)

    # ------------------------------------------------------------------ shards and masters
    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The ``optimizer_class`` instance over this rank's flat shards (``base_optimizer`` in
        torch_xla's words)."""
        self._require_initialized()
        return self._inner

    base_optimizer = inner_optimizer

    @property
    def bucket_layouts(self) -> list[BucketLayout]:
        self._require_initialized()
        return list(self._layouts)

    @property
    def managed_params(self) -> list[torch.Tensor]:
        """The parameters this optimizer updates, in layout order."""
        return list(self._managed)

    @property
    def master_shards(self) -> list[torch.Tensor]:
        """This rank's shard of each bucket in the master dtype (fp32 under SMP): the inner optimizer's
        parameters, or with ``use_param_remainders`` new tensors rebuilt from the parameters and their
        remainders."""
        self._require_initialized()
        return self._masters.values()

    @property
    def inner_shards(self) -> list[torch.Tensor]:
        """The inner optimizer's parameters, one per bucket: the keys of its state. With
        ``use_param_remainders`` they hold data only inside ``step()``."""
        self._require_initialized()
        return list(self._masters.shards)

    @property
    def rank_state(self) -> RankState:
        """This rank's state (``optim.rank_state.RankState``): the part a load (``optim.loading``)
        installs a checked state through."""
        self._require_initialized()
        return self._rank_state

    def rebuild_master_from_params(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Rebuild the master weights of ``params`` (default: every managed parameter) from their
        current values now; precision below the parameter dtype is lost. ``step()`` does it by itself
        for parameters written in place since the optimizer wrote them (torch counts those writes);
        call it after writes torch does not count, such as ``param.data.copy_(...)``."""
        self._require_initialized()
        position = {id(p): i for i, p in enumerate(self._managed)}
        indices = list(range(len(self._managed))) if params is None else []
        for p in [] if params is None else params:
            if id(p) not in position:
                raise ConfigError(f"a tensor of shape {tuple(p.shape)} is not managed by this optimizer; pass "
                                 f"parameters it was built with (requires_grad=True).")
            indices.append(position[id(p)])
        self._masters.rebuild(indices, only_changed_values=False)

    def adopt_param_changes(self) -> None:
        """Take up parameters written in place outside the optimizer since it last wrote them
        (``model.load_state_dict``, a broadcast, ``p.mul_(...)`` under ``no_grad``): their masters are
        rebuilt from them, unless their values still equal what it wrote. ``step()``,
        ``state_dict()`` and ``save_checkpoint`` call it."""
        self._require_initialized()
        self._masters.adopt_changes()

    # ------------------------------------------------------------------ construction
    def init_zero(self) -> None:
        """Build the layout, flat buffers, master shards, hooks and inner optimizer.

        Called by the constructor unless ``lazy_init=True``; then call it once before the first
        backward pass. Called again (NxD's Llama scripts call ``optimizer.optimizer.init_zero()``
        after loading pretrained weights), it rebuilds every master weight from the current
        parameters, so the next step starts from those weights however they were written
        (``.data`` included); the optimizer state is kept.
        """
        if self._initialized:
            self.rebuild_master_from_params()
            return
        params, topology, plan = self._managed, self._topology, self._plan  # (in param-group order)
        pipeline = bool(topology.pipeline)
        keys = [BucketKey(gi, p.dtype, norm_role(p, pipeline_parallel=pipeline),
                          topology.sequence_parallel and sequence_parallel_marked(p))
                for gi, group in enumerate(self.param_groups) for p in group["params"]]
        storage = [local_tensor(p) for p in params]  # (a DTensor's local part)
        self._layouts = plan_buckets([t.numel() for t in storage], keys, self._backend.world_size,
                                     self._config.bucket_cap_numel)
        self._backend.place_params(storage, self._layouts)
        self._masters = MasterWeights(storage, self._layouts, self._backend, plan, written_through=params)
        source = (ShardedMainGrads if self.mixed_precision.use_sharded_grad_acc else
                  MainGradBuffers if plan.fp32_accumulation else AutogradGrads)
        self._grads: GradientSource = source(params, self._layouts, topology, plan)
        inner_groups = [{**{k: v for k, v in group.items() if k not in ("params", "param_names")},
                         "params": [m for layout, m in zip(self._layouts, self._masters.shards)
                                    if layout.key.group == gi]}
                        for gi, group in enumerate(self.param_groups)]
        self._inner = self._optimizer_class(inner_groups, **self._inner_settings.kwargs)
        self._inner_step = InnerStep(
            self._inner, self._masters.shards, stochastic_rounding=plan.stochastic,
            sr_generator=self._backend.random_generator(self._config.sr_seed) if plan.stochastic else None,
            masters=self._masters, backend=self._backend,
            compiled=CompiledAdamW.where_it_applies(
                self._inner, self._backend.device, self._config.compile_update,
                shard_numel=sum(layout.shard_numel for layout in self._layouts), remainders=plan.remainders)
            if self._inner_settings.may_compile else None, layouts=self._layouts)
        self._inner_step.create_state([layout.shard_numel for layout in self._layouts])
        self._rank_state = RankState(
            inner_step=self._inner_step, masters=self._masters, layouts=self._layouts, backend=self._backend,
            coordinate=topology.coordinate, managed=params, param_groups=self.param_groups,
            mixed_precision=self.mixed_precision, loss_scaler=self._scaler, gradients=self._grads,
            generation=self._generation)
        self.__dict__["_param_states"] = ParamStates(self._rank_state)
        self._norm_buckets = {role: [b for b, layout in enumerate(self._layouts) if layout.key.role == role]
                              for role in NORM_ROLES}
        self._initialized = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout_frozen", False):
            raise RuntimeError("Zero1Optimizer cannot add a param group after construction (its buffers are laid "
                               "out once); pass every group to the constructor.")
        super().add_param_group(param_group)

    def _require_initialized(self) -> None:
        if not self._initialized:
            raise RuntimeError("this optimizer was built with lazy_init=True; call init_zero() before training or "
                               "using its state.")

    # ------------------------------------------------------------------ the state dict
    def state_dict(self) -> dict[str, Any]:
        """This rank's state (``RankState.state_dict``): the inner optimizer's state over its shards, each
        parameter's counters, the hyperparameters, the layout it was written with, and the master shards
        with ``use_master_weights_in_ckpt``. It loads at the same DP size and rank; ``nxd_smp.checkpoint``
        moves across DP sizes. Called by torch's ``get_optimizer_state_dict`` with ``full_state_dict=True``,
        it is the whole state instead (``RankState.full_state_dict``: each parameter's tensors gathered),
        which loads at any DP size. Parameters written in place since the last step are taken up first, so the
        masters match the model. torch's state-dict hooks run around it: a pre-hook that returns a dict
        gives the state dict instead (then nothing is built: a training loop's reference to a
        checkpoint), and a post-hook may return another."""
        state = None
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            result = hook(self)
            state = result if state is None else state
        if state is None:
            self.adopt_param_changes()
            whole = full_state.asked_by_torch(self.loss_scaler is not None)
            state = self.rank_state.state_dict() if whole is None else self.rank_state.full_state_dict(**whole)
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            state = state if result is None else result
        return state

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise if ``state_dict`` is not what ``state_dict()`` returns on this rank (same model,
        layout, DP size and rank, a state the hyperparameters it installs keep); change nothing. It reads
        and checks on this rank alone (``load_state_dict`` also has the ranks agree).

        Raises:
            CheckpointError (a ``ValueError``): naming every way it does not fit, and the fix.
        """
        self._require_initialized()
        load_rank_state(self, state_dict, install=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned on the same rank at the same DP size; every process of the
        job calls it (the ranks agree world-wide: the tensor- and pipeline-parallel peers too). It is
        read, checked, agreed on and installed as every checkpoint is (the load pipeline, ``optim.loading``):
        if one rank's state dict does not fit, or the ranks of the data-parallel group would install
        different hyperparameters or step counts, every rank refuses and nothing changes. With master
        weights in it the parameters become ``master.to(param dtype)``; without, the masters are rebuilt
        at the next step from the parameters loaded by then (a warning says precision was lost).
        torch's load-state-dict hooks run around it; a pre-hook that installs the state itself returns
        ``STATE_LOADED``.

        Raises:
            CheckpointError (a ``ValueError``): the state dict does not fit, naming how.
        """
        self._require_initialized()
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):  # (a hook may add one)
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        if state_dict is not STATE_LOADED:
            load_rank_state(self, state_dict, install=True)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    # ------------------------------------------------------------------ the step
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One optimizer step over every rank's shard; every rank of the group calls it.

        It consumes the gradients accumulated since the previous step (or ``zero_grad()``): the
        next backward starts a new accumulation. A callable ``closure`` is evaluated first, under
        ``enable_grad``, as torch_xla's ZeRO-1 does; ``kwargs`` (and a ``closure`` that is not
        callable, as torch's ``ZeroRedundancyOptimizer`` passes it on) go to the inner optimizer's
        ``step``. Parameters changed in place since the last step are taken up first
        (``adopt_param_changes``). Managed parameters with ``requires_grad=False`` now are left as
        they are (their masters, states, step counters and values; their gradients out of the norm),
        as torch.optim leaves a parameter without a gradient (on XLA, with an inner class other than
        Adam/AdamW in their default kernel, the ``step`` counter is their bucket's and advances:
        ``optim.step_counters``).

        Under ``torch.compile`` (of ``opt.step``, or of a function that calls it) the step runs
        eagerly, as this code is written: dynamo never traces it (its collectives, host bookkeeping
        and the CPU kernels it compiles itself), so a compiled step equals the eager one.

        Raises:
            RuntimeError: a parameter frozen when the optimizer was built requires a gradient now.
        """
        return self._eager_step(closure, **kwargs)  # (``_step`` made untraceable: ``_install_eager_step``)

    @torch.no_grad()
    def _step(self, closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
        self._require_initialized()
        loss, inner_args = None, dict(kwargs)
        if callable(closure):
            with torch.enable_grad():
                loss = closure()
        elif closure is not None:
            inner_args["closure"] = closure
        frozen = self._frozen.now(self._layouts, self._backend)  # (host: requires_grad of each parameter)
        self._backend.begin_step()
        self._generation.advance()
        self._masters.adopt_changes()  # weights written since the last step are the truth
        grads = self._grads.reduce()  # 1. reduce
        if frozen is not None:
            frozen.zero_(grads)  # (a frozen parameter's gradient is no part of the norm)
        norm, coef, found_inf = self._topology.norm_and_coefficient(  # 2. norm, 3. clip (the mean's 1/N, the scale)
            {role: [grads[b] for b in buckets] for role, buckets in self._norm_buckets.items()}, sharded=True,
            dtype=self._plan.norm, device=self._backend.device, compiled=self._inner_step.compiling_norm,
            divisor=self._topology.mean_over if self._config.grad_reduction == "mean" else 1,
            grad_clipping=self._config.grad_clipping, max_norm=self._config.max_grad_norm,
            loss_scale=None if self._scaler is None else self._scaler.scale)
        self._inner_step.update(grads, coef, found_inf, inner_args, self.param_groups, frozen)  # 4., 5. publish
        if self._scaler is not None:
            self._scaler.update(found_inf)
        self._grad_norm = norm
        return loss

    # ------------------------------------------------------------------ gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradient accumulated since the last step (the fp32 ``main_grad``) and the
        parameters' ``.grad``. Optional: ``step()`` consumes the accumulation, so the next backward
        starts a new one whether or not this is called."""
        self._require_initialized()
        self._grads.zero_grad(set_to_none)

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient of ``param`` accumulated since the last step, shaped like it (zeros if
        it got none)."""
        self._require_initialized()
        return self._grads.main_grad(next((i for i, p in enumerate(self._managed) if p is param), None))


def _install_eager_step() -> None:
    """``Zero1Optimizer._eager_step``: ``_step`` that dynamo never traces (``torch.compiler.disable``), set
    at the first build (``import nxd_smp`` imports no torch._dynamo); apart from ``step``, as torch 2.9's
    compile of a bound method follows ``disable``'s attributes through torch.optim's step wrapper."""
    if "_eager_step" not in Zero1Optimizer.__dict__:
        Zero1Optimizer._eager_step = torch.compiler.disable(Zero1Optimizer._step, reason=(
            "torch.compile runs nxd_smp's Zero1Optimizer.step eagerly (its collectives, host bookkeeping and "
            "own compiled kernels): drop fullgraph=True, or compile the model and loss and call opt.step() "
            "outside the compiled function"))


def zero1_optimizer_of(optimizer: Any) -> Zero1Optimizer | None:
    """The ``Zero1Optimizer`` that ``optimizer`` is or holds: NxD's trainer wrapper
    (``initialize_parallel_optimizer``'s), accelerate's ``AcceleratedOptimizer`` and optimum-neuron's
    keep the optimizer they wrap in ``.optimizer``, possibly wrapped again. None when there is none
    (a plain torch optimizer, or nothing)."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if optimizer is None or isinstance(optimizer, Zero1Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None
