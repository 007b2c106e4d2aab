"""DTensor parameters (torch's tensor parallelism, ``parallelize_module`` over a ``DeviceMesh``):
what the optimizer manages of them, in one place.

A DTensor parameter is managed through its local part (``local_tensor``): that plain tensor is
what the flat buffers hold and the all-gather fills, so the DTensor itself keeps working for the
model. Its gradient is taken in the parameter's own placements and then as the local part
(``local_grad``): a ``Partial`` gradient is reduced first, as torch's optimizers would see it
after ``redistribute``. A parameter sharded on some mesh dimension (``Shard``) is a part of a
larger tensor (``is_split``): its squares add up over the tensor-parallel group in the global
norm, where a replicated one counts once.

Everything here is plain arithmetic on torch's public DTensor API; without torch.distributed
every tensor is plain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .errors import ConfigError

try:  # torch.distributed is optional in some builds
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - builds without torch.distributed
    DeviceMesh = DTensor = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (a DTensor parameter included)."""
    return DTensor is not None and isinstance(tensor, DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding this rank's part of ``tensor`` (``tensor`` itself when plain). For a
    DTensor parameter it is the tensor its ``to_local()`` returns: writing it writes the parameter."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor


def local_shape(tensor: torch.Tensor) -> torch.Size:
    """The shape of this rank's part of ``tensor``."""
    return local_tensor(tensor).shape


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` of ``param`` as the plain tensor of this rank's part: a DTensor gradient is first put
    in the parameter's placements (a ``Partial`` one is reduced over its mesh)."""
    if not is_dtensor(grad):
        return grad
    if is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()


def is_split(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor sharded on some mesh dimension: a part of a larger tensor."""
    return is_dtensor(param) and any(p.is_shard() for p in param.placements)


def param_mesh(params: Sequence[torch.Tensor]) -> Any:
    """The one ``DeviceMesh`` of the DTensor parameters among ``params`` (None when there are none).

    Raises:
        ValueError: DTensor parameters on several meshes, or placements that are neither ``Shard``
            nor ``Replicate`` (a parameter cannot be ``Partial``).
    """
    meshes = []
    for p in params:
        if not is_dtensor(p):
            continue
        if any(not (placement.is_shard() or placement.is_replicate()) for placement in p.placements):
            raise ConfigError(
                f"a DTensor parameter of shape {tuple(p.shape)} has placements {tuple(p.placements)}; a parameter "
                f"must be Shard or Replicate on each mesh dimension (as parallelize_module leaves them)."
            )
        if not any(p.device_mesh == m for m in meshes):
            meshes.append(p.device_mesh)
    if len(meshes) > 1:
        raise ConfigError(
            f"the DTensor parameters live on {len(meshes)} different device meshes ({meshes}); nxd_smp shards one "
            f"tensor-parallel mesh over data parallelism. Parallelize the whole model over one mesh (e.g. "
            f"mesh['tp']) and pass the data-parallel dimension as device_mesh=mesh."
        )
    return meshes[0] if meshes else None


def local_state_dict(module: torch.nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with every DTensor as this rank's part (``local_tensor``)."""
    return {key: local_tensor(value) if isinstance(value, torch.Tensor) else value
            for key, value in module.state_dict().items()}


def like_live(value: torch.Tensor, live: Any) -> torch.Tensor:
    """``value``, this rank's part of a tensor, as ``live`` holds it: a DTensor of ``live``'s mesh and
    placements when ``live`` is one (what ``load_state_dict`` copies into it), else ``value``."""
    if not is_dtensor(live):
        return value
    return DTensor.from_local(value, live.device_mesh, live.placements, run_check=False, shape=live.shape,
                              stride=live.stride())


def tensor_parallel_layout(module: torch.nn.Module) -> dict[str, Any] | None:
    """Where this rank's parts of ``module``'s DTensor state sit in the whole tensors: ``{"size": the mesh's
    size, "rank": this rank's place on it, "split": {state key: the dimension it is sharded on}}``, for the
    one-dimensional tensor-parallel mesh; None when ``module`` holds no DTensor."""
    state = module.state_dict()
    mesh = param_mesh([v for v in state.values() if isinstance(v, torch.Tensor)])
    if mesh is None:
        return None
    if mesh.ndim != 1:
        raise ConfigError(f"the model's DTensors live on a {mesh.ndim}-dimensional mesh; nxd_smp checkpoints a model "
                         f"parallelized over one tensor-parallel dimension.")
    split = {}
    for key, value in state.items():
        if is_dtensor(value) and value.placements[0].is_shard():
            split[key] = value.placements[0].dim % value.dim()
    return {"size": mesh.size(), "rank": mesh.get_local_rank(), "split": split}


def fully_sharded(params: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``params`` belongs to a module FSDP2 (``fully_shard``) manages, whatever it holds now:
    its sharded DTensors, or the plain unsharded parameters a root module keeps after a forward (which no
    parameter shows). Read from torch's registry of composable module states."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - a torch without FSDP2
        return False
    wanted = {id(p) for p in params}
    return any(isinstance(module, FSDPModule) and any(id(p) in wanted for p in module.parameters())
               for module in list(_module_state_mapping))


def global_offset(tensor: torch.Tensor) -> tuple[int, ...]:
    """Where this rank's part of ``tensor`` starts in the whole tensor (zeros for a plain tensor)."""
    if not is_dtensor(tensor):
        return tuple(0 for _ in tensor.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(int(o) for o in offset)
