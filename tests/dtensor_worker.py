"""Rank functions for tests/integration/test_dtensor.py: torch's tensor parallelism (DTensor, ``parallelize_module``)
with ZeRO-1 over the mesh's ``dp`` dimension, and NxD's hand-split tensor parallelism beside it.

The mesh is ``(dp, tp)``: global rank ``2 * dp + tp`` for TP 2. Every rank of a data-parallel rank
trains on that rank's data.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from nxd_smp import Zero1Optimizer

IN, HIDDEN, OUT, BATCH = 8, 12, 6, 5
STEPS, MICRO, LR, MAX_NORM = 3, 2, 1e-2, 0.05
CAP_MB = 0.0002  # ~50 fp32 elements: several buckets


class TPNet(nn.Module):
    """``up`` column-parallel, ``down`` row-parallel (its bias a replicated DTensor), ``norm`` replicated
    (plain parameters)."""

    def __init__(self, down_bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, OUT, bias=down_bias)
        self.norm = nn.LayerNorm(OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.down(torch.tanh(self.up(x))))


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def full_model(seed: int = 0, down_bias: bool = True) -> TPNet:
    torch.manual_seed(seed)
    return TPNet(down_bias).to(torch.bfloat16)


def data(dp_rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dp_rank + 10 * step + micro)
    return torch.randn(BATCH, IN, generator=g).bfloat16(), torch.randn(BATCH, OUT, generator=g).bfloat16()


def fixed_grads(dp_rank: int, step: int, micro: int, model: nn.Module) -> dict[str, torch.Tensor]:
    """A bf16 gradient per parameter name, of the full (unsplit) shape."""
    g = torch.Generator().manual_seed(7 + 1000 * dp_rank + 10 * step + micro)
    return {n: (torch.randn(p.shape, generator=g) * 0.3).bfloat16() for n, p in model.named_parameters()}


def mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def fixed_grad_loss(model: nn.Module, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    """``sum(p * g)`` over this rank's part of every parameter: each parameter's gradient is exactly its
    part of ``g``."""
    total = 0.0
    for name, p in model.named_parameters():
        g = grads[name]
        if isinstance(p, DTensor):
            g = distribute_tensor(g, p.device_mesh, p.placements).to_local()
        total = total + (_local(p).float() * g.float()).sum()
    return total


def dtensor_oracle_rank(rank: int, world_size: int, how: str) -> dict:
    """TP 2 x DP 2 with ZeRO-1 on fixed gradients; the mesh passed as ``how`` says."""
    mesh = mesh_2x2()
    model = parallelize_module(full_model(), mesh["tp"], PLAN)
    kwargs = {"device_mesh": mesh} if how == "device_mesh" else {"process_group": mesh["dp"].get_group()}
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1, max_norm=MAX_NORM,
                         bucket_cap_mb=CAP_MB, **kwargs)
    dp = mesh["dp"].get_local_rank()
    reference = full_model()
    norms = []
    for step in range(STEPS):
        for micro in range(MICRO):
            fixed_grad_loss(model, fixed_grads(dp, step, micro, reference)).backward()
        opt.step()
        norms.append(float(opt.grad_norm))
    return {"params": {n: _full(p) for n, p in model.named_parameters()},
            "local": {n: _local(p).detach().clone() for n, p in model.named_parameters()},
            "masters": [m.clone() for m in opt.master_shards], "norms": norms,
            "tp_size": opt.tensor_parallel_size, "dp_size": opt.world_size}


def oracle(fixed: bool = True) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The unsharded fp32-master run of ``dtensor_oracle_rank``: per DP rank the fp32 sum over micro-batches,
    the mean over the 2 DP ranks, the global norm over the whole model, AdamW on fp32 copies."""
    model = full_model()
    masters = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    inner = torch.optim.AdamW(list(masters.values()), lr=LR, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        total = {n: torch.zeros(p.shape) for n, p in masters.items()}
        for dp in range(2):
            for micro in range(MICRO):
                for n, g in fixed_grads(dp, step, micro, model).items():
                    total[n] += g.float()
        grads = {n: t / 2 for n, t in total.items()}
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        for n, m in masters.items():
            m.grad = grads[n] * coef
        inner.step()
        norms.append(norm)
    return {n: m.bfloat16() for n, m in masters.items()}, norms


# ---------------------------------------------------------------- NxD's hand-split path beside DTensor
class _SumOverTP(torch.autograd.Function):
    """NxD's ``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class HandSplitNet(nn.Module):
    """``TPNet`` with NxD's layers written out: this TP rank's rows of ``up``, columns of ``down``,
    both marked ``tensor_model_parallel``; ``norm`` replicated. ``down`` has no bias: NxD's
    RowParallelLinear adds it after the sum over TP ranks, DTensor's RowwiseParallel adds half of it on
    each rank before, two bf16 forwards that round differently; the optimizers are what is compared."""

    def __init__(self, full: TPNet, tp: int, group) -> None:
        super().__init__()
        rows = slice(tp * HIDDEN // 2, (tp + 1) * HIDDEN // 2)
        self.group = group
        self.up_w = nn.Parameter(full.up.weight.detach()[rows].clone())
        self.up_b = nn.Parameter(full.up.bias.detach()[rows].clone())
        self.down_w = nn.Parameter(full.down.weight.detach()[:, rows].clone())
        self.norm = nn.LayerNorm(OUT).to(torch.bfloat16)
        self.norm.load_state_dict(full.norm.state_dict())
        for p in (self.up_w, self.up_b, self.down_w):
            p.tensor_model_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(nn.functional.linear(x, self.up_w, self.up_b))
        y = _SumOverTP.apply(nn.functional.linear(h, self.down_w), self.group)
        return self.norm(y)


def _train(model: nn.Module, opt: Zero1Optimizer, dp: int) -> None:
    for step in range(STEPS):
        for micro in range(MICRO):
            x, y = data(dp, step, micro)
            ((model(x).float() - y.float()) ** 2).mean().backward()
        opt.step()


def nxd_versus_dtensor_rank(rank: int, world_size: int) -> dict:
    """The same run, real forward and backward, on NxD's hand-split TP + ZeRO-1 and on DTensor TP + ZeRO-1."""
    mesh = mesh_2x2()
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    dtensor_model = parallelize_module(full_model(down_bias=False), mesh["tp"], PLAN)
    dtensor_opt = Zero1Optimizer(dtensor_model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1,
                                 max_norm=MAX_NORM, bucket_cap_mb=CAP_MB, device_mesh=mesh)
    _train(dtensor_model, dtensor_opt, dp)
    nxd_model = HandSplitNet(full_model(down_bias=False), tp, mesh["tp"].get_group())
    nxd_opt = Zero1Optimizer(nxd_model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1, max_norm=MAX_NORM,
                             bucket_cap_mb=CAP_MB, process_group=mesh["dp"].get_group(),
                             grad_norm_groups=mesh["tp"].get_group())
    _train(nxd_model, nxd_opt, dp)
    d = dict(dtensor_model.named_parameters())
    as_dtensor_names = {"up.weight": nxd_model.up_w, "up.bias": nxd_model.up_b, "down.weight": nxd_model.down_w,
                        "norm.weight": nxd_model.norm.weight,
                        "norm.bias": nxd_model.norm.bias}
    return {"dtensor": {n: _local(p).detach().clone() for n, p in d.items()},
            "nxd": {n: p.detach().clone() for n, p in as_dtensor_names.items()},
            "dtensor_norm": float(dtensor_opt.grad_norm), "nxd_norm": float(nxd_opt.grad_norm),
            "dtensor_masters": [m.clone() for m in dtensor_opt.master_shards],
            "nxd_masters": [m.clone() for m in nxd_opt.master_shards]}


def refusals_rank(rank: int, world_size: int) -> dict:
    """What building over a mesh refuses, on 2 ranks: FSDP2's sharded parameters, TP without its
    data-parallel group, meshes of other dimension names, a mesh beside the groups it names."""
    from torch.distributed.fsdp import fully_shard

    out = {}

    def refusal(build) -> tuple[str, str]:
        try:
            build()
        except (TypeError, ValueError) as e:
            return type(e).__name__, str(e)
        return "built", ""

    fsdp_model = full_model().float()
    fully_shard(fsdp_model)
    out["fsdp"] = refusal(lambda: Zero1Optimizer(fsdp_model.parameters(), torch.optim.AdamW, lr=LR))
    tp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    tp_model = parallelize_module(full_model(), tp_mesh["tp"], PLAN)
    out["tp_no_dp"] = refusal(lambda: Zero1Optimizer(tp_model.parameters(), torch.optim.AdamW, lr=LR))
    odd = init_device_mesh("cpu", (2,), mesh_dim_names=("replicas",))
    out["names"] = refusal(lambda: Zero1Optimizer(full_model().parameters(), torch.optim.AdamW, lr=LR, device_mesh=odd))
    out["beside"] = refusal(lambda: Zero1Optimizer(tp_model.parameters(), torch.optim.AdamW, lr=LR,
                                                   device_mesh=tp_mesh, process_group=tp_mesh["dp"].get_group()))
    ok = Zero1Optimizer(tp_model.parameters(), torch.optim.AdamW, lr=LR, device_mesh=tp_mesh)
    out["tp_only"] = (ok.world_size, ok.tensor_parallel_size)
    by_mesh = Zero1Optimizer(tp_model.parameters(), torch.optim.AdamW, lr=LR, process_group=tp_mesh["dp"])
    out["dp_mesh"] = (by_mesh.world_size, by_mesh.tensor_parallel_size)
    out["2d_mesh"] = refusal(lambda: Zero1Optimizer(tp_model.parameters(), torch.optim.AdamW, lr=LR,
                                                    process_group=tp_mesh))
    return out


def quiet_step_rank(rank: int, world_size: int) -> list[str]:
    """Every warning raised while an optimizer is built over a DP 2 x TP 1 mesh and steps twice: (category,
    file, line, message)."""
    import warnings

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(full_model(), mesh["tp"], PLAN)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR, device_mesh=mesh)
        for step in range(2):
            x, y = data(rank, step, 0)
            ((model(x).float() - y.float()) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()
    return [(c.category.__name__, c.filename, c.lineno, str(c.message)) for c in caught]


def _smp_optimizer(model: nn.Module, **groups) -> Zero1Optimizer:
    from nxd_smp import MixedPrecisionConfig

    return Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1, max_norm=MAX_NORM,
                          bucket_cap_mb=CAP_MB, mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True),
                          **groups)


