"""NxD's checkpoint folders, written from torch_xla's own ``ZeroRedundancyOptimizer`` with
NxD's settings, for nxd_smp to import; and the unsharded oracle of the runs they come from.

NxD itself cannot be installed here (PyPI's ``neuronx-distributed`` is a placeholder), so
``write_tag`` lays the files out as ``neuronx_distributed.trainer.checkpoint.save_checkpoint``
does (read there): ``<tag>/checkpoint``, ``model/dp_rank_00_tp_rank_00_pp_rank_00.pt`` from DP
rank 0, ``optim/dp_rank_XX_tp_rank_00_pp_rank_00.pt`` from every DP rank (the optimizer's
``state_dict()``), ``scheduler.pt`` and ``user_content.pt`` from rank 0, ``done`` last. With
``xser`` every tensor is a file of its own (``<name>.pt.tensors/tensor_<i>.pt``, numbered in
the order the state dict is walked), the ``.pt`` holds torch_xla's ``TensorReference`` in
its place, and ``<name>.pt.info.pt`` the dtypes and shapes, as NxD's ``_xser_save_data``.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from tests.xla_export_worker import make_model

MAX_NORM = 0.5
SAVED_AT, STEPS = 2, 4
TAG = f"step_{SAVED_AT}"
LAYOUTS = ("plain", "xser")
USER_CONTENT = {"step": SAVED_AT, "tokens": 1234}


def param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """Weights and biases with their own lr and weight decay (torch_xla numbers them in this order)."""
    return [
        {"params": [model[0].weight, model[2].weight], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [model[0].bias, model[2].bias], "lr": 3e-2, "weight_decay": 0.0},
    ]


HYPER = dict(betas=(0.9, 0.99), eps=1e-6)


def grads(data_rank: int, step: int, model: nn.Module) -> list[torch.Tensor]:
    """bf16 gradients of data rank ``data_rank`` at ``step``, one per parameter in model order."""
    g = torch.Generator().manual_seed(9_001 + 1_000 * data_rank + step)
    return [(torch.randn(p.shape, generator=g) * 0.3).bfloat16() for p in model.parameters()]


def backward(model: nn.Module, gs: list[torch.Tensor]) -> None:
    sum((p.float() * g.to(p.device).float()).sum() for p, g in zip(model.parameters(), gs)).backward()


def scheduler_of(optimizer: torch.optim.Optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1_000)  # a state to restore, lr unchanged


# ---------------------------------------------------------------- NxD's files
def _xser(data: Any, tensors: Path) -> tuple[Any, dict[int, dict[str, Any]]]:
    """``data`` with each tensor saved as ``tensors/tensor_<i>.pt`` and replaced by a reference."""
    from torch_xla.utils.serialization import TensorReference

    tensors.mkdir(parents=True, exist_ok=True)
    info: dict[int, dict[str, Any]] = {}

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tid = len(info)
            cpu = value.detach().cpu()
            torch.save(cpu, tensors / f"tensor_{tid}.pt")
            info[tid] = {"dtype": cpu.dtype, "shape": cpu.shape, "expert_model_parallel": False}
            return TensorReference(tid)
        if isinstance(value, dict):
            return type(value)((k, walk(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        return value

    return walk(data), info


def _to_cpu(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.detach().cpu()
    if isinstance(data, dict):
        return type(data)((k, _to_cpu(v)) for k, v in data.items())
    if isinstance(data, (list, tuple)):
        return type(data)(_to_cpu(v) for v in data)
    return data


def _save(data: Any, path: Path, xser: bool) -> None:
    if xser:
        refs, info = _xser(data, Path(f"{path}.tensors"))
        torch.save(refs, path)
        torch.save(info, f"{path}.info.pt")
    else:
        torch.save(_to_cpu(data), path)


def write_tag(root: Path, *, rank: int, model, optimizer, scheduler, xser: bool, barrier=lambda: None) -> Path:
    """This DP rank's part of NxD's tag folder ``root/TAG``; ``done`` once every rank wrote."""
    tag = root / TAG
    if rank == 0:
        for sub in ("model", "optim"):
            (tag / sub).mkdir(parents=True, exist_ok=True)
        (tag / "checkpoint").write_text("1")
    barrier()
    _save(optimizer.state_dict(), tag / "optim" / f"dp_rank_{rank:02d}_tp_rank_00_pp_rank_00.pt", xser)
    if rank == 0:
        _save(model.state_dict(), tag / "model" / "dp_rank_00_tp_rank_00_pp_rank_00.pt", xser)
        torch.save(scheduler.state_dict(), tag / "scheduler.pt")
        torch.save(USER_CONTENT, tag / "user_content.pt")
    barrier()
    if rank == 0:
        (tag / "done").write_text("1")
    barrier()
    return tag


def write_fixtures(rank: int, world: int, root: str, sync=None, barrier=lambda: None) -> None:
    """On the XLA device: torch_xla's ZeRO-1 with NxD's settings trains ``SAVED_AT`` steps at
    DP ``world`` (this replica on data rank ``rank``), then both layouts are written under
    ``root/<layout>``."""
    import torch_xla
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    from nxd_smp.backend.xla import restart_channel_ids
    from tests.xla_replicas import serial, split_torch_xla_collectives_per_tensor

    sync = sync or torch_xla.sync
    device = torch_xla.device()
    if world > 1:
        split_torch_xla_collectives_per_tensor()  # forced by XLA:CPU replicas (NXD_FACTS.md)
    with serial:  # the replicas are threads: one at a time on torch's global generator
        model = make_model()
    model = model.to(device)
    zero = ZeroRedundancyOptimizer(
        param_groups(model), torch.optim.AdamW, optimizer_dtype=torch.float32, grad_clipping=True,
        max_norm=MAX_NORM, pin_layout=False, use_grad_acc_hook=True, higher_cc_precision=True,
        save_master_weights=True, **HYPER,
    )
    scheduler = scheduler_of(zero)
    sync()
    for step in range(SAVED_AT):
        backward(model, grads(rank, step, model))
        sync()
        restart_channel_ids()
        zero.step()
        zero.zero_grad()
        scheduler.step()
        sync()
    for layout in LAYOUTS:
        write_tag(Path(root) / layout, rank=rank, model=model, optimizer=zero, scheduler=scheduler,
                  xser=layout == "xser", barrier=barrier)


# ---------------------------------------------------------------- nxd_smp takes over
def resume(rank: int, root: Path | str, device="cpu", sync=lambda: None, lock=None) -> dict[str, Any]:
    """A fresh model and ``Zero1Optimizer`` (at the DP size of this process group, or of the
    XLA replicas) load the newest tag under ``root`` and train the steps after the save on
    data rank ``rank``. ``lock``: held while torch's global generator is used (replica threads)."""
    import nxd_smp

    with lock or contextlib.nullcontext():
        model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)  # other weights: everything must come from the files
    model = model.to(device)
    opt = nxd_smp.Zero1Optimizer(
        param_groups(model), torch.optim.AdamW, max_norm=MAX_NORM, bucket_cap_mb=0.0002,
        compile_update=False, **HYPER,
    )
    scheduler = scheduler_of(opt)
    content = nxd_smp.load_checkpoint(root, model=model, optimizer=opt, scheduler=scheduler)
    for step in range(SAVED_AT, STEPS):
        backward(model, grads(rank, step, model))
        opt.step()
        opt.zero_grad()
        sync()
    return {"params": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "user_content": content, "scheduler_epoch": scheduler.last_epoch}


def cpu_ranks_resume(rank: int, world: int, roots: list[str]) -> dict[str, Any]:
    return {root: resume(rank, root) for root in roots}


def oracle(before: int, after: int) -> dict[str, torch.Tensor]:
    """The unsharded run: fp32 masters and AdamW, the ranks' mean gradient clipped to
    ``MAX_NORM``; DP ``before`` until the save and DP ``after`` from there."""
    model = make_model()
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    groups = [{**g, "params": [masters[index[id(p)]] for p in g["params"]]} for g in param_groups(model)]
    inner = torch.optim.AdamW(groups, **HYPER)
    for step in range(STEPS):
        world = before if step < SAVED_AT else after
        total = [sum(grads(r, step, model)[i].float() for r in range(world)) / world for i in range(len(params))]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in total))
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        for m, g in zip(masters, total):
            m.grad = g * coef
        inner.step()
    return {n: m.to(torch.bfloat16) for (n, _), m in zip(model.named_parameters(), masters)}
