"""The parameters an optimizer is given and the inner optimizer it builds: param groups
normalised and checked, the inner optimizer class and its hyperparameters checked (NxD's
``**AdamW.defaults`` taken as NxD takes them), its kernel chosen, param groups numbered the way
torch.optim state dicts number them, NxD's ``sequence_parallel_enabled`` mark."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import ConfigError

SUPPORTED_PARAM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Inner optimizers whose update of an element depends on other elements (factored or
# orthogonalised updates, line searches, sparse gradients): sharding changes their result.
_NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "SparseAdam", "Muon")


def normalize_param_groups(params: Any) -> list[dict[str, Any]]:
    """Normalise ``params`` (tensors, ``(name, tensor)`` pairs as ``model.named_parameters()`` gives
    them, or dicts of groups of either) into a list of group dicts; named parameters' names go into
    the group's ``param_names``, as torch.optim keeps them (TorchTitan's checkpoints key the state by
    them). Every group is named or none is, as torch requires."""
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params must be an iterable of tensors or of param-group dicts, got a single "
            "Tensor; pass [tensor] or model.parameters()."
        )
    groups = list(params)
    if not groups:
        raise ConfigError("Zero1Optimizer got an empty parameter list; pass model.parameters().")
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
        names = [p[0] for p in tensors if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)]
        if names:
            if len(names) != len(tensors) or "param_names" in group:
                raise TypeError(f"param group {i} mixes named (name, tensor) pairs with other entries; name every "
                                f"parameter of a group or none, as torch.optim requires.")
            tensors = [p[1] for p in tensors]
            group = {**group, "param_names": names}
        for p in tensors:
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"param group {i} holds a {type(p).__name__}, not a Tensor; "
                    f"pass parameters (e.g. model.parameters())."
                )
        normalised.append({**group, "params": tensors})
    if len({"param_names" in group for group in normalised}) > 1:
        raise TypeError("some param groups are named ((name, tensor) pairs) and some are not; name all or none, as "
                        "torch.optim requires.")
    return normalised


def managed_params(groups: list[dict[str, Any]]) -> tuple[list[torch.Tensor], torch.device]:
    """Validate the managed parameters; return them in layout order and their device."""
    seen: dict[int, int] = {}
    managed: list[torch.Tensor] = []
    for gi, group in enumerate(groups):
        for p in group["params"]:
            if id(p) in seen:
                raise ConfigError(
                    f"a parameter of shape {tuple(p.shape)} is listed twice (param groups "
                    f"{seen[id(p)]} and {gi}); list each parameter once."
                )
            seen[id(p)] = gi
            if not p.requires_grad:
                continue
            if not p.is_leaf:
                raise ConfigError(
                    f"a parameter of shape {tuple(p.shape)} is not a leaf tensor; the "
                    f"optimizer can only update leaves (e.g. nn.Parameter)."
                )
            if p.dtype not in SUPPORTED_PARAM_DTYPES:
                raise ConfigError(
                    f"a parameter of shape {tuple(p.shape)} has dtype {p.dtype}; Zero1Optimizer "
                    f"supports {[str(d) for d in SUPPORTED_PARAM_DTYPES]}. Cast the model, e.g. "
                    f"model.to(torch.bfloat16), or freeze that parameter."
                )
            if p.is_sparse:
                raise ConfigError("sparse parameters are not supported; use dense parameters.")
            managed.append(p)
    if not managed:
        raise ConfigError(
            "Zero1Optimizer got no trainable parameters (all have requires_grad=False)."
        )
    devices = sorted({str(p.device) for p in managed})
    if len(devices) > 1:
        raise ConfigError(
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
            raise ConfigError(
                f"{optimizer_class.__name__} is not element-wise (its update of one element "
                f"depends on others), so sharding it would change its result. Use an "
                f"element-wise optimizer such as AdamW, Adam or SGD."
            )


#: The kernel options of torch.optim: at the class's own default they choose nothing.
KERNEL_OPTIONS = ("fused", "foreach", "capturable", "differentiable")
#: A hyperparameter NxD drops when the class does not take it: torch 2.9's ``Adam.defaults``
#: and ``AdamW.defaults`` hold it, and ``AdamW(...)`` rejects it.
_DROPPED_WHEN_UNKNOWN = ("decoupled_weight_decay",)


def _signature_defaults(optimizer_class: type) -> tuple[dict[str, Any], bool]:
    """``optimizer_class.__init__``'s keyword defaults, and whether it takes ``**kwargs``."""
    try:
        parameters = inspect.signature(optimizer_class.__init__).parameters.values()
    except (TypeError, ValueError):
        return {}, True
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return defaults, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def inner_hyperparameters(optimizer_class: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments ``optimizer_class`` is built with, from ``defaults`` as NxD's
    callers pass them (NxD Training passes ``**torch_optimizer.defaults``):

    * ``decoupled_weight_decay`` is dropped where the class does not take it, as NxD drops it;
      nothing else is dropped (a misspelt name stays the class's error);
    * a kernel option (``fused``, ``foreach``, ``capturable``, ``differentiable``) at the
      class's own default is left out: it chooses nothing, so nxd_smp may still choose (the
      fused kernel, the compiled CPU update).
    """
    own, takes_any = _signature_defaults(optimizer_class)
    out = {}
    for key, value in defaults.items():
        if key in _DROPPED_WHEN_UNKNOWN and key not in own and not takes_any:
            continue
        if key in KERNEL_OPTIONS and key in own and value is own[key]:
            continue
        out[key] = value
    return out


def group_kernel_choices(optimizer_class: type, groups: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], set[str]]:
    """``groups`` without the kernel options they hold at the class's own default (optimum-neuron
    builds from a torch optimizer's ``param_groups``, which carry every one), and the kernel
    options some group chose (a value other than the default): those are kept, and respected."""
    own, _ = _signature_defaults(optimizer_class)
    chosen: set[str] = set()
    out = []
    for group in groups:
        kept = {}
        for key, value in group.items():
            if key in KERNEL_OPTIONS and key in own and value is own[key]:
                continue
            if key in KERNEL_OPTIONS:
                chosen.add(key)
            kept[key] = value
        out.append(kept)
    return out, chosen


@dataclass(frozen=True)
class InnerSettings:
    """How the inner optimizer is built over the shards.

    Attributes:
        kwargs: its keyword arguments: the caller's hyperparameters, plus the fused kernel where
            nxd_smp chose it, plus ``capturable`` where a skipped fp16 step must be undone on the
            device.
        group_defaults: every hyperparameter its param groups hold, the class defaults included
            (the wrapper's groups show them before the shards exist; LR schedulers read them).
        may_compile: the compiled one-pass CPU update may stand in for its step.
    """

    kwargs: dict[str, Any]
    group_defaults: dict[str, Any]
    may_compile: bool


def inner_settings(
    optimizer_class: type, defaults: dict[str, Any], *, kernel_chosen: bool, has_fused_kernels: bool,
    fp32_shards: bool, step_counter_on_device: bool, compile_update: bool | None, device: Any,
) -> InnerSettings:
    """The inner optimizer's settings from the caller's ``defaults`` (``inner_hyperparameters``).

    The fused kernel is asked for on fp32 shards (``fp32_shards``, the precision plan's), where the
    device has one (CPU, CUDA) and the caller chose no variant, here or in a param group
    (``kernel_chosen``): the inner optimizer sees a few large flat tensors, where the fused kernel is
    the fastest and allocates no temporaries; low-precision shards keep the stock path, so legacy
    mode rounds exactly as the stock optimizer. The compiled one-pass update may stand in for the
    fused kernel nxd_smp chose itself (``compile_update`` None: where the shards are large enough,
    ``CompiledAdamW.where_it_applies``), or always (True), or never (False).
    Building a throwaway instance validates the hyperparameters now.

    Raises:
        TypeError, ValueError: the class refuses the hyperparameters (its own error).
    """
    chosen = inner_hyperparameters(optimizer_class, defaults)
    kwargs = dict(chosen)
    try:
        accepted = inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    if step_counter_on_device and "capturable" not in kwargs and "capturable" in accepted:
        kwargs["capturable"] = True  # a skipped step is undone inside the step's graph
    if not kernel_chosen and not set(KERNEL_OPTIONS) & set(kwargs) and "fused" in accepted and fp32_shards \
            and has_fused_kernels:
        kwargs["fused"] = True
    may_compile = compile_update is True or bool(compile_update is None and kwargs.get("fused")
                                                 and "fused" not in chosen and not kernel_chosen)
    probe = optimizer_class([torch.zeros(1, device=device)], **kwargs)
    group_defaults = {k: v for k, v in probe.param_groups[0].items() if k != "params"}
    return InnerSettings(kwargs, group_defaults, may_compile)


def index_groups(sizes: Sequence[int]) -> list[list[int]]:
    """Consecutive indices for param groups of ``sizes`` parameters: ``[2, 3]`` ->
    ``[[0, 1], [2, 3, 4]]``, how torch.optim state dicts (and torch_xla's, NxD's) name the
    parameters of each group."""
    out, start = [], 0
    for n in sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


def sequence_parallel_marked(param: torch.Tensor) -> bool:
    """Whether NxD marked ``param`` ``sequence_parallel_enabled`` (its LayerNorm/RMSNorm weights
    and some biases under sequence parallelism): each tensor-parallel rank's gradient is then a
    partial sum over its part of the sequence, to be summed over the tensor-parallel group."""
    return bool(getattr(param, "sequence_parallel_enabled", False))


def check_sequence_parallel(params: Sequence[torch.Tensor], *, tensor_parallel_known: bool, owner: str) -> bool:
    """Whether ``params`` hold parameters marked ``sequence_parallel_enabled`` (whose gradients
    ``owner`` then sums over the tensor-parallel group).

    Raises:
        ConfigError: some are marked and no tensor-parallel group is known, so their sum would
            be left undone.
    """
    marked = sum(sequence_parallel_marked(p) for p in params)
    if marked and not tensor_parallel_known:
        raise ConfigError(
            f"{owner}: sequence parallelism is on and {marked} parameters are marked sequence_parallel_enabled, "
            f"but no tensor-parallel group is known to sum their gradients over. Pass grad_norm_groups=<the "
            f"tensor-parallel groups> (NxD's get_tensor_model_parallel_replica_groups()), or initialise NxD's "
            f"parallel state."
        )
    return marked > 0
