"""What the gloo ranks of tests/integration/test_nxd_trainer.py run, and the plain fp32 reference they are
compared with.

The model is a transformer block's parameters as NxD's layers mark them: a LayerNorm weight
and bias marked ``sequence_parallel_enabled`` (under sequence parallelism each tensor-parallel
rank computes their gradient from its part of the sequence: a partial sum), a weight split over
the tensor-parallel ranks (``tensor_model_parallel``: each rank its own slice and gradient) and
an unmarked replicated bias (the same gradient on every tensor-parallel rank). Gradients are
fixed (the loss ``sum(p * g)`` has gradient ``g``), drawn per data-parallel rank, tensor-
parallel rank, step and micro-batch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

SHAPES = {"norm.weight": (16,), "norm.bias": (16,), "proj.weight": (8, 16), "head.bias": (5,)}
MARKED = ("norm.weight", "norm.bias")
SPLIT = ("proj.weight",)
STEPS, MICRO = 3, 2
SGD = {"lr": 0.05, "momentum": 0.9}


class Block(nn.Module):
    """The parameters of one NxD transformer block, marked as NxD marks them."""

    def __init__(self, tp_rank: int, dtype: torch.dtype):
        super().__init__()
        self.norm = nn.Module()
        self.proj = nn.Module()
        self.head = nn.Module()
        for name, shape in SHAPES.items():
            owner, attr = name.split(".")
            # replicated parameters start equal on every tensor-parallel rank, split ones differ
            seed = 17 * (list(SHAPES).index(name) + 1) + (100 * tp_rank if name in SPLIT else 0)
            p = nn.Parameter((torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.5).to(dtype))
            if name in MARKED:
                p.sequence_parallel_enabled = True
            if name in SPLIT:
                p.tensor_model_parallel = True
            setattr(getattr(self, owner), attr, p)


def grad(name: str, dp: int, tp: int, step: int, micro: int, dtype: torch.dtype) -> torch.Tensor:
    """The gradient rank (dp, tp) computes for ``name``: a partial one for the marked parameters,
    its own for the split one, and for the replicated one the same on every tensor-parallel rank."""
    tp_key = tp if (name in MARKED or name in SPLIT) else 0
    seed = 1_000_003 * (list(SHAPES).index(name) + 1) + 10_007 * dp + 1_009 * tp_key + 101 * step + micro
    return (torch.randn(SHAPES[name], generator=torch.Generator().manual_seed(seed)) * 0.3).to(dtype)


def backward(model: nn.Module, dp: int, tp: int, step: int, micro: int, scale: float = 1.0) -> None:
    """The loss whose gradient is ``grad(...)`` times ``scale`` (a per-token-sum loss divides by the
    global token count: ``1 / DP`` of a rank's own mean)."""
    params = dict(model.named_parameters())
    loss = sum((p.float() * grad(n, dp, tp, step, micro, p.dtype).float()).sum() for n, p in params.items())
    (loss * scale if scale != 1.0 else loss).backward()


def reference(*, dp_size: int, tp_size: int, cp_size: int = 1, sequence_parallel: bool, max_norm: float,
              dtype: torch.dtype, optimizer=torch.optim.SGD, opt_kwargs=SGD) -> dict[int, dict[str, torch.Tensor]]:
    """NxD's semantics written out in one process, in fp32, for every tensor-parallel rank:
    per step the gradients summed over micro-batches, averaged over data (and context) parallel
    ranks, the marked ones summed over tensor-parallel ranks (when ``sequence_parallel``), the
    norm over the whole model (a split parameter counted on each tensor-parallel rank, the
    others once), clipped, one stock ``optimizer`` step on fp32 masters, cast to ``dtype``.
    Context-parallel ranks are more data ranks here: the ones after the data-parallel ones.
    Returns the parameters by name, per tensor-parallel rank."""
    models = {t: Block(t, dtype) for t in range(tp_size)}
    masters = {t: {n: p.detach().float().clone() for n, p in models[t].named_parameters()} for t in range(tp_size)}
    optimizers = {t: optimizer([masters[t][n] for n in SHAPES], **opt_kwargs) for t in range(tp_size)}
    ranks = dp_size * cp_size
    for step in range(STEPS):
        local = {t: {n: sum(grad(n, d, t, step, m, dtype).float() for d in range(ranks) for m in range(MICRO)) / ranks
                     for n in SHAPES} for t in range(tp_size)}
        reduced = {t: {n: (sum(local[u][n] for u in range(tp_size)) if sequence_parallel and n in MARKED
                           else local[t][n]) for n in SHAPES} for t in range(tp_size)}
        sq = sum(float(g.pow(2).sum()) for n, g in reduced[0].items() if n not in SPLIT)
        sq += sum(float(reduced[t][n].pow(2).sum()) for t in range(tp_size) for n in SPLIT)
        coef = min(1.0, max_norm / (math.sqrt(sq) + 1e-6))
        for t in range(tp_size):
            for n in SHAPES:
                masters[t][n].grad = reduced[t][n] * coef
            optimizers[t].step()
    return {t: {n: masters[t][n].to(dtype) for n in SHAPES} for t in range(tp_size)}


# ---------------------------------------------------------------- 4 ranks: TP 2 x DP 2
def nxd_layout() -> dict[str, list[list[int]]]:
    from tests import nxd_stand_in

    return nxd_stand_in.layout(4, tp=2, pp=1)  # tp [[0, 1], [2, 3]], dp [[0, 2], [1, 3]]


SP_CASES = {
    # name: (ZeRO-1, mixed precision config, model dtype, NxD's parallel state installed)
    "zero1": (True, {}, torch.bfloat16, False),
    "zero1_nxd_state": (True, {}, torch.bfloat16, True),
    "sharded_acc": (True, {"use_sharded_grad_acc": True}, torch.bfloat16, False),
    "zero1_off": (False, None, torch.float32, False),
    "neuron_direct": (True, None, torch.bfloat16, False),  # optimum-neuron's build, SP left to nxd_smp
    "sp_off_in_config": (True, {}, torch.bfloat16, False),  # the control: nothing summed
}
SP_MAX_NORM = {"clip_active": 0.2, "clip_inactive": 1e6}


def _build(case: str, model: nn.Module, groups: dict, max_norm: float):
    import nxd_smp

    zero1, mixed, _, from_state = SP_CASES[case]
    params = list(model.parameters())
    if case == "neuron_direct":
        return nxd_smp.NeuronZero1Optimizer(params, torch.optim.SGD, optimizer_dtype=torch.float32, pin_layout=False,
                                            sharding_groups=groups["dp"], grad_norm_groups=groups["tp"],
                                            use_grad_acc_hook=True, higher_cc_precision=True, max_norm=max_norm,
                                            bucket_cap_mb_all_gather=130, bucket_cap_mb_reduce_scatter=130, **SGD)
    cfg = nxd_smp.neuronx_distributed_config(
        tensor_parallel_size=2, sequence_parallel=case != "sp_off_in_config",
        optimizer_config={"zero_one_enabled": zero1, "grad_clipping": True, "max_grad_norm": max_norm},
        mixed_precision_config=mixed,
    )
    explicit = {} if from_state else {"process_group": groups["dp"], "grad_norm_groups": groups["tp"]}
    return nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, params, **explicit, **SGD)


