"""The small model and optimizer the checkpoint tests save, move across DP sizes and load, with the
loop that trains them on the same global batch at every DP size: shared by the checkpointing unit
tests, the CLI's and object storage's; and the two halves of a run cut by a checkpoint (run by each
rank: ``tests.distributed.run_ranks``)."""

from __future__ import annotations

import torch

from nxd_smp import MixedPrecisionConfig, Zero1Optimizer, finalize_checkpoint, load_checkpoint, save_checkpoint
from tests.oracle import batch, loss_fn, make_model, param_groups

GLOBAL_MICRO = 6  # micro-batches per step over all ranks: the same data at DP 1, 2, 3


def build(seed=0, master_in_ckpt=True, master=True, optimizer=torch.optim.AdamW, memory_options=False, **kwargs):
    """The model and optimizer the checkpoint tests move around. The compiled CPU update is off
    here (a fresh process pays seconds to load it, and it changes nothing a checkpoint holds:
    test_placement loads into it). ``memory_options``: sharded accumulation and remainders."""
    if optimizer in (torch.optim.Adam, torch.optim.AdamW):
        kwargs.setdefault("compile_update", False)
    model = make_model(seed)
    mp = MixedPrecisionConfig(use_master_weights=master, use_fp32_grad_acc=master,
                              use_master_weights_in_ckpt=master_in_ckpt and master,
                              use_sharded_grad_acc=memory_options, use_param_remainders=memory_options)
    opt = Zero1Optimizer(param_groups(model, lr_a=1e-2, lr_b=3e-2), optimizer,
                         mixed_precision=mp, bucket_cap_mb=0.0004, **kwargs)
    return model, opt


def train(model, opt, steps, start, rank=0, world_size=1, global_micro=GLOBAL_MICRO):
    """``steps`` steps from step ``start`` on rank ``rank`` of ``world_size``: the same global batch at
    every DP size (``global_micro`` micro-batches shared out)."""
    per_rank = global_micro // world_size
    for step in range(start, start + steps):
        for m in range(per_rank):
            x, y = batch(0, 0, step, rank * per_rank + m)
            (loss_fn(model, x, y) / per_rank).backward()
        opt.step()
        opt.zero_grad()


def params_of(model):
    """Copies of ``model``'s parameters by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def save_then_continue(rank, world_size, path, async_save=False, memory_options=False):
    """Train 3 steps, save (in the background when ``async_save``: training goes on while
    the checkpoint is written), train 2 more."""
    model, opt = build(seed=0, memory_options=memory_options)
    train(model, opt, 3, 0, rank, world_size)
    save_checkpoint(path, model=model, optimizer=opt, extra={"step": 3}, async_save=async_save)
    train(model, opt, 2, 3, rank, world_size)
    finalize_checkpoint()
    return params_of(model)


def load_then_continue(rank, world_size, path, memory_options=False):
    model, opt = build(seed=5, memory_options=memory_options)  # everything must come from the file
    extra = load_checkpoint(path, model=model, optimizer=opt)
    assert extra == {"step": 3}
    train(model, opt, 2, extra["step"], rank, world_size)
    return params_of(model)