def _full_masters(opt: Zero1Optimizer, model: nn.Module, mesh) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master, whole: this rank's shard gathered over ``dp``, the TP parts joined."""
    group = mesh["dp"].get_group()
    index = {id(p): i for i, p in enumerate(opt.managed_params)}
    local = {}
    for layout, shard in zip(opt.bucket_layouts, opt.master_shards):
        flat = torch.empty(shard.numel() * opt.world_size)
        dist.all_gather_into_tensor(flat, shard.contiguous(), group=group)
        for i, param_index in enumerate(layout.param_indices):
            start, end = layout.param_range(i)
            local[param_index] = flat[start:end]
    out = {}
    for name, p in model.named_parameters():
        value = local[index[id(p)]].view(_local(p).shape)
        if isinstance(p, DTensor):
            value = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                       stride=p.stride()).full_tensor()
        out[name] = value.clone()
    return out


def checkpoint_save_rank(rank: int, world_size: int, root: str) -> dict:
    """TP 2 x DP 2: two steps, then each TP coordinate saves its own checkpoint; torch's whole state of the
    same moment (``get_optimizer_state_dict`` with ``full_state_dict``, without and with ``cpu_offload``), and
    the two checkpoints' whole state set back at TP 2 x DP 2 (``_full_state_set``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from nxd_smp import save_checkpoint

    mesh = mesh_2x2()
    model = parallelize_module(full_model(), mesh["tp"], PLAN)
    opt = _smp_optimizer(model, device_mesh=mesh)
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    for step in range(2):
        x, y = data(dp, step, 0)
        ((model(x).float() - y.float()) ** 2).mean().backward()
        opt.step()
    save_checkpoint(f"{root}/tp{tp}", model=model, optimizer=opt)
    saved = {"params": {n: _full(p) for n, p in model.named_parameters()}, "masters": _full_masters(opt, model, mesh)}
    dist.barrier()  # (both coordinates' checkpoints written)
    saved["full_get"] = {cpu: get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                                             cpu_offload=cpu))
                         for cpu in (False, True)}
    saved["full_set"] = _full_state_set(root, mesh, opt)
    x, y = data(dp, 2, 0)  # one more step and a second save: its parts must not join the first's
    ((model(x).float() - y.float()) ** 2).mean().backward()
    opt.step()
    save_checkpoint(f"{root}/later/tp{tp}", model=model, optimizer=opt)
    return saved


def checkpoint_load_rank(rank: int, world_size: int, root: str, export: str) -> dict:
    """TP 2 x DP 1: each coordinate loads its own checkpoint (resharded from DP 2), the other's is refused;
    then the DCP export loads into a fresh fp32 DTensor model with ``dcp.load``, as TorchTitan loads one."""
    import torch.distributed.checkpoint as dcp

    from nxd_smp import CheckpointError, load_checkpoint

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"].get_local_rank()
    model = parallelize_module(full_model(seed=1), mesh["tp"], PLAN)
    opt = _smp_optimizer(model, device_mesh=mesh)
    try:
        load_checkpoint(f"{root}/tp{1 - tp}", model=model, optimizer=opt)
        wrong = "loaded"
    except CheckpointError as e:
        wrong = str(e)
    load_checkpoint(f"{root}/tp{tp}", model=model, optimizer=opt)
    loaded = {"params": {n: _full(p) for n, p in model.named_parameters()}, "masters": _full_masters(opt, model, mesh)}
    titan = parallelize_module(full_model(seed=2).float(), mesh["tp"], PLAN)
    state = {"model": titan.state_dict()}
    dcp.load(state, checkpoint_id=export)
    titan.load_state_dict(state["model"])
    return {**loaded, "wrong": wrong, "exported": {n: _full(p) for n, p in titan.named_parameters()},
            "full_set": _full_state_set(root, mesh, opt)}


def _full_state_set(root: str, mesh, loaded: Zero1Optimizer) -> dict:
    """The whole state of both coordinates' checkpoints (joined by the offline reader: global shapes, the
    masters beside the moments) set through torch's ``set_state_dict`` with ``full_state_dict=True`` into a
    fresh DTensor model and optimizer: each rank slices its tensor-parallel part, then its range, on
    arrival. Returns its parameters and masters, whole, and whether its inner state is ``loaded``'s."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    from nxd_smp.checkpointing.tools import read_whole_checkpoint

    whole = read_whole_checkpoint([f"{root}/tp0", f"{root}/tp1"])
    optimizer = whole["optimizer"]
    state = {"state": {name: {**entry, "master": optimizer["master_weights"][name]}
                       for name, entry in optimizer["state"].items()},
             "param_groups": [{**group["hyper"], "params": list(group["params"])} for group in optimizer["groups"]]}
    model = parallelize_module(full_model(seed=3), mesh["tp"], PLAN)
    opt = _smp_optimizer(model, device_mesh=mesh)
    set_state_dict(model, opt, model_state_dict=whole["model"], optim_state_dict=state,
                   options=StateDictOptions(full_state_dict=True))
    ours, theirs = opt.inner_optimizer.state_dict()["state"], loaded.inner_optimizer.state_dict()["state"]
    same = ours.keys() == theirs.keys() and all(
        ours[k].keys() == theirs[k].keys() and all(torch.equal(ours[k][f], theirs[k][f]) for f in ours[k])
        for k in ours)
    return {"params": {n: _full(p) for n, p in model.named_parameters()}, "masters": _full_masters(opt, model, mesh),
            "inner state as loaded": same}


