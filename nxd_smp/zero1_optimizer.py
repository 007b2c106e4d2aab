"""ZeRO-1 sharded optimizer with standard mixed precision.

``Zero1Optimizer`` wraps any element-wise ``torch.optim`` optimizer. Parameters are
packed into flat buckets (see ``layout``); each data-parallel rank owns one contiguous
shard of every bucket and keeps, for its shard only, the master weights and the inner
optimizer's states. One ``step()``:

1. per bucket, reduce-scatter the accumulated gradient (a sum; the 1/world_size of the
   mean is folded into step 3),
2. the global gradient norm in fp32 (shards, then ``grad_norm_groups``, DP and
   ``pipeline_groups``),
3. scale the shard gradients by ``min(1, max_norm / (norm + 1e-6)) / world_size``,
4. the inner optimizer's step on the master shards,
5. cast each shard to the parameter dtype and all-gather it into the parameters.

``NeuronZero1Optimizer`` keeps torch_xla's / NxD's signature and maps it onto this.
NxD's trainer API (``initialize_parallel_optimizer``, ``ClippedOptimizer``) is in
``nxd_smp.trainer``.
"""

from __future__ import annotations

import importlib
import copy
import inspect
import math
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .collectives import Collectives, is_replica_groups, make_collectives
from .fused_adamw import CompiledAdamW, applies_to
from .grad_accum import MainGradBuffers, flatten_grads
from .grad_norm import clip_coefficient, global_norm, norm_role, sum_of_squares
from .layout import BucketLayout, plan_buckets
from .loss_scaler import DynamicLossScaler
from .mixed_precision_config import ConfigError, MixedPrecisionConfig, validate_max_norm
from .placement import staggered_empty
from .precision_ops import stochastic_round
from .runtime_env import check_no_xla_downcast

__all__ = [
    "Zero1Optimizer",
    "NeuronZero1Optimizer",
    "DEFAULT_BUCKET_CAP_MB",
    "DEFAULT_XLA_BUCKET_CAP_MB",
]

#: Default bucket size on CPU/CUDA: 128 MiB of fp32 gradient (32M elements); the fused
#: kernels run over a few large shards. NxD reports NaNs on Neuron with buckets above
#: ~140 MB, so stay below that.
DEFAULT_BUCKET_CAP_MB = 128.0
#: Default on XLA devices: 16 MiB (4M elements). A step works through its buckets one after
#: the other, so a bucket's temporaries (its concatenated gradient, its gathered parameters)
#: are what the step adds to memory, and XLA's fusions run faster at this size. On the XLA
#: CPU device (16.8M-parameter MLP): 25.5 bytes/param peak and 139 ms per step, against
#: 37.1 and 199 ms with one 128 MiB bucket. With pin_layout=False (NxD's setting) the
#: buckets of a step still go out as one coalesced collective.
DEFAULT_XLA_BUCKET_CAP_MB = 16.0

SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Inner optimizers whose update of an element depends on other elements (factored or
# orthogonalised updates, line searches, sparse gradients): sharding changes their result.
_NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "SparseAdam", "Muon")

GroupSpec = dist.ProcessGroup | Sequence[Sequence[int]] | None
NormGroupSpec = dist.ProcessGroup | Sequence[dist.ProcessGroup] | Sequence[Sequence[int]] | None