def sequence_parallel_ranks(rank: int, world: int) -> dict[tuple[str, str], Any]:
    """Every SP case at TP 2 x DP 2, with clipping active and inactive: this rank's parameters."""
    from tests import nxd_stand_in

    groups = nxd_layout()
    tp, dp = rank % 2, rank // 2
    out = {}
    for case, (_, _, dtype, from_state) in SP_CASES.items():
        for clip, max_norm in SP_MAX_NORM.items():
            if from_state:
                nxd_stand_in.install(world, tp=2, rank=rank)
            try:
                model = Block(tp, dtype)
                opt = _build(case, model, groups, max_norm)
                for step in range(STEPS):
                    for micro in range(MICRO):
                        backward(model, dp, tp, step, micro)
                    opt.step()
                    opt.zero_grad()
            finally:
                nxd_stand_in.uninstall()
            out[(case, clip)] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                                 "norm": float(opt.grad_norm), "tp": tp, "dp": dp}
    return out


# ---------------------------------------------------------------- 2 ranks: DP 2, or CP 2
ADAMW = {"lr": 1e-3}
DP_OPTIMIZERS = {"sgd": (torch.optim.SGD, SGD), "adamw": (torch.optim.AdamW, ADAMW)}
CP_CASES = {
    # name: (ZeRO-1, data-parallel (sharding) groups, model dtype)
    "cp_zero1_off": (False, [[0], [1]], torch.float32),
    "cp_zero1_dp_only": (True, [[0], [1]], torch.bfloat16),  # the CP mean is an all-reduce of its own
    "cp_zero1_nxd_sharding": (True, [[0, 1]], torch.bfloat16),  # NxD's DP x CP sharding: in the DP mean
}


def _train(model: nn.Module, opt, data_rank: int, step_fn=None, scale: float = 1.0) -> None:
    for step in range(STEPS):
        for micro in range(MICRO):
            backward(model, data_rank, 0, step, micro, scale)
        (step_fn or opt.step)()
        opt.zero_grad()


