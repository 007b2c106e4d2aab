"""NxD's config dict: ``neuronx_distributed_config`` as NxD 2.29 builds it, validated and never
mutating its inputs, and the two configs nxd_smp interprets from such a dict."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from ...core.environment import check_master_weights_storage, set_stochastic_rounding
from ...core.errors import ConfigError
from ...mixed_precision_config import MixedPrecisionConfig, OptimizerConfig

PARALLEL_SIZE_KEYS = (
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


def sequence_parallel_on(nxd_config: Mapping[str, Any]) -> bool:
    value = nxd_config.get("sequence_parallel", False)
    if not isinstance(value, (bool, int)):
        raise ConfigError(f"nxd_config['sequence_parallel'] must be True or False (or an int), got {value!r}.")
    return bool(value)
