"""Configuration: what mixed precision and ZeRO-1 mean for one training run.

Two frozen dataclasses hold the validated settings, and ``from_dict`` builds them from
NxD's (possibly partial) dicts with NxD's rule: missing mixed-precision flags follow
``zero_one_enabled``. Every rule lives here, once. This module is the config layer: it imports
only ``ConfigError`` from the core, reads no environment variable and knows no tensor. The
environment checks live in ``nxd_smp.core.environment``, NxD's ``neuronx_distributed_config``
in ``nxd_smp.interop.nxd``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from .core.errors import ConfigError

__all__ = ["ConfigError", "MixedPrecisionConfig", "OptimizerConfig", "Zero1Config"]


def require_bool(owner: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool.

    Raises:
        ConfigError: naming ``owner.name``.
    """
    if not isinstance(value, bool):
        raise ConfigError(
            f"{owner}.{name} must be True or False, got {value!r} "
            f"({type(value).__name__}); pass a bool."
        )
    return value


def _reject_unknown_keys(owner: str, given: Mapping[str, Any], known: tuple[str, ...]) -> None:
    if not isinstance(given, Mapping):
        raise ConfigError(
            f"{owner} must be a dict (or None for the defaults), got {type(given).__name__}."
        )
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise ConfigError(
            f"{owner} has unknown key(s) {unknown}; the accepted keys are {list(known)}."
        )