def _snapshot(model: nn.Module, opt) -> dict[str, Any]:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "norm": float(opt.grad_norm)}


def optimum_neuron_step(opt, max_norm: float) -> torch.Tensor:
    """optimum-neuron's ``NeuronAcceleratedOptimizer.step`` around a ZeRO-1 optimizer, as it
    reads: clipping switched on with the caller's norm, the step, the norm read from
    ``_grad_norm``, clipping switched off again."""
    opt.grad_clipping = True
    opt.max_norm = max_norm
    opt.step(closure=None)
    norm = opt._grad_norm
    opt.grad_clipping = False
    return norm


def _start(seed: int) -> Block:
    """A bf16 block to train from: seed 0 the usual start, another a different one (a fresh run
    that a load must overwrite)."""
    model = Block(0, torch.bfloat16)
    if seed:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1)
    return model


def nxd_training_checkpoints(rank: int, directory: str, async_save: bool) -> dict[str, Any]:
    """NxD Training's checkpoint IO (``NLPCheckpointIO``) around a ZeRO-1 run at DP 2: Lightning's
    checkpoint dict split into the model's state dict, the optimizer's and the rest, saved with
    ``save_checkpoint(dir, tag, model=, optimizer=, user_content=, use_xser=, async_save=,
    zero1_optimizer=)``; then fresh dicts filled by ``load_checkpoint(dir, tag, model={},
    optimizer={})`` and loaded into a fresh model and optimizer as Lightning does. Returns the
    parameters a run that did not stop reached, the resumed run's, and what came back."""
    import nxd_smp

    def build(seed: int):
        model = _start(seed)
        cfg = nxd_smp.neuronx_distributed_config(
            optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 0.5},
            mixed_precision_config={"use_master_weights": True, "use_fp32_grad_acc": True,
                                    "use_master_weights_in_ckpt": True})
        defaults = torch.optim.AdamW(model.parameters(), **ADAMW).defaults  # NeMo built the optimizer first
        return model, nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters(), **defaults)

    def train(model, opt, steps) -> None:
        for step in steps:
            for micro in range(MICRO):
                backward(model, rank, 0, step, micro)
            opt.step()
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, range(2))
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 2,
                  "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}}}
    nxd_smp.save_checkpoint(directory, "step=2", model=checkpoint.pop("state_dict"),
                            optimizer=checkpoint.pop("optimizer_states")[0], user_content=checkpoint,
                            use_xser=False, async_save=async_save, zero1_optimizer=False)
    train(model, opt, range(2, 3))
    nxd_smp.finalize_checkpoint()
    reached = {n: p.detach().clone() for n, p in model.named_parameters()}

    fresh, fresh_opt = build(1)
    model_state, optimizer_state = {}, {}
    user_content = nxd_smp.load_checkpoint(directory, "step=2", model=model_state, optimizer=optimizer_state)
    fresh.load_state_dict(model_state)  # what Lightning does with the filled dicts
    fresh_opt.load_state_dict(optimizer_state)
    train(fresh, fresh_opt, range(2, 3))
    weights_only = {}
    nxd_smp.load_checkpoint(directory, "step=2", model=weights_only, optimizer=None)  # weight_init_only
    return {"reached": reached, "resumed": {n: p.detach().clone() for n, p in fresh.named_parameters()},
            "user_content": user_content, "weights_only": sorted(weights_only), "filled": sorted(optimizer_state)}


