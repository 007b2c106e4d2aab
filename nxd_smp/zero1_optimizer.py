"""ZeRO-1 sharded optimizer with standard mixed precision.

``Zero1Optimizer`` wraps any element-wise ``torch.optim`` optimizer. Parameters are
packed into flat buckets (see ``layout``); each data-parallel rank owns one contiguous
shard of every bucket and keeps, for its shard only, the master weights and the inner
optimizer's states. One ``step()``:

1. reduce: per bucket, reduce-scatter the accumulated gradient (a sum; the 1/N of the mean is
   folded into step 3); with context parallelism the gradient is first summed over
   the context-parallel group, and with sequence parallelism the gradient of the parameters
   NxD marks ``sequence_parallel_enabled`` over the tensor-parallel group (NxD's trainer
   wrapper does both on ``.grad``; here they act on the accumulated gradient),
2. norm: the global gradient norm in fp32 (shards, then ``grad_norm_groups``, DP and
   ``pipeline_groups``),
3. clip: the coefficient ``min(1, max_norm / (norm + 1e-6)) / N`` (N: the data-parallel size,
   times the context-parallel size where that is summed here; and 1/loss scale), applied while
   the inner step reads the gradient,
4. inner step: the inner optimizer's step on the master shards (``inner_step``),
5. publish: cast each shard to the parameter dtype and all-gather it into the parameters.

Where the buffers live and how ranks talk is the backend's (``backend``), chosen once at
construction; the options are one validated ``Zero1Config``; the master shards and what
the parameters still agree with are ``master_weights``'.

``NeuronZero1Optimizer`` keeps torch_xla's / NxD's signature and maps it onto this.
NxD's trainer API (``initialize_parallel_optimizer`` and NxD's wrapper, ``NxDOptimizer``) is in
``nxd_smp.trainer``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .backend import Backend, GroupSpec, NormGroupSpec, norm_backends, select_backend
from .checkpoint_checks import check_hyperparameters, check_reference, check_state_entry, is_reference, state_kinds
from .backend.eager import DEFAULT_BUCKET_CAP_MB
from .backend.xla import DEFAULT_BUCKET_CAP_MB as DEFAULT_XLA_BUCKET_CAP_MB
from .fused_adamw import CompiledAdamW, applies_to
from .grad_accum import MainGradBuffers, ShardedMainGrads, flatten_grads
from .grad_norm import clip_coefficient, global_norm, norm_role, sum_of_squares
from .inner_step import InnerStep
from .layout import BucketLayout, plan_buckets
from .loss_scaler import DynamicLossScaler
from .master_weights import MasterWeights
from .mixed_precision_config import ConfigError, MixedPrecisionConfig, Zero1Config, require_bool
from .param_groups import (
    auto_fuse,
    check_optimizer_class,
    check_sequence_parallel,
    group_kernel_choices,
    index_groups,
    inner_hyperparameters,
    managed_params,
    normalize_param_groups,
    sequence_parallel_marked,
)
from .parallel_state import nxd_parallel_groups
from .runtime_env import XLA_DOWNCAST_BF16, check_master_weights_storage

__all__ = [
    "Zero1Optimizer",
    "NeuronZero1Optimizer",
    "zero1_optimizer_of",
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_XLA_BUCKET_CAP_MB",
]

# DEFAULT_BUCKET_CAP_MB (128, CPU/CUDA) and DEFAULT_XLA_BUCKET_CAP_MB (16, XLA devices): MiB
# of fp32 gradient per bucket when the caller chose none; the reasons are in the backends.

STATE_DICT_FORMAT = "nxd_smp.zero1.rank_local/1"


class Zero1Optimizer(torch.optim.Optimizer):
    """A ZeRO-1 optimizer with standard mixed precision.

    Args:
        params: parameters or param-group dicts (each group may carry its own
            hyperparameters). Parameters with ``requires_grad=False`` are not managed.
            All managed parameters must be on one device, in bf16, fp16 or fp32.
        optimizer_class: an element-wise ``torch.optim.Optimizer`` subclass (AdamW,
            Adam, SGD, ...), built over this rank's flat shards with ``**defaults``.
            On CPU/CUDA with fp32 shards it gets ``fused=True`` unless the caller set
            ``fused``, ``foreach``, ``capturable`` or ``differentiable``.
        mixed_precision: ``MixedPrecisionConfig`` (None: SMP on).
        grad_clipping: clip the global gradient norm at ``max_norm``.
        max_norm: positive; ``inf`` measures the norm without clipping.
        process_group: the data-parallel group: a torch.distributed process group,
            torch_xla replica groups (list of lists of ranks), or None (every rank). On an
            XLA device every form becomes replica groups (the default group of
            ``init_process_group("xla")`` included); on CPU/CUDA every form becomes a process
            group.
        reduce_dtype: dtype of the gradient reduce-scatter (None: fp32 with fp32
            accumulation, else the parameter dtype).
        bucket_cap_mb: largest bucket in MiB of fp32 elements; ``0`` puts each parameter
            in a bucket of its own, ``inf`` makes one bucket per (group, dtype). None: 128
            on CPU/CUDA, 16 on XLA devices (``DEFAULT_BUCKET_CAP_MB``,
            ``DEFAULT_XLA_BUCKET_CAP_MB``).
        grad_norm_groups: the tensor-parallel groups (NxD passes its TP replica groups): a
            process group, a list of them, or torch_xla replica groups. Parameters marked
            ``tensor_model_parallel=True`` count each member's part, the others are counted
            once.
        pipeline_groups: the pipeline-parallel groups, in the same forms: each stage holds
            different parameters, so their squares add up over the group; a parameter marked
            ``shared=True`` (NxD's mark for a tied weight another stage already counts) is
            left out here. Without it the norm covers this stage only.
        sequence_parallel: sum the gradient of the parameters marked
            ``sequence_parallel_enabled=True`` over ``grad_norm_groups`` (the tensor-parallel
            group) before the step, as NxD's trainer wrapper does under sequence parallelism:
            each tensor-parallel rank computed them from its part of the sequence. They get
            buckets of their own, summed whole before the reduce-scatter (with sharded
            accumulation: this rank's fp32 shard, after it; a sum commutes with the DP
            reduction). Marked parameters with no tensor-parallel group are refused.
        context_parallel_groups: the context-parallel groups, in the same forms: every
            gradient is averaged over them first (NxD's trainer wrapper under context
            parallelism). Where they lie inside ``process_group`` (NxD's ZeRO-1 sharding groups
            span data x context parallelism) the data-parallel mean already averages over them,
            and nothing more is sent.
        pin_layout: passed to torch_xla collectives.
        lazy_init: defer building shards and buffers until ``init_zero()``.
        compile_update: for Adam/AdamW on CPU with fp32 shards, run the update, the
            gradient scaling and the cast to the parameter dtype as one compiled pass
            (``nxd_smp.fused_adamw``) instead of the fused kernel plus a copy. None: when
            nxd_smp picked the fused kernel itself; True: required (error if it cannot
            apply); False: never.
        loss_scaler: a ``DynamicLossScaler`` for fp16: ``scale_loss(loss).backward()``; the
            gradients are unscaled in fp32 on the shards, a step with an inf/NaN on any rank
            is skipped on every rank, and the scale is updated, all without a host sync.
        stochastic_rounding: legacy mode only: the bf16 shard update (parameters and
            optimizer states) is computed in fp32 and rounded stochastically, as Neuron's
            hardware does; seeded by ``sr_seed`` (and the rank).
        **defaults: hyperparameters for ``optimizer_class`` (lr, weight_decay, ...).

    Every option but the groups and the loss scaler is validated once into a ``Zero1Config``
    (``optimizer.config``).
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
        reduce_dtype: torch.dtype | None = None,
        bucket_cap_mb: float | None = None,
        grad_norm_groups: NormGroupSpec = None,
        pipeline_groups: NormGroupSpec = None,
        sequence_parallel: bool = False,
        context_parallel_groups: NormGroupSpec = None,
        pin_layout: bool = True,
        lazy_init: bool = False,
        compile_update: bool | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        stochastic_rounding: bool = False,
        sr_seed: int = 0,
        **defaults: Any,
    ):
        config = Zero1Config(
            grad_clipping=grad_clipping, max_grad_norm=max_norm, mixed_precision=mixed_precision,
            reduce_dtype=reduce_dtype, bucket_cap_mb=bucket_cap_mb, pin_layout=pin_layout, lazy_init=lazy_init,
            compile_update=compile_update, stochastic_rounding=stochastic_rounding, sr_seed=sr_seed,
        )
        check_optimizer_class(optimizer_class)
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}.")
        require_bool("Zero1Optimizer", "sequence_parallel", sequence_parallel)
        if config.mixed_precision.use_master_weights:
            check_master_weights_storage()

        groups, group_choices = group_kernel_choices(optimizer_class, normalize_param_groups(params))
        self._managed, device = managed_params(groups)
        self._backend = select_backend(device, process_group, pin_layout=config.pin_layout)
        self._norm_backends = norm_backends(grad_norm_groups, device, pin_layout=config.pin_layout)
        self._pipeline_backends = norm_backends(pipeline_groups, device, pin_layout=config.pin_layout)
        context = norm_backends(context_parallel_groups, device, pin_layout=config.pin_layout)
        self._context_parallel_size = math.prod(cp.world_size for cp in context)
        self._context_backends = [  # (a group inside the DP group: the DP mean covers it)
            cp for cp in context if not set(cp.global_ranks) <= set(self._backend.global_ranks)
        ]
        # The mean is over data x context parallelism (CP groups inside the DP group: over DP alone).
        self._mean_over = self._backend.world_size * math.prod(cp.world_size for cp in self._context_backends)
        self._sequence_parallel = sequence_parallel and check_sequence_parallel(
            self._managed, tensor_parallel_known=bool(self._norm_backends), owner=type(self).__name__)
        if config.mixed_precision.use_param_remainders and self._backend.fp32 != torch.float32:
            raise ConfigError(
                f"use_param_remainders=True keeps fp32 masters as bf16 parameters plus 16 bits, but under "
                f"{XLA_DOWNCAST_BF16}=1 the parameters are torch float32 (bf16 on the device) and the masters "
                f"float64. Turn use_param_remainders off, or unset {XLA_DOWNCAST_BF16} and cast the model to "
                f"torch.bfloat16."
            )
        if config.bucket_cap_mb is None:
            config = dataclasses.replace(config, bucket_cap_mb=self._backend.default_bucket_cap_mb)
        self._config = config
        self._mp = config.mixed_precision
        self._scaler = None if loss_scaler is None else loss_scaler.to(device)
        self._reference: dict[str, Any] | None = None  # refer_to_checkpoint's, until the next step
        self._optimizer_class = optimizer_class
        chosen = inner_hyperparameters(optimizer_class, defaults)
        self._inner_defaults = self._inner_kwargs(optimizer_class, dict(chosen), loss_scaler is not None,
                                                  kernel_chosen=bool(group_choices))
        # The compiled one-pass update stands in for the fused kernel nxd_smp chose itself;
        # a caller who picked a variant (fused=..., foreach=..., here or in a param group) gets
        # exactly that.
        self._may_compile = config.compile_update is True or bool(
            config.compile_update is None and self._inner_defaults.get("fused") and "fused" not in chosen
            and not group_choices
        )
        # Every hyperparameter the inner optimizer will see, with its class defaults, so
        # the wrapper's param_groups are complete (LR schedulers read them) before the
        # shards exist. Building it also validates the hyperparameters now.
        probe = optimizer_class([torch.zeros(1, device=device)], **self._inner_defaults)
        full_defaults = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
        del probe
        managed_ids = {id(p) for p in self._managed}
        wrapper_groups = [
            {**group, "params": [p for p in group["params"] if id(p) in managed_ids]} for group in groups
        ]
        self._layout_frozen = False
        super().__init__(wrapper_groups, full_defaults)
        self._layout_frozen = True
        self._initialized = False
        self._grad_norm: torch.Tensor | None = None
        if not config.lazy_init:
            self.init_zero()

    def _inner_kwargs(self, optimizer_class: type, defaults: dict[str, Any], scaled: bool,
                      kernel_chosen: bool) -> dict[str, Any]:
        """What the inner optimizer is built with: the caller's hyperparameters, the fused
        kernel where the device has one and no kernel was chosen (``kernel_chosen``: in a param
        group), and ``capturable`` where a skipped fp16 step must be undone inside the step's
        graph."""
        if (scaled and self._backend.step_counter_on_device and "capturable" not in defaults
                and "capturable" in inspect.signature(optimizer_class.__init__).parameters):
            defaults["capturable"] = True  # keep the step counter on the device
        if kernel_chosen:
            return defaults
        all_fp32 = all(self._shard_dtype(p.dtype) == self._backend.fp32 for p in self._managed)
        return auto_fuse(optimizer_class, defaults, has_fused_kernels=self._backend.has_fused_kernels,
                         all_fp32=all_fp32 and not self._config.stochastic_rounding)

    # ------------------------------------------------------------------ properties
    @property
    def config(self) -> Zero1Config:
        """The validated options this optimizer was built with."""
        return self._config

    @property
    def mixed_precision(self) -> MixedPrecisionConfig:
        return self._mp

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Global gradient norm of the last step (fp32 tensor, before clipping); None
        before the first step."""
        return self._grad_norm

    @property
    def backend(self) -> Backend:
        """The device decision: storage, collectives, rank and checkpoint coordination."""
        return self._backend

    @property
    def world_size(self) -> int:
        return self._backend.world_size

    @property
    def rank(self) -> int:
        return self._backend.rank

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The ``optimizer_class`` instance over this rank's flat shards."""
        self._require_initialized()
        return self._inner

    @property
    def base_optimizer(self) -> torch.optim.Optimizer:
        """``inner_optimizer`` under torch_xla's name for it."""
        return self.inner_optimizer

    @property
    def grad_clipping(self) -> bool:
        """Whether ``step()`` clips at ``max_norm``; settable between steps (optimum-neuron sets
        it, and ``max_norm``, around each step), validated as in the constructor."""
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
        """Change gradient clipping between steps (``max_norm`` None: keep it); validated
        as in the constructor."""
        self._config = dataclasses.replace(
            self._config, grad_clipping=grad_clipping,
            max_grad_norm=self._config.max_grad_norm if max_norm is None else max_norm,
        )

    @property
    def sequence_parallel(self) -> bool:
        """Whether ``step()`` sums the gradients of the parameters marked
        ``sequence_parallel_enabled`` over the tensor-parallel group (``grad_norm_groups``)."""
        return self._sequence_parallel

    @property
    def context_parallel_size(self) -> int:
        """The size of the context-parallel group the gradients are averaged over (1 without one)."""
        return self._context_parallel_size

    @property
    def tensor_parallel_size(self) -> int:
        """The size of the tensor-parallel group (``grad_norm_groups``; 1 without it)."""
        return math.prod(group.world_size for group in self._norm_backends)

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
        """This rank's shard of each bucket, in the shard dtype (fp32 master weights under
        SMP): the inner optimizer's parameters, or with ``use_param_remainders`` new tensors
        rebuilt from the parameters and their remainders."""
        self._require_initialized()
        return self._masters.values()

    @property
    def inner_shards(self) -> list[torch.Tensor]:
        """The inner optimizer's parameters, one per bucket: the keys of its state. With
        ``use_param_remainders`` they hold data only inside ``step()``."""
        self._require_initialized()
        return list(self._masters.shards)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The torch.distributed data-parallel group (None: the default group, or torch_xla
        replica groups on an XLA device)."""
        return self._backend.process_group

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        return self._scaler

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (unchanged without a loss scaler)."""
        return loss if self._scaler is None else self._scaler.scale_loss(loss)

    # ------------------------------------------------------------------ master weights
    def load_master_shards(self, shards: Sequence[torch.Tensor]) -> None:
        """Set the master shards (same shapes as ``master_shards``) and make every rank's
        parameters ``master.to(param dtype)``. Every rank of the group calls it."""
        self._require_initialized()
        self._masters.load(shards)

    def rebuild_master_from_params(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Rebuild the master weights of ``params`` (default: all managed parameters) from
        their current values now; precision below the parameter dtype is lost.

        ``step()`` does this by itself for parameters changed in place since the optimizer
        last wrote them (torch counts those writes); call it for writes torch does not
        count, such as ``param.data.copy_(...)``.
        """
        self._require_initialized()
        if params is None:
            indices = list(range(len(self._managed)))
        else:
            position = {id(p): i for i, p in enumerate(self._managed)}
            indices = []
            for p in params:
                if id(p) not in position:
                    raise ValueError(
                        f"a tensor of shape {tuple(p.shape)} is not managed by this optimizer; "
                        f"pass parameters it was built with (requires_grad=True)."
                    )
                indices.append(position[id(p)])
        self._masters.rebuild(indices, only_changed_values=False)

    def adopt_param_changes(self) -> None:
        """Take up parameters changed in place outside the optimizer since it last wrote
        them (``model.load_state_dict``, a broadcast, ``p.mul_(...)`` under ``no_grad``):
        their master weights are rebuilt from them, unless their values still equal what
        the optimizer wrote. ``step()``, ``state_dict()`` and ``save_checkpoint`` call it."""
        self._require_initialized()
        self._masters.adopt_changes()

    # ------------------------------------------------------------------ dtypes
    def _shard_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Dtype of master weights and optimizer states for a parameter dtype (fp32 on the
        device: ``backend.fp32``)."""
        return self._backend.fp32 if self._mp.use_master_weights else param_dtype

    def _accum_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self._backend.fp32 if self._mp.use_fp32_grad_acc else param_dtype

    def _wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Dtype the gradient is reduce-scattered in."""
        return self._config.reduce_dtype or self._accum_dtype(param_dtype)

    # ------------------------------------------------------------------ construction
    def init_zero(self) -> None:
        """Build the layout, flat buffers, master shards, hooks and inner optimizer.

        Called by the constructor unless ``lazy_init=True``; then call it once before
        the first backward pass. Called again (NxD's Llama scripts call
        ``optimizer.optimizer.init_zero()`` after loading pretrained weights), it rebuilds every
        master weight from the current parameters, so the next step starts from those weights
        however they were written (``.data`` included); the optimizer state is kept.
        """
        if self._initialized:
            self.rebuild_master_from_params()
            return
        params = self._managed  # in param-group order, as the layout wants them
        pipeline = bool(self._pipeline_backends)
        # (group, dtype, role in the norm, summed over the tensor-parallel group first)
        keys = [(gi, p.dtype, norm_role(p, pipeline_parallel=pipeline),
                 self._sequence_parallel and sequence_parallel_marked(p))
                for gi, group in enumerate(self.param_groups) for p in group["params"]]
        self._layouts = plan_buckets(
            [p.numel() for p in params], keys, self._backend.world_size, self._config.bucket_cap_numel
        )
        self._backend.place_params(params, self._layouts)
        self._masters = MasterWeights(
            params, self._layouts, self._backend, self._shard_dtype,
            alias=self._backend.param_shard_is_storage and not self._mp.use_master_weights,
            remainders=self._mp.use_param_remainders,
        )
        self._main_grads: MainGradBuffers | ShardedMainGrads | None = None
        if self._mp.use_sharded_grad_acc:
            wire = [self._wire_dtype(params[layout.param_indices[0]].dtype) for layout in self._layouts]
            self._main_grads = ShardedMainGrads(params, self._layouts, self._backend, wire, dtype=self._backend.fp32)
        elif self._mp.use_fp32_grad_acc:
            self._main_grads = MainGradBuffers(params, self._layouts, self._backend.fp32, self._backend.device,
                                               contiguous=self._backend.persistent_grad_buffers)
        inner_groups = []
        for gi, group in enumerate(self.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            shards = [m for layout, m in zip(self._layouts, self._masters.shards) if layout.key[0] == gi]
            inner_groups.append({**hyper, "params": shards})
        self._inner = self._optimizer_class(inner_groups, **self._inner_defaults)
        self._inner_step = InnerStep(
            self._inner, self._masters.shards, stochastic_rounding=self._config.stochastic_rounding,
            sr_generator=self._backend.random_generator(self._config.sr_seed) if self._config.stochastic_rounding else None,
        )
        self._compiled = None
        if self._may_compile:
            if applies_to(self._inner, self._backend.device):
                self._compiled = CompiledAdamW(self._inner)
            elif self._config.compile_update:
                raise ValueError(
                    "compile_update=True needs torch.optim.Adam or AdamW on CPU with fp32 master "
                    "shards and without amsgrad, maximize or differentiable; pass "
                    "compile_update=None to use it only where it applies."
                )
        self._norm_buckets = {
            role: [b for b, layout in enumerate(self._layouts) if layout.key[2] == role]
            for role in ("replicated", "split")
        }
        self._sequence_parallel_buckets = [b for b, layout in enumerate(self._layouts) if layout.key[3]]
        self._initialized = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_layout_frozen", False):
            raise RuntimeError(
                "Zero1Optimizer cannot add a param group after construction (its buffers "
                "are laid out once); pass every group to the constructor."
            )
        super().add_param_group(param_group)

    def _require_initialized(self) -> None:
        if not self._initialized:
            raise RuntimeError(
                "this optimizer was built with lazy_init=True; call init_zero() before "
                "training or using its state."
            )

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """One optimizer step over every rank's shard; every rank of the group calls it.

        It consumes the gradients accumulated since the previous step (or
        ``zero_grad()``): the next backward starts a new accumulation. A callable
        ``closure`` is evaluated first, under ``enable_grad``, as torch_xla's ZeRO-1 does;
        ``kwargs`` (and a ``closure`` that is not callable, as torch's
        ``ZeroRedundancyOptimizer`` passes it on) go to the inner optimizer's ``step``.
        Parameters changed in place since the last step are taken up first
        (``adopt_param_changes``).
        """
        self._require_initialized()
        loss, inner_args = None, dict(kwargs)
        if callable(closure):
            with torch.enable_grad():
                loss = closure()
        elif closure is not None:
            inner_args["closure"] = closure
        self._backend.begin_step()
        self._reference = None  # the state changes: a checkpoint reference no longer stands for it
        self._masters.adopt_changes()  # weights written since the last step are the truth
        grads = self._reduce_gradients()  # reduce
        norm = self._global_norm(grads)  # norm
        found_inf = None
        if self._scaler is not None:
            norm = norm / self._scaler.scale
            found_inf = ~torch.isfinite(norm)  # the norm is reduced over every rank: all skip alike
        coef = self._gradient_coefficient(norm)  # clip (with the mean's 1/N and the loss scale)
        self._inner_step.pull_hyperparameters(self.param_groups)
        if inner_args or not self._compiled_step(grads, coef, found_inf):
            self._masters.begin_update()  # (remainders: the fp32 masters exist from here to publish)
            self._inner_step(grads, coef, found_inf, inner_args)  # inner step
            self._masters.publish()  # publish
        self._inner_step.push_hyperparameters(self.param_groups)
        if self._scaler is not None:
            self._scaler.update(found_inf)
        self._grad_norm = norm
        return loss

    def _reduce_gradients(self) -> list[torch.Tensor]:
        """Per bucket, this rank's shard of the gradient summed over ranks (and
        micro-batches), in the shard dtype. The accumulation is consumed: the next backward
        starts a new one."""
        grads = self._main_grads
        if grads is not None:
            for i, p in enumerate(self._managed):  # a .grad the hooks did not see (set by hand,
                if p.grad is not None:              # or computed before the optimizer existed)
                    grads.add(i, p.grad)
                    p.grad = None
        if isinstance(grads, ShardedMainGrads):
            # Reduced during backward already. (A .grad set by hand is reduced here as one
            # more pass; every rank must then have one, as every rank runs each backward.)
            grads.end_pass()
            shards = [grads.shard(b) for b in range(len(self._layouts))]
            self._sum_over_model_parallel_groups(shards)  # (sums commute with the DP reduction)
        else:
            flats, spares = [], []
            for b, layout in enumerate(self._layouts):
                wire = self._wire_dtype(self._managed[layout.param_indices[0]].dtype)
                flat = grads.flat(b) if grads is not None else flatten_grads(self._managed, layout, wire)
                flats.append(flat if flat.dtype == wire else flat.to(wire))
                # a shard that arrives in another dtype may land in the consumed accumulation
                spare = grads.buffers[b] if grads is not None and grads.contiguous else None
                spares.append(spare if spare is not None and spare.dtype == self._masters.shards[b].dtype else None)
            self._sum_over_model_parallel_groups(flats)
            shards = self._backend.reduce_scatter(flats, into=spares)
        if grads is not None:
            grads.start_new_accumulation()
        return [s if s.dtype == m.dtype else s.to(m.dtype) for s, m in zip(shards, self._masters.shards)]

    def _sum_over_model_parallel_groups(self, per_bucket: list[torch.Tensor]) -> None:
        """NxD's trainer wrapper's reductions, in its order, in place on each bucket's gradient
        (whole, or this rank's shard): every bucket summed over the context-parallel groups (the
        mean's 1/CP is folded into the gradient coefficient, with the DP mean's 1/N), then the
        sequence-parallel buckets over the tensor-parallel group."""
        for group in self._context_backends:
            for tensor in per_bucket:
                group.all_reduce_(tensor)
        for b in self._sequence_parallel_buckets:
            for group in self._norm_backends:
                group.all_reduce_(per_bucket[b])

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the mean gradient over the whole model (times the loss scale, if any),
        fp32, as a tensor."""
        compiled = self._compiled is not None and self._compiled.enabled  # compiling works here
        device = self._backend.device
        replicated, split = ([grads[b] for b in self._norm_buckets[role]] for role in ("replicated", "split"))
        dtype = self._backend.fp32
        norm = global_norm(
            sum_of_squares(replicated, device, compiled, dtype=dtype),
            sum_of_squares(split, device, compiled, dtype=dtype) if split else None,
            tensor_parallel=self._norm_backends,
            data_parallel=self._backend,
            pipeline_parallel=self._pipeline_backends,
        )
        return norm / self._mean_over if self._mean_over > 1 else norm  # sums -> means

    def _gradient_coefficient(self, norm: torch.Tensor) -> torch.Tensor | float | None:
        """What the summed shard gradients are multiplied by: the clip coefficient of the
        (unscaled) ``norm``, divided by the world size and the loss scale (None: 1)."""
        scale = None if self._scaler is None else self._scaler.scale
        coef: torch.Tensor | float | None = clip_coefficient(norm, self._config.grad_clipping, self._config.max_grad_norm)
        for divisor in (self._mean_over if self._mean_over > 1 else None, scale):
            if divisor is not None:
                coef = 1.0 / divisor if coef is None else coef / divisor
        return coef

    def _compiled_step(self, grads, coef, found_inf) -> bool:
        """The compiled one-pass update (CPU): it writes the cast (with remainders: the split)
        straight into the parameters' shards, which are then gathered. False if it does not
        run here."""
        if self._compiled is None:
            return False
        outs = [self._backend.param_shard(b) for b in range(len(self._layouts))]
        if not self._compiled.step(grads, outs, coef, found_inf, remainders=self._masters.remainders):
            return False
        self._backend.publish(outs)
        self._masters.record_versions()
        return True

    # ------------------------------------------------------------------ grads
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discard the gradient accumulated since the last step (the fp32 ``main_grad``)
        and the parameters' ``.grad``. Optional: ``step()`` consumes the accumulation, so
        the next backward starts a new one whether or not this is called."""
        self._require_initialized()
        if self._main_grads is not None:
            self._main_grads.start_new_accumulation()
        for p in self._managed:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The fp32 gradient of ``param`` accumulated since the last step, shaped like it
        (zeros if it got none)."""
        self._require_initialized()
        if self._main_grads is None:
            raise RuntimeError("main_grad exists only with use_fp32_grad_acc=True.")
        if isinstance(self._main_grads, ShardedMainGrads):
            raise RuntimeError(
                "main_grad is not kept with use_sharded_grad_acc=True: each rank holds only its "
                "shard of the gradient, summed over ranks, and no rank has a parameter's whole "
                "gradient. Turn use_sharded_grad_acc off to read it."
            )
        for i, p in enumerate(self._managed):
            if p is param:
                return self._main_grads.main_grad(i)
        raise ValueError("this parameter is not managed by the optimizer.")

    # ------------------------------------------------------------------ state
    def _layout_signature(self) -> list[dict[str, Any]]:
        return [
            {
                "group": layout.key[0],
                "dtype": str(layout.key[1]),
                "tensor_model_parallel": layout.key[2] == "split",
                **({"pipeline_shared": True} if layout.key[2] == "shared" else {}),
                **({"sequence_parallel": True} if layout.key[3] else {}),
                "numels": list(layout.numels),
                "padded_numel": layout.padded_numel,
            }
            for layout in self._layouts
        ]

    def refer_to_checkpoint(self, reference: dict[str, Any] | None) -> None:
        """Until the next ``step()`` (or another load), ``state_dict()`` returns ``reference``
        instead of this rank's state, and ``load_state_dict(reference)`` is accepted and changes
        nothing: every rank's state is in the nxd_smp checkpoint it names, just saved or loaded.
        ``nxd_smp.loop_checkpoints`` calls it around the saves of training loops that keep one
        rank's optimizer file (the Hugging Face Trainer, accelerate); None ends it.

        Raises:
            CheckpointError: ``reference`` is not a checkpoint reference.
        """
        self._reference = None if reference is None else check_reference(reference, "refer_to_checkpoint")

    @property
    def checkpoint_reference(self) -> dict[str, Any] | None:
        """The reference ``refer_to_checkpoint`` holds (a copy), None if none."""
        return None if self._reference is None else dict(self._reference)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: inner optimizer state over its shards, hyperparameters,
        the layout it was written with, and the master shards if
        ``use_master_weights_in_ckpt``. Load it at the same DP size and rank; to
        change the DP size use ``nxd_smp.checkpoint``. Parameters changed in place since
        the last step are taken up first, so the master weights match the model. While
        ``refer_to_checkpoint`` holds a reference, that reference instead. torch's state-dict
        hooks (``register_state_dict_pre_hook`` / ``_post_hook``) run around it."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        state = dict(self._reference) if self._reference is not None else self._rank_state()
        for hook in self._optimizer_state_dict_post_hooks.values():
            result = hook(self, state)
            state = state if result is None else result
        return state

    def _rank_state(self) -> dict[str, Any]:
        self._require_initialized()
        self.adopt_param_changes()
        ids = index_groups([len(g["params"]) for g in self.param_groups])
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": i} for g, i in zip(self.param_groups, ids)]
        state = {
            "format": STATE_DICT_FORMAT,
            "world_size": self._backend.world_size,
            "rank": self._backend.rank,
            "mixed_precision": self._mp.to_dict(),
            "layout": self._layout_signature(),
            "param_groups": groups,
            "inner": self._inner.state_dict(),
        }
        if self._mp.use_master_weights_in_ckpt:
            state["master_weights"] = [m.detach().clone() for m in self._masters.values()]
        if self._scaler is not None:
            state["loss_scaler"] = self._scaler.state_dict()
        return state

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise if ``state_dict`` is not what ``state_dict()`` returns on this rank of this
        optimizer (same model, layout, DP size and rank); change nothing.

        Raises:
            ValueError: naming every way it does not fit, and the fix.
        """
        self._require_initialized()
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(
                f"not a Zero1Optimizer state dict (missing format {STATE_DICT_FORMAT!r}); "
                f"pass what Zero1Optimizer.state_dict() returned."
            )
        problems = []
        for key, mine in (("world_size", self._backend.world_size), ("rank", self._backend.rank)):
            if state_dict.get(key) != mine:
                problems.append(f"{key} {state_dict.get(key)} (this optimizer: {mine})")
        if state_dict.get("layout") != self._layout_signature():
            problems.append("bucket layout (parameters, shapes, dtypes, groups or bucket size differ)")
        if len(state_dict.get("param_groups", [])) != len(self.param_groups):
            problems.append(
                f"{len(state_dict.get('param_groups', []))} param groups (this optimizer: "
                f"{len(self.param_groups)})"
            )
        masters = state_dict.get("master_weights")
        if masters is not None:
            if not isinstance(masters, (list, tuple)) or len(masters) != len(self._layouts) or any(
                not isinstance(a, torch.Tensor) or not a.dtype.is_floating_point or tuple(a.shape) != (layout.shard_numel,)
                for a, layout in zip(masters, self._layouts)
            ):
                problems.append("master weight shard shapes")
        problems += self._inner_state_problems(state_dict.get("inner"), state_dict.get("param_groups"))
        if problems:
            raise ValueError(
                "this state dict does not fit the optimizer: " + "; ".join(problems) + ". "
                "Rank-local state dicts load only into the same model, DP size and rank; "
                "use nxd_smp.checkpoint to change the DP size."
                + (" A training loop that writes one rank's optimizer file (the Hugging Face Trainer, "
                   "accelerate's save_state) keeps every rank's state only with nxd_smp's hooks: "
                   "Zero1TrainerCallback(trainer), nxd_smp.loop_checkpoints.register_accelerate_hooks "
                   "(docs/training_loops.md)." if state_dict.get("rank") != self._backend.rank else "")
            )

    def _inner_state_problems(self, inner: Any, groups: Any) -> list[str]:
        """What in a state dict's ``inner`` (the inner optimizer's own state dict) and
        ``param_groups`` does not fit: per shard the inner optimizer's own state keys, tensor or
        0-dim as its own, moments shaped like the shard; hyperparameters of the groups' kinds."""
        if not isinstance(inner, dict) or not isinstance(inner.get("state"), dict) \
                or not isinstance(inner.get("param_groups"), list) or not isinstance(groups, list):
            return ["the inner optimizer's state (not a torch.optim state dict)"]
        shards = [(layout.shard_numel,) for gi in range(len(self.param_groups))
                  for layout in self._layouts if layout.key[0] == gi]  # the inner optimizer's order
        kinds = state_kinds(self)
        problems = []
        for index, entry in inner["state"].items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(shards):
                problems.append(f"inner state for shard {index!r}, which this optimizer does not have")
            else:
                problems += check_state_entry(entry, kinds, shards[index], f"inner state of shard {index}")
        for i, (saved, group) in enumerate(zip(groups, self.param_groups)):
            try:
                hyper = {k: v for k, v in saved.items() if k != "params"} if isinstance(saved, dict) else saved
                check_hyperparameters(hyper, group, f"param group {i}")
            except ValueError as e:
                problems.append(str(e).rstrip("."))
        return problems

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned on the same rank at the same DP size.

        With master weights in it, the parameters become ``master.to(param dtype)``.
        Without them, the master weights stay those of the current parameters, and the
        model's weights loaded before or after this call are taken up at the next
        ``step()`` (precision below the parameter dtype is lost; a warning says so when
        the state comes from training). Everything is checked before anything changes
        (``check_state_dict``); at DP > 1 every rank calls it, and if one rank's state dict
        does not fit, every rank refuses. A checkpoint reference (``refer_to_checkpoint``) is accepted
        only once the checkpoint it names was loaded, and then changes nothing. torch's
        load-state-dict hooks run around it (a pre-hook may load that checkpoint).

        Raises:
            ValueError: the state dict does not fit, naming how; a reference to a checkpoint
                that was not loaded, naming the call that loads it.
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            state_dict = state_dict if result is None else result
        if is_reference(state_dict):
            self._accept_reference(state_dict)
        else:
            self._load_rank_state(state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _accept_reference(self, reference: dict[str, Any]) -> None:
        reference = check_reference(reference, "the state dict")
        if self._reference is not None and self._reference["id"] == reference["id"]:
            return
        loaded = "" if self._reference is None else f" (the one loaded is save {self._reference['id']})"
        raise ValueError(
            f"this state dict only refers to the nxd_smp checkpoint {reference['checkpoint']!r} saved beside the "
            f"file it came from (save {reference['id']}, DP {reference['dp_size']}), which holds every rank's "
            f"optimizer state and was not loaded{loaded}. With the Hugging Face Trainer add "
            f"Zero1TrainerCallback(trainer) before train(); with accelerate call "
            f"nxd_smp.loop_checkpoints.register_accelerate_hooks(accelerator, model, optimizer) before load_state(); "
            f"else nxd_smp.load_checkpoint(<that folder>/{reference['checkpoint']}, model=..., optimizer=...)."
        )

    def _load_rank_state(self, state_dict: dict[str, Any]) -> None:
        try:
            self.check_state_dict(state_dict)
            problem = None
        except ValueError as e:
            problem = e
        if self._backend.world_size > 1:  # every rank loads (the masters are published to all): all refuse
            failures = [f for f in self._backend.coordinator.all_gather(None if problem is None else str(problem)) if f]
            if problem is None and failures:
                raise ValueError(f"another rank refused its state dict, so this one loads nothing either: {failures[0]}")
        if problem is not None:
            raise problem
        self._reference = None
        masters = state_dict.get("master_weights")
        if self._scaler is not None and "loss_scaler" in state_dict:
            self._scaler.load_state_dict(state_dict["loss_scaler"])
        # torch.optim keeps the given tensors where dtype and device already match; copy
        # them so training never writes into the caller's state dict.
        self._inner.load_state_dict(copy.deepcopy(state_dict["inner"]))
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for key, value in saved.items():
                if key != "params":
                    group[key] = value
        if masters is not None:
            self._masters.load(masters)
        elif self._mp.use_master_weights and state_dict["inner"].get("state"):
            warnings.warn(
                "the optimizer state has no master weights: those of the parameters you load "
                "into the model (before or after this call) are rebuilt from them at the next "
                "step, so precision below the parameter dtype is lost. Save with "
                "use_master_weights_in_ckpt=True to keep it.",
                stacklevel=2,
            )


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
            raise ValueError(
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
        if sequence_parallel is None:
            sequence_parallel = use_grad_acc_hook
        nxd = nxd_parallel_groups()  # NxD's parallel state, where it is initialised: its defaults
        if nxd is not None:
            sharding_groups = nxd.sharding if sharding_groups is None else sharding_groups
            grad_norm_groups = nxd.tensor if grad_norm_groups is None else grad_norm_groups
            pipeline_groups = nxd.pipeline if pipeline_groups is None else pipeline_groups
            if context_parallel_groups is None and use_grad_acc_hook:
                context_parallel_groups = nxd.context
            if grad_norm_groups is None:  # NxD's tensor-parallel size is 1: nothing to sum over
                sequence_parallel = False
        self._higher_cc_precision = higher_cc_precision
        super().__init__(
            params,
            optimizer_class,
            mixed_precision=MixedPrecisionConfig(
                use_master_weights=use_master_weights,
                use_fp32_grad_acc=use_grad_acc_hook,
                use_master_weights_in_ckpt=save_master_weights,
            ),
            grad_clipping=grad_clipping,
            max_norm=1.0 if max_norm is None else max_norm,
            process_group=sharding_groups,
            bucket_cap_mb=_torch_xla_bucket_cap(bucket_cap_mb_reduce_scatter, bucket_cap_mb_all_gather),
            grad_norm_groups=grad_norm_groups,
            pipeline_groups=pipeline_groups,
            sequence_parallel=sequence_parallel,
            context_parallel_groups=context_parallel_groups,
            pin_layout=pin_layout,
            lazy_init=lazy_init,
            **defaults,
        )
        if optimizer_dtype is torch.float64 and self._backend.fp32 is not torch.float64:
            warnings.warn(
                "optimizer_dtype=torch.float64: nxd_smp keeps fp32 master weights (NxD asks for float64 "
                "under XLA_DOWNCAST_BF16=1, where the device stores float64 as fp32).", stacklevel=2)

    def _wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        # torch_xla: the gradient travels in the parameter dtype unless
        # higher_cc_precision asks for the optimizer dtype.
        return self._shard_dtype(param_dtype) if self._higher_cc_precision else param_dtype

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
            raise ValueError(f"{name} must be a number >= 0, got {value!r}.")
    if reduce_scatter_mb == 0 or all_gather_mb == 0:
        return 0.0
    return float(min(reduce_scatter_mb, all_gather_mb))


def zero1_optimizer_of(optimizer: Any) -> Zero1Optimizer | None:
    """The ``Zero1Optimizer`` that ``optimizer`` is or holds: NxD's trainer wrapper
    (``initialize_parallel_optimizer``'s), accelerate's ``AcceleratedOptimizer`` and
    optimum-neuron's keep the optimizer they wrap in ``.optimizer``, possibly wrapped again.
    None when there is none (a plain torch optimizer, or nothing)."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if optimizer is None or isinstance(optimizer, Zero1Optimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None