def validate_max_norm(value: Any, field: str) -> float:
    """A clipping threshold: a positive real number (not bool, not NaN); ``inf`` never clips.

    Raises:
        ConfigError: naming ``field``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ConfigError(
            f"{field} must be a positive number, got {value!r}; use e.g. 1.0, or "
            f"float('inf') to measure the norm without clipping."
        )
    return float(value)


@dataclass(frozen=True)
class MixedPrecisionConfig:
    """Standard mixed precision settings; the defaults are SMP on.

    Attributes:
        use_master_weights: keep an fp32 master copy of the parameters (sharded with
            the optimizer states, which are then fp32 too). Off: the optimizer updates
            the parameter-dtype shard itself.
        use_fp32_grad_acc: accumulate gradients over micro-batches in an fp32
            ``main_grad`` buffer and reduce them in fp32 by default. Off: autograd's
            ``.grad`` in the parameter dtype.
        use_master_weights_in_ckpt: write the master weights into checkpoints.
            Requires ``use_master_weights``.
        use_sharded_grad_acc: (nxd_smp's, memory) accumulate only this rank's shard of the
            fp32 gradient: each bucket is reduce-scattered as soon as backward completes it,
            every micro-batch, and added into the shard; no full-size fp32 buffer. Requires
            ``use_fp32_grad_acc``.
        use_param_remainders: (nxd_smp's, memory) keep each fp32 master as the bf16 parameter
            plus a 16-bit remainder of this rank's shard (2 bytes per parameter sharded
            instead of 4); parameters then round to nearest with ties away from zero.
            Requires ``use_master_weights`` and bf16 parameters.
    """

    use_master_weights: bool = True
    use_fp32_grad_acc: bool = True
    use_master_weights_in_ckpt: bool = False
    use_sharded_grad_acc: bool = False
    use_param_remainders: bool = False

    _NXD_FIELDS = ("use_master_weights", "use_fp32_grad_acc", "use_master_weights_in_ckpt")
    _FIELDS = _NXD_FIELDS + ("use_sharded_grad_acc", "use_param_remainders")

    def __post_init__(self) -> None:
        for name in self._FIELDS:
            require_bool("mixed_precision_config", name, getattr(self, name))
        for name, needs, why in self._REQUIRES:
            if getattr(self, name) and not getattr(self, needs):
                raise ConfigError(
                    f"mixed_precision_config.{name}=True needs {needs}=True ({why}). "
                    f"Set {needs}=True or {name}=False."
                )

    #: (flag, the flag it needs, why)
    _REQUIRES = (
        ("use_master_weights_in_ckpt", "use_master_weights", "there are no master weights to save"),
        ("use_param_remainders", "use_master_weights", "the remainders are the low half of fp32 master weights"),
        ("use_sharded_grad_acc", "use_fp32_grad_acc", "it shards the fp32 gradient accumulation"),
    )

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any] | None, *, zero_one_enabled: bool
    ) -> "MixedPrecisionConfig":
        """Build from an NxD ``mixed_precision_config`` dict, NxD's way.

        Missing keys (or ``d=None``) default to ``zero_one_enabled`` for
        ``use_master_weights`` and ``use_fp32_grad_acc`` and to False for the others. ``d``
        is not modified.

        Raises:
            ConfigError: unknown keys, non-bool values, an SMP flag without ZeRO-1,
                or master weights in checkpoints without master weights.
        """
        require_bool("optimizer_config", "zero_one_enabled", zero_one_enabled)
        d = {} if d is None else d
        _reject_unknown_keys("mixed_precision_config", d, cls._FIELDS)
        values = {
            "use_master_weights": d.get("use_master_weights", zero_one_enabled),
            "use_fp32_grad_acc": d.get("use_fp32_grad_acc", zero_one_enabled),
            "use_master_weights_in_ckpt": d.get("use_master_weights_in_ckpt", False),
            "use_sharded_grad_acc": d.get("use_sharded_grad_acc", False),
            "use_param_remainders": d.get("use_param_remainders", False),
        }
        for name, value in values.items():
            require_bool("mixed_precision_config", name, value)
        if not zero_one_enabled:
            # NxD's own refusals, word for word where it has them.
            if values["use_master_weights"]:
                raise ConfigError(
                    "ZeRO-1 optimizer is not enabled, while use_master_weights is True. "
                    "Set optimizer_config['zero_one_enabled']=True or "
                    "mixed_precision_config['use_master_weights']=False."
                )
            for name in ("use_fp32_grad_acc", "use_master_weights_in_ckpt", "use_sharded_grad_acc",
                         "use_param_remainders"):
                if values[name]:
                    raise ConfigError(
                        f"Non Zero-1 optimizer does not support {name}. Set "
                        f"optimizer_config['zero_one_enabled']=True or "
                        f"mixed_precision_config['{name}']=False."
                    )
        return cls(**values)

    def to_dict(self) -> dict[str, bool]:
        """NxD's three keys, and nxd_smp's own only where they are on (so NxD's dicts keep
        NxD's shape)."""
        return {k: v for k, v in asdict(self).items() if k in self._NXD_FIELDS or v}


@dataclass(frozen=True)
class OptimizerConfig:
    """NxD's ``optimizer_config``.

    Attributes:
        zero_one_enabled: shard the optimizer (ZeRO-1) over the data-parallel group.
        grad_clipping: clip the global gradient norm at ``max_grad_norm``.
        max_grad_norm: a positive real number; ``inf`` measures the norm but never clips.
            None only with ``grad_clipping=False`` (NxD Training's ``gradient_clip_val: null``
            gives ``{"grad_clipping": False, "max_grad_norm": None}``).
    """

    zero_one_enabled: bool = False
    grad_clipping: bool = True
    max_grad_norm: float | None = 1.0

    _FIELDS = ("zero_one_enabled", "grad_clipping", "max_grad_norm")
    # How errors name the fields: NxD's dict keys here, the optimizer's arguments in Zero1Config.
    _OWNER = "optimizer_config"
    _MAX_NORM_NAME = "optimizer_config.max_grad_norm"

    def __post_init__(self) -> None:
        require_bool(self._OWNER, "zero_one_enabled", self.zero_one_enabled)
        require_bool(self._OWNER, "grad_clipping", self.grad_clipping)
        if self.max_grad_norm is None and not self.grad_clipping:
            return  # nothing is clipped, so there is no threshold
        if self.max_grad_norm is None:
            raise ConfigError(
                f"{self._MAX_NORM_NAME} is None while grad_clipping=True: clipping needs a threshold. "
                f"Pass a positive number (e.g. 1.0), or grad_clipping=False."
            )
        object.__setattr__(self, "max_grad_norm", validate_max_norm(self.max_grad_norm, self._MAX_NORM_NAME))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "OptimizerConfig":
        """Build from an NxD ``optimizer_config`` dict; missing keys take NxD's defaults."""
        d = {} if d is None else d
        _reject_unknown_keys("optimizer_config", d, cls._FIELDS)
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: The dtypes a gradient may be reduced in by name, as torch_xla chooses: its parameter dtype, or the
#: master dtype (``higher_cc_precision``).
REDUCE_AS = ("param", "master")


#: How the data-parallel ranks' gradients combine (``Zero1Config.grad_reduction``).
GRAD_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class Zero1Config(OptimizerConfig):
    """Everything that configures one ``Zero1Optimizer``, validated once: NxD's
    ``optimizer_config`` (ZeRO-1 on) plus the mixed precision and the sharding options.

    Attributes:
        mixed_precision: a ``MixedPrecisionConfig`` (None: SMP on).
        reduce_dtype: a floating torch dtype for the gradient reduce-scatter; None (the
            accumulation dtype: fp32 with fp32 accumulation, else the parameter dtype); or, as
            torch_xla chooses it, ``"param"`` (each bucket in its parameter dtype) or ``"master"``
            (in the master dtype: torch_xla's ``higher_cc_precision``).
        bucket_cap_mb: the largest bucket in MiB of fp32 elements (0: a bucket per
            parameter, ``inf``: one per param group and dtype), or None (the device's default).
        pin_layout: passed to torch_xla's collectives.
        lazy_init: build the shards at ``init_zero()`` rather than in the constructor.
        compile_update: the compiled one-pass CPU update: None (where nxd_smp picked the
            fused kernel itself and the rank's shards hold at least 1M elements, or with parameter
            remainders), True (required) or False.
        stochastic_rounding: round the bf16 update stochastically (legacy mode only).
        sr_seed: the seed of those draws (an int).
        grad_reduction: how the ranks' gradients combine: ``"mean"`` (divided by the data-parallel
            size, times the context-parallel size outside it: NxD's and DDP's convention) or
            ``"sum"`` (a per-token loss already normalised by the global token count: TorchTitan's,
            Megatron's ``calculate_per_token_loss``). The norm and the clip see the combined gradient.
    """

    zero_one_enabled: bool = True
    mixed_precision: MixedPrecisionConfig | None = None
    reduce_dtype: Any = None
    bucket_cap_mb: float | None = None
    pin_layout: bool = True
    lazy_init: bool = False
    compile_update: bool | None = None
    stochastic_rounding: bool = False
    sr_seed: int = 0
    grad_reduction: str = "mean"

    _OWNER = "Zero1Optimizer"
    _MAX_NORM_NAME = "max_norm"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.zero_one_enabled:
            raise ConfigError(
                "Zero1Config.zero_one_enabled must be True: it configures a ZeRO-1 optimizer. With "
                "ZeRO-1 off use initialize_parallel_optimizer, which builds a plain optimizer."
            )
        mp = MixedPrecisionConfig() if self.mixed_precision is None else self.mixed_precision
        if not isinstance(mp, MixedPrecisionConfig):
            raise TypeError(
                f"mixed_precision must be a MixedPrecisionConfig or None, got {type(mp).__name__}; "
                f"build one with MixedPrecisionConfig(...) or MixedPrecisionConfig.from_dict(d, "
                f"zero_one_enabled=True)."
            )
        object.__setattr__(self, "mixed_precision", mp)
        dtype = self.reduce_dtype
        if dtype is not None and dtype not in REDUCE_AS and (
                type(dtype).__name__ != "dtype" or getattr(dtype, "is_floating_point", None) is not True):
            raise ConfigError(f"reduce_dtype must be None, a floating torch.dtype, or one of {list(REDUCE_AS)}; got "
                              f"{dtype!r}.")
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap >= 0):
            raise ConfigError(
                f"bucket_cap_mb must be None or a number >= 0 (0: one bucket per parameter, inf: "
                f"no limit), got {cap!r}."
            )
        for name in ("pin_layout", "lazy_init", "stochastic_rounding"):
            require_bool(self._OWNER, name, getattr(self, name))
        if self.grad_reduction not in GRAD_REDUCTIONS:
            raise ConfigError(f"grad_reduction must be one of {list(GRAD_REDUCTIONS)}, got {self.grad_reduction!r}: "
                              f"'mean' when the loss is a per-rank mean (NxD, DDP), 'sum' when it is already "
                              f"normalised over every rank's tokens (TorchTitan, Megatron's calculate_per_token_loss).")
        if self.compile_update is not None:
            require_bool(self._OWNER, "compile_update", self.compile_update)
        if isinstance(self.sr_seed, bool) or not isinstance(self.sr_seed, int):
            raise ConfigError(f"sr_seed must be an int, got {self.sr_seed!r}.")
        if self.stochastic_rounding and mp.use_master_weights:
            raise ConfigError(
                "stochastic_rounding=True is for legacy mode (use_master_weights=False), where the "
                "bf16 shard itself is updated; with master weights the fp32 copy already keeps "
                "what rounding would lose. Turn one of them off."
            )

    @property
    def bucket_cap_numel(self) -> int | None:
        """``bucket_cap_mb`` in fp32 elements (at least 1), None for no limit; the bucket
        size must have been chosen (``bucket_cap_mb`` not None)."""
        if self.bucket_cap_mb is None:
            raise ConfigError("bucket_cap_mb is not chosen yet: replace(config, bucket_cap_mb=...) first.")
        cap = self.bucket_cap_mb * 2**20 / 4
        return None if math.isinf(cap) else max(1, int(cap))