class AcceleratedOptimizer:
    """What ``save_checkpoint`` sees of optimum-neuron's ``NeuronAcceleratedOptimizer``: the
    ZeRO-1 optimizer it wraps, in ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer


def optimum_neuron_checkpoints(rank: int, directory: str, async_save: bool) -> dict[str, Any]:
    """optimum-neuron's ``save_pretrained`` of a ZeRO-1 run at DP 2: before an asynchronous save its
    wait touches ``shards/done``; ``save_checkpoint(dir, tag="shards", model=, optimizer=<its
    wrapper>, use_xser=, async_save=, num_workers=)``; then rank 0 writes its consolidation metadata
    into the tag folder at once. Resumed into a fresh model and optimizer, training goes on bit for
    bit."""
    import os
    from pathlib import Path

    import nxd_smp

    def build(seed: int):
        model = _start(seed)
        user_optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        opt = nxd_smp.NeuronZero1Optimizer(
            user_optimizer.param_groups, user_optimizer.__class__, pin_layout=False, sharding_groups=[[0, 1]],
            grad_norm_groups=[[0], [1]], bucket_cap_mb_all_gather=65, bucket_cap_mb_reduce_scatter=130,
            optimizer_dtype=torch.float32, use_grad_acc_hook=True, higher_cc_precision=True, save_master_weights=True)
        return model, opt

    def train(model, opt, steps) -> None:
        for step in steps:
            for micro in range(MICRO):
                backward(model, rank, 0, step, micro)
            optimum_neuron_step(opt, 0.5)
            opt.zero_grad()

    model, opt = build(0)
    train(model, opt, range(2))
    shards = Path(directory) / "shards"
    if async_save and rank == 0:  # optimum-neuron's wait before an asynchronous save
        shards.mkdir(parents=True, exist_ok=True)
        (shards / "done").touch()
    nxd_smp.save_checkpoint(directory, tag="shards", model=model, optimizer=AcceleratedOptimizer(opt),
                            use_xser=False, async_save=async_save, num_workers=8)
    if rank == 0:  # its consolidation metadata, written into the tag folder right away
        shards.mkdir(parents=True, exist_ok=True)
        (shards / "mp_metadata_pp_rank_0.json").write_text('{"tp_size": 1}')
    train(model, opt, range(2, 3))
    nxd_smp.finalize_checkpoint()
    reached = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh, fresh_opt = build(1)
    nxd_smp.load_checkpoint(directory, "shards", model=fresh, optimizer=AcceleratedOptimizer(fresh_opt))
    train(fresh, fresh_opt, range(2, 3))
    return {"reached": reached, "resumed": {n: p.detach().clone() for n, p in fresh.named_parameters()},
            "metadata_kept": os.path.isfile(shards / "mp_metadata_pp_rank_0.json"), "is_link": shards.is_symlink()}


def two_ranks(rank: int, world: int, directory: str | None = None) -> dict[Any, Any]:
    """Every 2-rank case: this rank's parameters and last norm."""
    import nxd_smp

    out = {}
    if directory is not None:
        for async_save in (False, True):
            out[("nxd_training", async_save)] = nxd_training_checkpoints(rank, f"{directory}/{async_save}", async_save)
            out[("optimum_save", async_save)] = optimum_neuron_checkpoints(
                rank, f"{directory}/optimum_{async_save}", async_save)
    for name, (cls, kwargs) in DP_OPTIMIZERS.items():  # ZeRO-1 off at DP 2
        for clip, max_norm in SP_MAX_NORM.items():
            model = Block(0, torch.float32)
            cfg = nxd_smp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": False,
                                                                       "max_grad_norm": max_norm})
            opt = nxd_smp.initialize_parallel_optimizer(cfg, cls, model.parameters(), **kwargs)
            _train(model, opt, rank)
            out[("dp_mean", name, clip)] = _snapshot(model, opt)
    for clip, max_norm in SP_MAX_NORM.items():  # ZeRO-1 off, a per-token-sum loss, summed over the ranks
        for reduction in ("sum", "mean"):
            model = Block(0, torch.float32)
            cfg = nxd_smp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": False,
                                                                       "max_grad_norm": max_norm})
            opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(),
                                                        grad_reduction=reduction, **SGD)
            _train(model, opt, rank, scale=1.0 / world)
            out[("token_sum", reduction, clip)] = _snapshot(model, opt)
    for case, (zero1, dp_groups, dtype) in CP_CASES.items():  # context parallelism of 2 ranks
        model = Block(0, dtype)
        cfg = nxd_smp.neuronx_distributed_config(context_parallel_size=2, optimizer_config={
            "zero_one_enabled": zero1, "max_grad_norm": SP_MAX_NORM["clip_active"]})
        opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), process_group=dp_groups,
                                                    context_parallel_groups=[[0, 1]], **SGD)
        _train(model, opt, rank)
        out[case] = _snapshot(model, opt)
    for clip, max_norm in SP_MAX_NORM.items():  # optimum-neuron's ZeRO-1 build and step at DP 2
        model = Block(0, torch.bfloat16)
        user_optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)  # what accelerator.prepare is given
        opt = nxd_smp.NeuronZero1Optimizer(
            user_optimizer.param_groups, user_optimizer.__class__, pin_layout=False, sharding_groups=[[0, 1]],
            grad_norm_groups=[[0], [1]], bucket_cap_mb_all_gather=65, bucket_cap_mb_reduce_scatter=130,
            optimizer_dtype=torch.float32, use_grad_acc_hook=True, higher_cc_precision=True, save_master_weights=True)
        norms = []
        _train(model, opt, rank, lambda: norms.append(float(optimum_neuron_step(opt, max_norm))))
        out[("optimum_neuron", clip)] = {**_snapshot(model, opt), "norms": norms, "clipping_after": opt.grad_clipping}
    return out
