"""Configuration: what mixed precision and ZeRO-1 mean for one training run.

Two frozen dataclasses hold the validated settings; ``neuronx_distributed_config``
builds the NxD-shaped dict from (possibly partial) user dicts without mutating them.
Every rule lives here, once; nothing in this module touches tensors or devices.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "ConfigError",
    "MixedPrecisionConfig",
    "OptimizerConfig",
    "neuronx_distributed_config",
    "check_no_xla_downcast",
    "validate_max_norm",
]

#: Environment variables that make torch_xla store fp32 tensors as bf16 on the device.
XLA_DOWNCAST_VARIABLES = ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")

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


class ConfigError(ValueError):
    """A configuration value or combination that nxd_smp refuses; the message names the fix."""


def _require_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"{owner}.{name} must be True or False, got {value!r} "
            f"({type(value).__name__}); pass a bool."
        )


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


def check_no_xla_downcast(environ: Mapping[str, str] | None = None) -> None:
    """Refuse master weights when torch_xla would silently store fp32 tensors as bf16.

    ``XLA_USE_BF16`` and ``XLA_DOWNCAST_BF16`` make every fp32 tensor bf16 on the device,
    which turns the fp32 master copy into a bf16 one. This is the one place the
    environment is read; it is called when a config with master weights is built and
    again when the optimizer is built.

    Raises:
        ConfigError: naming the variable that is set and the fix.
    """
    env = os.environ if environ is None else environ
    for name in XLA_DOWNCAST_VARIABLES:
        value = env.get(name, "")
        if value.strip() not in ("", "0"):
            raise ConfigError(
                f"{name}={value!r} is set while use_master_weights=True: it makes torch_xla "
                f"store the fp32 master weights as bf16, which defeats them. Unset {name} "
                f"(or set it to 0) and cast the model instead with model.to(torch.bfloat16)."
            )


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
    """

    use_master_weights: bool = True
    use_fp32_grad_acc: bool = True
    use_master_weights_in_ckpt: bool = False

    _FIELDS = ("use_master_weights", "use_fp32_grad_acc", "use_master_weights_in_ckpt")

    def __post_init__(self) -> None:
        for name in self._FIELDS:
            _require_bool("mixed_precision_config", name, getattr(self, name))
        if self.use_master_weights_in_ckpt and not self.use_master_weights:
            raise ConfigError(
                "mixed_precision_config.use_master_weights_in_ckpt=True needs "
                "use_master_weights=True: there are no master weights to save. Set "
                "use_master_weights=True or use_master_weights_in_ckpt=False."
            )
        if self.use_master_weights:
            check_no_xla_downcast()

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any] | None, *, zero_one_enabled: bool
    ) -> "MixedPrecisionConfig":
        """Build from an NxD ``mixed_precision_config`` dict, NxD's way.

        Missing keys (or ``d=None``) default to ``zero_one_enabled`` for
        ``use_master_weights`` and ``use_fp32_grad_acc`` and to False for
        ``use_master_weights_in_ckpt``. ``d`` is not modified.

        Raises:
            ConfigError: unknown keys, non-bool values, an SMP flag without ZeRO-1,
                or master weights in checkpoints without master weights.
        """
        _require_bool("optimizer_config", "zero_one_enabled", zero_one_enabled)
        d = {} if d is None else d
        _reject_unknown_keys("mixed_precision_config", d, cls._FIELDS)
        values = {
            "use_master_weights": d.get("use_master_weights", zero_one_enabled),
            "use_fp32_grad_acc": d.get("use_fp32_grad_acc", zero_one_enabled),
            "use_master_weights_in_ckpt": d.get("use_master_weights_in_ckpt", False),
        }
        for name, value in values.items():
            _require_bool("mixed_precision_config", name, value)
        if not zero_one_enabled:
            # NxD's own refusals, word for word where it has them.
            if values["use_master_weights"]:
                raise ConfigError(
                    "ZeRO-1 optimizer is not enabled, while use_master_weights is True. "
                    "Set optimizer_config['zero_one_enabled']=True or "
                    "mixed_precision_config['use_master_weights']=False."
                )
            for name in ("use_fp32_grad_acc", "use_master_weights_in_ckpt"):
                if values[name]:
                    raise ConfigError(
                        f"Non Zero-1 optimizer does not support {name}. Set "
                        f"optimizer_config['zero_one_enabled']=True or "
                        f"mixed_precision_config['{name}']=False."
                    )
        return cls(**values)

    def to_dict(self) -> dict[str, bool]:
        return asdict(self)


@dataclass(frozen=True)
class OptimizerConfig:
    """NxD's ``optimizer_config``.

    Attributes:
        zero_one_enabled: shard the optimizer (ZeRO-1) over the data-parallel group.
        grad_clipping: clip the global gradient norm at ``max_grad_norm``.
        max_grad_norm: a positive real number; ``inf`` measures the norm but never clips.
    """

    zero_one_enabled: bool = False
    grad_clipping: bool = True
    max_grad_norm: float = 1.0

    _FIELDS = ("zero_one_enabled", "grad_clipping", "max_grad_norm")

    def __post_init__(self) -> None:
        _require_bool("optimizer_config", "zero_one_enabled", self.zero_one_enabled)
        _require_bool("optimizer_config", "grad_clipping", self.grad_clipping)
        object.__setattr__(
            self, "max_grad_norm", validate_max_norm(self.max_grad_norm, "optimizer_config.max_grad_norm")
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "OptimizerConfig":
        """Build from an NxD ``optimizer_config`` dict; missing keys take NxD's defaults."""
        d = {} if d is None else d
        _reject_unknown_keys("optimizer_config", d, cls._FIELDS)
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
        # SMP: the Neuron runtime must round to nearest. It reads this once at start-up.
        from .precision_ops import set_stochastic_rounding

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