def written_in_place_rank(rank: int, world_size: int) -> dict:
    """TP 2 x DP 1 with lr 0: weights written in place after the build (``mul_`` on the DTensor,
    ``model.load_state_dict``) are the truth at the next step, as for plain parameters."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(full_model(), mesh["tp"], PLAN)
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.0, device_mesh=mesh)
    out = {}
    with torch.no_grad():
        model.up.weight.mul_(0)
    x, y = data(0, 0, 0)
    ((model(x).float() - y.float()) ** 2).mean().backward()
    opt.step()
    out["mul_"] = float(model.up.weight.to_local().abs().max())
    zeros = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(zeros)
    ((model(x).float() - y.float()) ** 2).mean().backward()
    opt.step()
    out["load_state_dict"] = max(float(p.to_local().abs().max()) if isinstance(p, DTensor) else float(p.abs().max())
                                 for p in model.parameters())
    return out


def fsdp_after_forward_rank(rank: int, world_size: int) -> str:
    """FSDP2's root keeps plain unsharded parameters after a forward: still refused, at any world size (a
    world of one included, where no parameter is spread over another rank)."""
    from torch.distributed.fsdp import fully_shard

    model = full_model().float()
    fully_shard(model)
    model(data(0, 0, 0)[0].float())  # (the root's parameters unsharded: plain tensors)
    try:
        Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=LR)
    except ValueError as e:
        return str(e).splitlines()[0]
    return "built"


def empty_part_rank(rank: int, world_size: int, root: str) -> dict:
    """TP 2 x DP 1 with parameters split unevenly, so that tensor-parallel rank 1's parts of them hold no
    elements (``up`` of one output row, column-parallel; ``down``'s weight of one input column, row-parallel):
    two steps, each coordinate saves its checkpoint and loads it into a fresh model and optimizer. Returns
    what the saving run held and what the load installed (this rank's masters and optimizer state)."""
    from nxd_smp import load_checkpoint, save_checkpoint

    def build(seed: int) -> tuple[nn.Module, Zero1Optimizer]:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(IN, 1), nn.Linear(1, OUT)).to(torch.bfloat16)
        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        return model, _smp_optimizer(model, device_mesh=mesh)

    def held(opt: Zero1Optimizer) -> dict:
        state = opt.state_dict()
        return {"masters": [m.clone() for m in opt.master_shards],
                "state": {i: {k: v.local.clone() if hasattr(v, "local") else v.clone() for k, v in entry.items()}
                          for i, entry in state["state"].items()}}

    model, opt = build(0)
    tp = dist.get_rank()
    for step in range(2):  # (gradients given: DTensor's from_local takes parts as even, so no uneven forward)
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            full = (torch.randn(p.shape, generator=g) * 0.3).bfloat16()
            p.grad = distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
        opt.step()
    save_checkpoint(f"{root}/tp{tp}", model=model, optimizer=opt)
    fresh_model, fresh = build(1)
    load_checkpoint(f"{root}/tp{tp}", model=fresh_model, optimizer=fresh)
    return {"local_numels": [_local(p).numel() for p in model.parameters()], "saved": held(opt),
            "loaded": held(fresh)}


def four_ranks(rank: int, world_size: int, root: str) -> dict:
    """Every TP 2 x DP 2 run of the tests on one set of 4 ranks (each set costs seconds to start): the fixed-
    gradient oracle runs with the mesh given both ways, NxD's path beside DTensor's, and the checkpoint save."""
    return {"oracle": {how: dtensor_oracle_rank(rank, world_size, how) for how in ("device_mesh", "process_group")},
            "nxd": nxd_versus_dtensor_rank(rank, world_size),
            "saved": checkpoint_save_rank(rank, world_size, root)}


def two_ranks(rank: int, world_size: int) -> dict:
    """Every 2-rank check but the checkpoint load, on one pair of ranks."""
    return {"refusals": refusals_rank(rank, world_size), "warnings": quiet_step_rank(rank, world_size),
            "written": written_in_place_rank(rank, world_size), "fsdp": fsdp_after_forward_rank(rank, world_size)}