def _param_groups(params: Any) -> list[dict[str, Any]]:
    """Normalise ``params`` (tensors or dicts of groups) into a list of group dicts."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or of param-group dicts, got a single "
            "Tensor; pass [tensor] or model.parameters()."
        )
    groups = list(params)
    if not groups:
        raise ValueError("Zero1Optimizer got an empty parameter list; pass model.parameters().")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    normalised = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise TypeError(
                f"param group {i} must be a dict with a 'params' key, got {type(group).__name__}."
            )
        tensors = group["params"]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for p in tensors:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"param group {i} holds a {type(p).__name__}, not a Tensor; "
                    f"pass parameters (e.g. model.parameters())."
                )
        normalised.append({**group, "params": tensors})
    return normalised


def _check_params(groups: list[dict[str, Any]]) -> tuple[list[torch.Tensor], torch.device]:
    """Validate the managed parameters; return them in layout order and their device."""
    seen: dict[int, int] = {}
    managed: list[torch.Tensor] = []
    for gi, group in enumerate(groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is listed twice (param groups "
                    f"{seen[id(p)]} and {gi}); list each parameter once."
                )
            seen[id(p)] = gi
            if not p.requires_grad:
                continue
            if not p.is_leaf:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is not a leaf tensor; the "
                    f"optimizer can only update leaves (e.g. nn.Parameter)."
                )
            if p.dtype not in SUPPORTED_PARAM_DTYPES:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} has dtype {p.dtype}; Zero1Optimizer "
                    f"supports {[str(d) for d in SUPPORTED_PARAM_DTYPES]}. Cast the model, e.g. "
                    f"model.to(torch.bfloat16), or freeze that parameter."
                )
            if p.is_sparse:
                raise ValueError("sparse parameters are not supported; use dense parameters.")
            managed.append(p)
    if not managed:
        raise ValueError(
            "Zero1Optimizer got no trainable parameters (all have requires_grad=False)."
        )
    devices = sorted({str(p.device) for p in managed})
    if len(devices) > 1:
        raise ValueError(
            f"parameters are on several devices {devices}; move the whole model to one "
            f"device (each data-parallel rank owns one) before building the optimizer."
        )
    return managed, managed[0].device


def check_optimizer_class(optimizer_class: Any, *, sharded: bool = True) -> None:
    if not (inspect.isclass(optimizer_class) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.AdamW, got {optimizer_class!r}."
        )
    if not sharded:
        return
    for name in _NOT_ELEMENTWISE:
        refused = getattr(torch.optim, name, None)
        if refused is not None and issubclass(optimizer_class, refused):
            raise ValueError(
                f"{optimizer_class.__name__} is not element-wise (its update of one element "
                f"depends on others), so sharding it would change its result. Use an "
                f"element-wise optimizer such as AdamW, Adam or SGD."
            )


def _auto_fuse(
    optimizer_class: type, defaults: dict[str, Any], device: torch.device, all_fp32: bool
) -> dict[str, Any]:
    """Ask for the fused kernel on CPU/CUDA fp32 shards when the caller chose no variant.

    The inner optimizer sees a few large flat tensors, where the fused kernel is the
    fastest and allocates no temporaries. Low-precision shards keep the stock path so
    legacy mode rounds exactly like the stock optimizer.
    """
    chosen = {"fused", "foreach", "capturable", "differentiable"} & set(defaults)
    try:
        accepts_fused = "fused" in inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):
        accepts_fused = False
    if chosen or not accepts_fused or not all_fp32 or device.type not in ("cpu", "cuda"):
        return defaults
    return {**defaults, "fused": True}


def norm_collectives(groups: NormGroupSpec, device: torch.device, pin_layout: bool = True) -> list[Collectives]:
    """The collectives of a norm group spec: None, one process group or replica-group
    list, or a list of process groups."""
    if groups is None:
        return []
    if isinstance(groups, dist.ProcessGroup) or is_replica_groups(groups):
        return [make_collectives(groups, device, pin_layout)]
    return [make_collectives(g, device, pin_layout) for g in groups]


def _copy_group_settings(sources: list[dict[str, Any]], targets: list[dict[str, Any]]) -> None:
    """Every key but ``params`` of each source param group into its target group."""
    for source, target in zip(sources, targets):
        for key, value in source.items():
            if key != "params":
                target[key] = value


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
            torch_xla replica groups (list of lists of ranks), or None (the default group;
            on an XLA device without torch.distributed, all replicas).
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

    ``optimizer.zero_grad()`` clears the fp32 ``main_grad`` buffers; ``model.zero_grad()``
    does not.
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
        pin_layout: bool = True,
        lazy_init: bool = False,
        compile_update: bool | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        stochastic_rounding: bool = False,
        sr_seed: int = 0,
        **defaults: Any,
    ):
        check_optimizer_class(optimizer_class)
        if loss_scaler is not None and not isinstance(loss_scaler, DynamicLossScaler):
            raise TypeError(f"loss_scaler must be a DynamicLossScaler or None, got {type(loss_scaler).__name__}.")
        if not isinstance(stochastic_rounding, bool):
            raise ConfigError(f"stochastic_rounding must be True or False, got {stochastic_rounding!r}.")
        if compile_update not in (None, True, False):
            raise ValueError(f"compile_update must be None, True or False, got {compile_update!r}.")
        if mixed_precision is None:
            mixed_precision = MixedPrecisionConfig()
        if not isinstance(mixed_precision, MixedPrecisionConfig):
            raise TypeError(
                f"mixed_precision must be a MixedPrecisionConfig or None, got "
                f"{type(mixed_precision).__name__}; build one with MixedPrecisionConfig(...) "
                f"or MixedPrecisionConfig.from_dict(d, zero_one_enabled=True)."
            )
        if mixed_precision.use_master_weights:
            check_no_xla_downcast()
        if stochastic_rounding and mixed_precision.use_master_weights:
            raise ConfigError(
                "stochastic_rounding=True is for legacy mode (use_master_weights=False), where the "
                "bf16 shard itself is updated; with master weights the fp32 copy already keeps "
                "what rounding would lose. Turn one of them off."
            )
        if not isinstance(grad_clipping, bool):
            raise ConfigError(f"grad_clipping must be True or False, got {grad_clipping!r}.")
        max_norm = validate_max_norm(max_norm, "max_norm")
        if reduce_dtype is not None and (
            not isinstance(reduce_dtype, torch.dtype) or not reduce_dtype.is_floating_point
        ):
            raise ValueError(
                f"reduce_dtype must be None or a floating torch.dtype, got {reduce_dtype!r}."
            )
        if bucket_cap_mb is not None and (isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float))
                                          or not bucket_cap_mb >= 0):
            raise ValueError(
                f"bucket_cap_mb must be None or a number >= 0 (0: one bucket per parameter, inf: "
                f"no limit), got {bucket_cap_mb!r}."
            )

        groups = _param_groups(params)
        self._managed, self._device = _check_params(groups)
        self._mp = mixed_precision
        self._grad_clipping = grad_clipping
        self._max_norm = max_norm
        self._reduce_dtype = reduce_dtype
        self._comm = make_collectives(process_group, self._device, pin_layout)
        self._norm_comms = norm_collectives(grad_norm_groups, self._device, pin_layout)
        self._pipeline_comms = norm_collectives(pipeline_groups, self._device, pin_layout)
        self._optimizer_class = optimizer_class
        all_fp32 = all(self._shard_dtype(p.dtype) == torch.float32 for p in self._managed)
        self._scaler = None if loss_scaler is None else loss_scaler.to(self._device)
        self._sr = stochastic_rounding
        if stochastic_rounding:
            self._sr_generator = None
            if self._device.type in ("cpu", "cuda"):
                self._sr_generator = torch.Generator(self._device).manual_seed(sr_seed + 7919 * self._comm.rank)
        defaults = dict(defaults)
        if (
            loss_scaler is not None
            and self._device.type not in ("cpu", "cuda")
            and "capturable" not in defaults
            and "capturable" in inspect.signature(optimizer_class.__init__).parameters
        ):
            # Keep the step counter on the device, so a skipped step is undone in-graph.
            defaults["capturable"] = True
        self._inner_defaults = _auto_fuse(optimizer_class, defaults, self._device, all_fp32 and not stochastic_rounding)
        self._compile_update = compile_update
        # The compiled one-pass update stands in for the fused kernel nxd_smp chose itself;
        # a caller who picked a variant (fused=..., foreach=...) gets exactly that.
        self._may_compile = compile_update is True or bool(
            compile_update is None and self._inner_defaults.get("fused") and "fused" not in defaults
        )
        # Every hyperparameter the inner optimizer will see, with its class defaults, so
        # the wrapper's param_groups are complete (LR schedulers read them) before the
        # shards exist. Building it also validates the hyperparameters now.
        probe = optimizer_class([torch.zeros(1, device=self._device)], **self._inner_defaults)
        full_defaults = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
        del probe

        managed_ids = {id(p) for p in self._managed}
        wrapper_groups = [
            {**group, "params": [p for p in group["params"] if id(p) in managed_ids]}
            for group in groups
        ]
        self._layout_frozen = False
        super().__init__(wrapper_groups, full_defaults)
        self._layout_frozen = True

        if bucket_cap_mb is None:
            bucket_cap_mb = DEFAULT_XLA_BUCKET_CAP_MB if self._device.type == "xla" else DEFAULT_BUCKET_CAP_MB
        cap = bucket_cap_mb * 2**20 / 4
        self._cap_numel = None if math.isinf(cap) else max(1, int(cap))
        self._initialized = False
        self._grad_norm: torch.Tensor | None = None
        if not lazy_init:
            self.init_zero()

    # ------------------------------------------------------------------ properties
    @property
    def mixed_precision(self) -> MixedPrecisionConfig:
        return self._mp

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """Global gradient norm of the last step (fp32 tensor, before clipping); None
        before the first step."""
        return self._grad_norm

    @property
    def world_size(self) -> int:
        return self._comm.world_size

    @property
    def rank(self) -> int:
        return self._comm.rank

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
        return self._grad_clipping

    @property
    def max_norm(self) -> float:
        return self._max_norm

    def set_clipping(self, grad_clipping: bool, max_norm: float | None = None) -> None:
        """Change gradient clipping between steps (``max_norm`` None: keep it); validated
        as in the constructor."""
        if not isinstance(grad_clipping, bool):
            raise ConfigError(f"grad_clipping must be True or False, got {grad_clipping!r}.")
        if max_norm is not None:
            self._max_norm = validate_max_norm(max_norm, "max_norm")
        self._grad_clipping = grad_clipping

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
        """This rank's shard of each bucket, in the shard dtype: the inner optimizer's
        parameters (fp32 master weights under SMP)."""
        self._require_initialized()
        return list(self._masters)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The torch.distributed data-parallel group (None: the default group, or
        torch_xla replica groups)."""
        return getattr(self._comm, "group", None)

    def load_master_shards(self, shards: Sequence[torch.Tensor]) -> None:
        """Set the master shards (same shapes as ``master_shards``) and make every rank's
        parameters ``master.to(param dtype)``. Every rank of the group calls it."""
        self._require_initialized()
        if len(shards) != len(self._masters) or any(
            tuple(a.shape) != tuple(b.shape) for a, b in zip(shards, self._masters)
        ):
            raise ValueError("master shards do not match this optimizer's layout.")
        with torch.no_grad():
            for master, saved in zip(self._masters, shards):
                master.copy_(saved)
            self._publish_params()
        self._record_param_versions()

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
        self._rebuild_masters(indices, only_changed_values=False)

    def adopt_param_changes(self) -> None:
        """Take up parameters changed in place outside the optimizer since it last wrote
        them (``model.load_state_dict``, a broadcast, ``p.mul_(...)`` under ``no_grad``):
        their master weights are rebuilt from them, unless their values still equal what
        the optimizer wrote. ``step()``, ``state_dict()`` and ``save_checkpoint`` call it."""
        self._require_initialized()
        changed = self._changed_params()
        if changed:
            self._rebuild_masters(changed, only_changed_values=True)

    # ------------------------------------------------------------------ dtypes
    def _shard_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Dtype of master weights and optimizer states for a parameter dtype."""
        return torch.float32 if self._mp.use_master_weights else param_dtype

    def _accum_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self._mp.use_fp32_grad_acc else param_dtype

    def _wire_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """Dtype the gradient is reduce-scattered in."""
        return self._reduce_dtype or self._accum_dtype(param_dtype)

    # ------------------------------------------------------------------ construction
    def init_zero(self) -> None:
        """Build the layout, flat buffers, master shards, hooks and inner optimizer.

        Called by the constructor unless ``lazy_init=True``; then call it once before
        the first backward pass.
        """
        if self._initialized:
            return
        params = self._managed  # in param-group order, as the layout wants them
        keys = [
            (gi, p.dtype, norm_role(p, pipeline_parallel=bool(self._pipeline_comms)))
            for gi, group in enumerate(self.param_groups)
            for p in group["params"]
        ]
        self._layouts = plan_buckets(
            [p.numel() for p in params], keys, self._comm.world_size, self._cap_numel
        )
        # Eager devices: the parameters become views into one flat buffer per bucket, which
        # the all-gather fills in place. XLA: the parameters stay apart; a bucket exists only
        # inside the step's graph (one concatenation in, one all-gather out).
        self._views = self._device.type in ("cpu", "cuda")
        self._flat_params: list[torch.Tensor] = []
        self._masters: list[torch.Tensor] = []
        self._param_ptrs: list[int] = []
        self._masters_alias_params = self._views and not self._mp.use_master_weights
        with torch.no_grad():
            for b, layout in enumerate(self._layouts):
                dtype = params[layout.param_indices[0]].dtype
                if self._views:
                    flat = staggered_empty(layout.padded_numel, dtype, self._device, "param").zero_()
                    for i, index in enumerate(layout.param_indices):
                        start, end = layout.param_range(i)
                        flat[start:end].copy_(params[index].detach().reshape(-1))
                        params[index].data = flat[start:end].view(params[index].shape)
                    self._flat_params.append(flat)
                    shard = self._comm.shard(flat)
                else:
                    shard = self._comm.local_shard(self._bucket_of_params(b))
                if self._masters_alias_params:
                    master = shard
                else:
                    master = staggered_empty(shard.numel(), self._shard_dtype(dtype), self._device, "master")
                    master.copy_(shard)
                self._masters.append(master)
        if self._views:
            self._param_ptrs = [p.data_ptr() for p in params]
        self._record_param_versions()

        self._main_grads = (
            MainGradBuffers(params, self._layouts, torch.float32, self._device, contiguous=self._views)
            if self._mp.use_fp32_grad_acc
            else None
        )

        inner_groups = []
        for gi, group in enumerate(self.param_groups):
            hyper = {k: v for k, v in group.items() if k != "params"}
            shards = [m for layout, m in zip(self._layouts, self._masters) if layout.key[0] == gi]
            inner_groups.append({**hyper, "params": shards})
        self._inner = self._optimizer_class(inner_groups, **self._inner_defaults)
        self._fused = all(g.get("fused", False) for g in self._inner.param_groups)
        self._compiled = None
        if self._may_compile:
            if applies_to(self._inner, self._device):
                self._compiled = CompiledAdamW(self._inner)
            elif self._compile_update:
                raise ValueError(
                    "compile_update=True needs torch.optim.Adam or AdamW on CPU with fp32 master "
                    "shards and without amsgrad, maximize or differentiable; pass "
                    "compile_update=None to use it only where it applies."
                )
        self._norm_buckets = {
            role: [b for b, layout in enumerate(self._layouts) if layout.key[2] == role]
            for role in ("replicated", "split")
        }
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

    def _record_param_versions(self) -> None:
        """Remember each parameter's in-place version counter: what the optimizer wrote
        (and only that) is known to equal the master weights."""
        self._versions = [p._version for p in self._managed]

    def _changed_params(self) -> list[int]:
        """Managed parameters written in place since ``_record_param_versions``."""
        changed = []
        for i, p in enumerate(self._managed):
            if self._views and p.data_ptr() != self._param_ptrs[i]:
                raise RuntimeError(
                    f"parameter {i} (shape {tuple(p.shape)}) no longer lives in the "
                    f"optimizer's flat buffer: its storage was replaced after the optimizer was "
                    f"built (model.to(...), load_state_dict(assign=True), or assigning .data). "
                    f"Build the optimizer after the model has its final device and dtype, and "
                    f"change weights in place (load_state_dict, copy_), which step() picks up."
                )
            if p._version != self._versions[i]:
                changed.append(i)
        return changed

    @torch.no_grad()
    def _rebuild_masters(self, indices: Sequence[int], only_changed_values: bool) -> None:
        """Master weights of managed parameters ``indices`` from their current values.

        ``only_changed_values``: only where a parameter's value differs from its master
        rounded to the parameter dtype, i.e. where the write changed what the optimizer had
        written (an unchanged parameter, or an element written with its old value, keeps its
        fp32 master). Element-wise ops on this rank's shard, with no rank in the graph.
        """
        wanted = set(indices)
        for b, layout in enumerate(self._layouts):
            members = [index in wanted for index in layout.param_indices]
            if not any(members) or self._masters_alias_params:
                continue  # (aliased: the master shard is the parameter buffer itself)
            current = self._comm.shard(self._flat_params[b]) if self._views else self._comm.local_shard(self._bucket_of_params(b))
            master = self._masters[b]
            if only_changed_values:
                take = current != master.to(current.dtype)
            elif all(members):
                master.copy_(current)
                continue
            else:
                take = self._comm.local_shard(self._bucket_mask(b, members))
            master.copy_(torch.where(take, current.to(master.dtype), master))
        self._record_param_versions()

    def _bucket_of_params(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s current parameter values as one padded flat tensor (one
        concatenation; for XLA, where the parameters are not views of a flat buffer)."""
        layout = self._layouts[b]
        parts = [self._managed[index].detach().reshape(-1) for index in layout.param_indices]
        padding = layout.padded_numel - layout.numel
        if padding:
            parts.append(torch.zeros(padding, dtype=parts[0].dtype, device=self._device))
        return torch.cat(parts)

    def _bucket_mask(self, b: int, members: Sequence[bool]) -> torch.Tensor:
        """A bool per element of bucket ``b``: whether it belongs to a member parameter."""
        layout = self._layouts[b]
        parts = [torch.full((n,), m, dtype=torch.bool, device=self._device) for n, m in zip(layout.numels, members)]
        parts.append(torch.zeros(layout.padded_numel - layout.numel, dtype=torch.bool, device=self._device))
        return torch.cat(parts)

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
        loss, inner_args = None, {}
        if closure is not None and callable(closure):
            with torch.enable_grad():
                loss = closure()
        elif closure is not None:
            inner_args["closure"] = closure
        inner_args.update(kwargs)
        self._comm.begin_step()
        self.adopt_param_changes()
        if self._main_grads is not None:
            self._take_stray_grads()
        self._sync_hyperparameters()
        grads = self._reduce_gradients()
        if self._main_grads is not None:
            self._main_grads.start_new_accumulation()  # consumed: the next backward starts anew
        norm = self._global_norm(grads)
        found_inf = None
        if self._scaler is not None:
            # The norm is reduced over every rank, so all of them see the same overflow.
            norm = norm / self._scaler.scale
            found_inf = ~torch.isfinite(norm)
        coef = self._grad_coefficient(norm)
        if self._scaler is not None:
            coef = (1.0 if coef is None else coef) / self._scaler.scale
        if not inner_args and self._compiled is not None and self._compiled.step(
            grads, [self._comm.shard(flat) for flat in self._flat_params], coef, found_inf
        ):
            self._gather_params()  # the compiled pass already cast into the shards
        else:
            self._inner_step(grads, coef, found_inf, inner_args)
            self._publish_params()
        if self._scaler is not None:
            self._scaler.update(found_inf)
        self._sync_hyperparameters_back()
        self._record_param_versions()  # the optimizer's own writes are not changes
        self._grad_norm = norm
        return loss

    def _take_stray_grads(self) -> None:
        """Fold a ``.grad`` the hooks did not see (computed before the optimizer existed,
        or set by hand) into the accumulation."""
        for i, p in enumerate(self._managed):
            if p.grad is not None:
                self._main_grads.add(i, p.grad)
                p.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (unchanged without a loss scaler)."""
        return loss if self._scaler is None else self._scaler.scale_loss(loss)

    @property
    def loss_scaler(self) -> DynamicLossScaler | None:
        return self._scaler

    def _inner_step(
        self,
        grads: list[torch.Tensor],
        coef: torch.Tensor | float | None,
        found_inf: torch.Tensor | None,
        inner_args: dict[str, Any],
    ) -> None:
        """The inner optimizer's step on the master shards, with the gradient scaled by
        ``coef``; skipped (state unchanged) where ``found_inf``."""
        if self._fused and not self._sr:
            self._apply_coefficient(grads, coef)
            self._inner.found_inf = None if found_inf is None else found_inf.float()
            self._run_inner(grads, inner_args)  # the fused kernels skip and undo ``step`` themselves
            self._inner.found_inf = None
            return
        before = self._snapshot_state() if found_inf is not None else None
        if self._sr:
            widened = self._widen_for_sr()
            grads = [g.float() for g in grads]
        self._apply_coefficient(grads, coef)
        self._run_inner(grads, inner_args)
        if self._sr:
            self._round_after_sr(widened)
        if before is not None:
            self._restore_where(found_inf, before)

    def _run_inner(self, grads: list[torch.Tensor], inner_args: dict[str, Any]) -> None:
        for master, grad in zip(self._masters, grads):
            master.grad = grad
        self._inner.step(**inner_args)
        for master in self._masters:
            master.grad = None

    def _state_tensors(self) -> list[torch.Tensor]:
        """The master shards and every tensor of the inner optimizer's state."""
        out = list(self._masters)
        for master in self._masters:
            out.extend(v for v in self._inner.state.get(master, {}).values() if isinstance(v, torch.Tensor))
        return out

    def _snapshot_state(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {id(t): (t, t.detach().clone()) for t in self._state_tensors()}

    def _restore_where(self, found_inf: torch.Tensor, before: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Undo the step where ``found_inf``: old values back; state the step created
        goes back to zero (``step`` counters to 0, buffers to empty)."""
        for t in self._state_tensors():
            skip = found_inf.to(t.device)
            old = before.get(id(t))
            previous = old[1] if old is not None else torch.zeros_like(t)
            t.copy_(torch.where(skip, previous, t))

    def _widen_for_sr(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Give every bf16 shard and bf16 state tensor fp32 data for the step; returns
        (tensor, its bf16 storage) pairs to round back into."""
        widened = []
        for t in self._state_tensors():
            if t.dtype == torch.bfloat16 and t.dim() > 0:
                widened.append((t, t.data))
                t.data = t.data.float()
        return widened

    def _round_after_sr(self, widened: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for t, storage in widened:
            storage.copy_(stochastic_round(t.data, generator=self._sr_generator))
            t.data = storage

    def _sync_hyperparameters(self) -> None:
        """The wrapper's param_groups are the truth (LR schedulers act on them)."""
        _copy_group_settings(self.param_groups, self._inner.param_groups)

    def _sync_hyperparameters_back(self) -> None:
        """What the inner step added or changed in its param groups shows on the wrapper
        (torch's and torch_xla's ZeRO do the same)."""
        _copy_group_settings(self._inner.param_groups, self.param_groups)

    def _reduce_gradients(self) -> list[torch.Tensor]:
        """Per bucket, this rank's shard of the summed gradient, in the shard dtype."""
        flats = []
        for b, layout in enumerate(self._layouts):
            wire = self._wire_dtype(self._managed[layout.param_indices[0]].dtype)
            if self._main_grads is not None:
                flat = self._main_grads.flat(b)
                flats.append(flat if flat.dtype == wire else flat.to(wire))
            else:
                flats.append(flatten_grads(self._managed, layout, wire))
        grads = []
        for b, shard in enumerate(self._comm.reduce_scatter(flats)):
            dtype = self._masters[b].dtype
            if shard.dtype != dtype:
                if self._main_grads is not None and self._main_grads.contiguous and self._main_grads.dtype == dtype:
                    target = self._comm.shard(self._main_grads.buffers[b])  # reuse its memory
                    shard = target.copy_(shard)
                else:
                    shard = shard.to(dtype)
            grads.append(shard)
        return grads

    def _global_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """L2 norm of the mean gradient over the whole model, fp32, as a tensor."""
        compiled = self._compiled is not None and self._compiled.enabled  # compiling works here
        replicated, split = (
            [grads[b] for b in self._norm_buckets[role]] for role in ("replicated", "split")
        )
        norm = global_norm(
            sum_of_squares(replicated, self._device, compiled),
            sum_of_squares(split, self._device, compiled) if split else None,
            tensor_parallel=self._norm_comms,
            data_parallel=self._comm,
            pipeline_parallel=self._pipeline_comms,
        )
        if self._comm.world_size > 1:
            norm = norm / self._comm.world_size  # the shards hold sums over DP, not means
        return norm

    def _grad_coefficient(self, norm: torch.Tensor) -> torch.Tensor | float | None:
        """What the summed shard gradients are multiplied by: clip coefficient /
        world_size (None: 1)."""
        coef: torch.Tensor | float | None = clip_coefficient(norm, self._grad_clipping, self._max_norm)
        if self._comm.world_size > 1:
            coef = 1.0 / self._comm.world_size if coef is None else coef / self._comm.world_size
        return coef

    def _apply_coefficient(self, grads: list[torch.Tensor], coef: torch.Tensor | float | None) -> None:
        if self._fused:
            # The fused kernels divide by ``grad_scale`` while they read the gradient:
            # no extra pass over it.
            if coef is None:
                self._inner.grad_scale = None
            else:
                self._inner.grad_scale = torch.as_tensor(
                    coef, dtype=torch.float32, device=self._device
                ).reciprocal()
        elif coef is not None:
            torch._foreach_mul_(grads, coef)

    def _publish_params(self) -> None:
        """Cast each master shard to the parameter dtype and all-gather it into the
        parameters."""
        if not self._views:
            values = [
                m if m.dtype == self._managed[layout.param_indices[0]].dtype
                else m.to(self._managed[layout.param_indices[0]].dtype)
                for layout, m in zip(self._layouts, self._masters)
            ]
            self._copy_into_params(self._comm.all_gather(values))
            return
        if not self._masters_alias_params:
            for flat, master in zip(self._flat_params, self._masters):
                self._comm.shard(flat).copy_(master)
        self._gather_params()

    def _gather_params(self) -> None:
        """All-gather the flat parameter buffers (eager devices: the parameters are views
        into them) from this rank's shard."""
        self._comm.all_gather([self._comm.shard(flat) for flat in self._flat_params], self._flat_params)

    def _copy_into_params(self, buckets: list[torch.Tensor]) -> None:
        """Each parameter from its range of the gathered flat buckets (XLA)."""
        targets, sources = [], []
        for layout, flat in zip(self._layouts, buckets):
            for i, index in enumerate(layout.param_indices):
                start, end = layout.param_range(i)
                targets.append(self._managed[index])
                sources.append(flat[start:end].view(self._managed[index].shape))
        torch._foreach_copy_(targets, sources)

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
                "numels": list(layout.numels),
                "padded_numel": layout.padded_numel,
            }
            for layout in self._layouts
        ]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: inner optimizer state over its shards, hyperparameters,
        the layout it was written with, and the master shards if
        ``use_master_weights_in_ckpt``. Load it at the same DP size and rank; to
        change the DP size use ``nxd_smp.checkpoint``. Parameters changed in place since
        the last step are taken up first, so the master weights match the model."""
        self._require_initialized()
        self.adopt_param_changes()
        groups = []
        start = 0
        for group in self.param_groups:
            n = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        state = {
            "format": "nxd_smp.zero1.rank_local/1",
            "world_size": self._comm.world_size,
            "rank": self._comm.rank,
            "mixed_precision": self._mp.to_dict(),
            "layout": self._layout_signature(),
            "param_groups": groups,
            "inner": self._inner.state_dict(),
        }
        if self._mp.use_master_weights_in_ckpt:
            state["master_weights"] = [m.detach().clone() for m in self._masters]
        if self._scaler is not None:
            state["loss_scaler"] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what ``state_dict()`` returned on the same rank at the same DP size.

        With master weights in it, the parameters become ``master.to(param dtype)``.
        Without them, the master weights stay those of the current parameters, and the
        model's weights loaded before or after this call are taken up at the next
        ``step()`` (precision below the parameter dtype is lost; a warning says so when
        the state comes from training). Everything is checked before anything changes.
        """
        self._require_initialized()
        if not isinstance(state_dict, dict) or state_dict.get("format") != "nxd_smp.zero1.rank_local/1":
            raise ValueError(
                "not a Zero1Optimizer state dict (missing format 'nxd_smp.zero1.rank_local/1'); "
                "pass what Zero1Optimizer.state_dict() returned."
            )
        problems = []
        for key, mine in (("world_size", self._comm.world_size), ("rank", self._comm.rank)):
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
            if len(masters) != len(self._masters) or any(
                tuple(a.shape) != tuple(b.shape) for a, b in zip(masters, self._masters)
            ):
                problems.append("master weight shard shapes")
        if problems:
            raise ValueError(
                "this state dict does not fit the optimizer: " + "; ".join(problems) + ". "
                "Rank-local state dicts load only into the same model, DP size and rank; "
                "use nxd_smp.checkpoint to change the DP size."
            )
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
            self.load_master_shards(masters)
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
    ``Zero1Optimizer``.

    ``optimizer_dtype`` is the master/state dtype (None, fp32 or fp64: fp32 masters;
    bf16/fp16: none); ``use_grad_acc_hook`` turns on fp32 gradient accumulation;
    ``higher_cc_precision`` reduces gradients in the master dtype instead of the
    parameter dtype; ``save_master_weights`` puts master weights in the state dict;
    ``max_norm=None`` means 1.0; ``sharding_groups`` / ``grad_norm_groups`` are replica
    groups (XLA) or process groups. The bucket caps are MB per collective as in
    torch_xla (0: one collective per parameter). ``zero_grad`` keeps gradients
    allocated by default, as torch_xla does. Beyond torch_xla's signature, the keyword
    ``pipeline_groups`` spans the norm over pipeline stages (NxD does that through its
    parallel state).
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
        if optimizer_dtype is torch.float64:
            warnings.warn("optimizer_dtype=torch.float64: nxd_smp keeps fp32 master weights.", stacklevel=2)
        for name, value in (("save_master_weights", save_master_weights),
                            ("use_grad_acc_hook", use_grad_acc_hook),
                            ("higher_cc_precision", higher_cc_precision)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name} must be True or False, got {value!r}.")
        if save_master_weights and not use_master_weights:
            raise ConfigError(
                f"save_master_weights=True needs fp32 master weights, but optimizer_dtype="
                f"{optimizer_dtype} keeps none; use optimizer_dtype=torch.float32."
            )
        self._higher_cc_precision = higher_cc_precision
        mixed_precision = MixedPrecisionConfig(
            use_master_weights=use_master_weights,
            use_fp32_grad_acc=use_grad_acc_hook,
            use_master_weights_in_ckpt=save_master_weights,
        )
        super().__init__(
            params,
            optimizer_class,
            mixed_precision=mixed_precision,
            grad_clipping=grad_clipping,
            max_norm=1.0 if max_norm is None else max_norm,
            process_group=sharding_groups,
            bucket_cap_mb=_torch_xla_bucket_cap(bucket_cap_mb_reduce_scatter, bucket_cap_mb_all_gather),
            grad_norm_groups=grad_norm_groups,
            pipeline_groups=pipeline_groups,
            pin_layout=pin_layout,
            lazy_init=lazy_init,
            **defaults,
        )

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


# NxD's trainer API lived here before it got a room of its own (``trainer``, which imports
# this module); resolved on first use so that importing this module stays free of circles.
_MOVED = {"initialize_parallel_optimizer": ".trainer", "ClippedOptimizer": ".trainer"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name], __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
