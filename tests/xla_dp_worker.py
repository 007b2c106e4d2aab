"""Runs on N XLA CPU replicas (tests/xla_replicas.py) for test_xla_replicas.py: nxd_smp's
optimizers trained on the Trainium code path (in-graph collectives over replica groups)
with the fixed gradients of tests/oracle.py, so that the unsharded oracle applies exactly.

Each replica reports, per case: its final parameters, the per-step gradient norms, the HLO
of one steady-state step graph, and XLA's counters (compilations, device-to-host transfers)
at the end of warm-up and at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tests.oracle import Scenario, apply_freeze, fixed_grad_loss, fixed_grads, make_model, param_groups

WARMUP = 3  # steps before the graph is steady: the first builds state, the second uses it


@dataclass(frozen=True)
class Case:
    """One optimizer setup on the replicas. ``groups``: the data-parallel replica groups
    (None: all replicas). ``overflow``: (step, rank) whose first gradient is made inf."""

    name: str
    scenario: Scenario
    api: str = "zero1"  # "zero1", "neuron" (NxD's settings) or "nxd_config"
    groups: tuple[tuple[int, ...], ...] | None = None
    dtype: torch.dtype = torch.bfloat16
    overflow: tuple[int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def build(case: Case, groups_arg, param_groups_: list[dict], world: int):
    import nxd_smp
    from nxd_smp import MixedPrecisionConfig

    s = case.scenario
    cls = s.optimizer_class
    if case.api == "neuron":
        # what NxD's initialize_parallel_optimizer passes on Neuron
        cap = 130
        return nxd_smp.NeuronZero1Optimizer(
            param_groups_, cls, optimizer_dtype=torch.float32, grad_clipping=s.grad_clipping,
            max_norm=s.max_norm, pin_layout=False, sharding_groups=groups_arg,
            bucket_cap_mb_reduce_scatter=cap, bucket_cap_mb_all_gather=max(1, cap // world),
            use_grad_acc_hook=True, higher_cc_precision=True, save_master_weights=True, **s.opt_kwargs,
        )
    if case.api == "nxd_config":
        cfg = nxd_smp.neuronx_distributed_config(
            optimizer_config={"zero_one_enabled": True, "grad_clipping": s.grad_clipping, "max_grad_norm": s.max_norm},
            mixed_precision_config={"use_master_weights": s.master, "use_fp32_grad_acc": s.fp32_acc,
                                    "use_sharded_grad_acc": s.sharded_acc, "use_param_remainders": s.remainders},
        )
        return nxd_smp.initialize_parallel_optimizer(cfg, cls, param_groups_, process_group=groups_arg, **s.opt_kwargs)
    return nxd_smp.Zero1Optimizer(
        param_groups_, cls,
        mixed_precision=MixedPrecisionConfig(use_master_weights=s.master, use_fp32_grad_acc=s.fp32_acc,
                                             use_sharded_grad_acc=s.sharded_acc, use_param_remainders=s.remainders),
        grad_clipping=s.grad_clipping, max_norm=s.max_norm, process_group=groups_arg,
        bucket_cap_mb=s.bucket_cap_mb, **case.extra, **s.opt_kwargs,
    )


def _state_tensors(model, opt) -> list[torch.Tensor]:
    out = [p for p in model.parameters()] + opt.master_shards
    for shard in opt.inner_shards:
        out += [v for v in opt.inner_optimizer.state.get(shard, {}).values() if isinstance(v, torch.Tensor)]
    return out


def _steps(model, opt) -> dict[str, float]:
    """Each managed parameter's Adam ``step`` as the optimizer reports it (read after the run)."""
    names = {id(p): n for n, p in model.named_parameters()}
    opt = getattr(opt, "optimizer", opt)  # (NxD's wrapper holds the Zero1Optimizer)
    return {names[id(p)]: float(opt.state[p]["step"]) for p in opt.managed_params
            if "step" in opt.state.get(p, {})}


def _aliased_since(count: int) -> int:
    """The most input buffers any graph compiled since the ``count``-th compilation donated to
    its outputs (torch_xla's ``InputOutputAliasCount``, one sample per compilation)."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("InputOutputAliasCount")
    if not data:
        return 0
    total, _, samples = data
    return int(max((value for _, value in samples[len(samples) - (total - count):]), default=0))


def _counters() -> dict[str, float]:
    import torch_xla.debug.metrics as met

    return {
        "compiles": (met.metric_data("CompileTime") or [0])[0],
        "from_device": (met.metric_data("TransferFromDeviceTime") or [0])[0],
        "item_calls": met.counter_value("xla::_local_scalar_dense") or 0,
    }


# ---------------------------------------------------------------- checkpoints across devices
#: Checkpoints move between these replicas and CPU ranks: 3 steps, a save, 2 more steps.
CKPT = Scenario("reshard", "AdamW", fixed_grads=True, steps=5, micro=2, max_norm=0.5)
SAVED_AT = 3


def build_for_checkpoints(device, seed: int):
    """The model and optimizer that move between devices (master weights in checkpoints;
    small buckets, so that saved pieces straddle the new shards' boundaries)."""
    import nxd_smp

    with _rng_lock():
        model = make_model(seed, dtype=torch.bfloat16)
    model = model.to(device)
    opt = nxd_smp.Zero1Optimizer(
        param_groups(model, lr_a=CKPT.lr_a, lr_b=CKPT.lr_b), CKPT.optimizer_class, max_norm=CKPT.max_norm,
        mixed_precision=nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True),
        bucket_cap_mb=CKPT.bucket_cap_mb, compile_update=False,  # (CPU: seconds to load, nothing to test here)
    )
    return model, opt


def _rng_lock():
    """Replica threads share torch's global RNG: building a model holds the replicas' lock."""
    import contextlib
    import sys

    replicas = sys.modules.get("tests.xla_replicas")
    return replicas.serial if replicas is not None and replicas._barrier is not None else contextlib.nullcontext()


def train_fixed(model, opt, rank: int, steps: range, sync=lambda: None) -> None:
    """``steps`` of the oracle's fixed gradients of data rank ``rank``."""
    for step in steps:
        for micro in range(CKPT.micro):
            fixed_grad_loss(model, fixed_grads(CKPT.seed, rank, step, micro, model)).backward()
        opt.step()
        sync()


def load_and_continue(rank: int, path: str, device="cpu", sync=lambda: None) -> dict[str, torch.Tensor]:
    """A fresh model (other initial weights: everything must come from the file) loads
    ``path`` and trains the steps after the save at its own DP size."""
    import nxd_smp

    model, opt = build_for_checkpoints(device, seed=5)
    assert nxd_smp.load_checkpoint(path, model=model, optimizer=opt) == {"step": SAVED_AT}
    train_fixed(model, opt, rank, range(SAVED_AT, CKPT.steps), sync)
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def save_and_continue(rank: int, path: str, device="cpu", sync=lambda: None,
                      async_save: bool = False) -> dict[str, torch.Tensor]:
    """Train to the save, save (in the background: training goes on meanwhile), go on."""
    import nxd_smp

    model, opt = build_for_checkpoints(device, seed=0)
    train_fixed(model, opt, rank, range(SAVED_AT), sync)
    nxd_smp.save_checkpoint(path, model=model, optimizer=opt, extra={"step": SAVED_AT}, async_save=async_save)
    train_fixed(model, opt, rank, range(SAVED_AT, CKPT.steps), sync)
    nxd_smp.finalize_checkpoint()
    return {n: p.detach().cpu() for n, p in model.named_parameters()}


def cpu_ranks_load(rank: int, world: int, paths: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """CPU ranks (gloo) load each checkpoint and continue (tests/distributed.py runs it)."""
    return {path: load_and_continue(rank, path) for path in paths}


def cpu_ranks_resume_all(rank: int, world: int, paths: list[str], nxd_roots: list[str]) -> dict[str, Any]:
    """CPU ranks continue from each nxd_smp checkpoint in ``paths`` and each NxD folder in
    ``nxd_roots`` (tests/nxd_layout.py)."""
    from tests.nxd_layout import resume

    return {**cpu_ranks_load(rank, world, paths), **{root: resume(rank, root) for root in nxd_roots}}


def cpu_ranks_save(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    return save_and_continue(rank, path)


def checkpoints(rank: int, world: int, job: dict[str, Any]) -> dict[str, Any]:
    """On the replicas: save one checkpoint in the background and continue; load each CPU
    checkpoint in ``job["load"]`` and continue."""
    import torch_xla

    from tests.xla_replicas import sync

    device = torch_xla.device()
    out = {"uninterrupted": save_and_continue(rank, job["save"], device, sync, async_save=True)}
    out["resumed"] = {path: load_and_continue(rank, path, device, sync) for path in job["load"]}
    if "nxd" in job:  # NxD's checkpoint folders, written by torch_xla's own ZeRO-1 at this DP size,
        # then read back here on the XLA device, as a Trainium run resumes them
        from tests.nxd_layout import LAYOUTS, resume, write_fixtures
        from tests.xla_replicas import barrier, serial

        write_fixtures(rank, world, job["nxd"], sync, barrier)
        out["nxd_resumed"] = {layout: resume(rank, f"{job['nxd']}/{layout}", device, sync, serial)
                              for layout in LAYOUTS}
    return out


def train(rank: int, world: int, cases: list[Case], checkpoint_job: dict[str, Any] | None = None,
          with_tp_norm: bool = False) -> dict[str, Any]:
    """Each case's run on these replicas, then the checkpoints of ``checkpoint_job``, the memory phases
    script's replica and, with ``with_tp_norm`` (4 replicas), ``tp_norm``: one child for all of them."""
    import torch_xla
    import torch_xla.debug.metrics as met

    from tests.xla_replicas import barrier, serial, sync

    device = torch_xla.device()
    results = {}
    for case in cases:
        s = case.scenario
        with serial:
            model = make_model(s.seed, dtype=case.dtype)
        model = model.to(device)
        groups = None if case.groups is None else [list(g) for g in case.groups]
        opt = build(case, groups, param_groups(model, lr_a=s.lr_a, lr_b=s.lr_b), world)
        sync()
        norms, marks, hlo, snapshots = [], {"harness_transfers": 0}, None, {}
        barrier()
        aliases_before = (met.metric_data("InputOutputAliasCount") or [0])[0]

        def snapshot(key: str) -> None:
            # The harness's own transfers, counted apart: XLA's counters are per process, so
            # every replica snapshots between the same barriers and counts all of them.
            barrier()
            before = _counters()["from_device"]
            barrier()
            snapshots[key] = [t.cpu() for t in _state_tensors(model, opt)]
            barrier()
            marks["harness_transfers"] += _counters()["from_device"] - before
            barrier()

        for step in range(s.steps):
            apply_freeze(s, model, step)
            if case.overflow is not None and step == case.overflow[0]:
                snapshot("before_overflow")
            for micro in range(s.micro):
                grads = fixed_grads(s.seed, rank, step, micro, model)
                if case.overflow == (step, rank) and micro == 0:
                    grads["lin1.weight"].view(-1)[0] = float("inf")
                opt.scale_loss(fixed_grad_loss(model, grads)).backward()
            opt.step()
            if s.clear == "optimizer":
                opt.zero_grad()
            norms.append(opt.grad_norm)
            if step == WARMUP:
                hlo = torch_xla._XLAC._get_xla_tensors_hlo(_state_tensors(model, opt) + [opt.grad_norm])
            sync()
            if case.overflow is not None and step == case.overflow[0]:
                snapshot("after_overflow")
            if step + 1 in (WARMUP, s.steps):
                barrier()  # every replica has compiled and run this step
                marks[step + 1] = _counters()
                barrier()
        results[case.name] = {
            "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "norms": [float(n.cpu()) for n in norms],
            "hlo": hlo,
            "marks": marks,
            "snapshots": snapshots,
            "scale": None if opt.loss_scaler is None else float(opt.loss_scaler.scale.cpu()),
            "buckets": len(opt.bucket_layouts),
            "aliased": _aliased_since(aliases_before),
            "steps": _steps(model, opt),
        }
    if checkpoint_job is not None:
        results["checkpoints"] = checkpoints(rank, world, checkpoint_job)
    # scripts/xla_memory_phases.py's replica at a tiny size, on these replicas
    from scripts.xla_memory_phases import replica as memory_phases

    results["memory_phases"] = memory_phases(rank, world, "nxd_smp_sharded_acc", 32, 2, 2)
    if with_tp_norm:
        results["tp_norm"] = tp_norm(rank, world)
    return results


def _tp_grads(kind: str, key: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * (kind == "split") + key)
    return (torch.randn(shape, generator=g) * 0.5).bfloat16()


def tp_norm(rank: int, world: int) -> dict[str, Any]:
    """4 replicas as 2 data-parallel pairs x 2 tensor-parallel ranks: DP groups [[0,1],[2,3]]
    (ranks 0 and 1 hold tensor-parallel part 0), TP groups [[0,2],[1,3]]. A replicated
    parameter's gradient depends on the DP position only (as in real tensor parallelism, every
    TP rank sees the same); the split one's on the rank."""
    import torch.nn as nn
    import torch_xla

    import nxd_smp
    from tests.xla_replicas import sync

    device = torch_xla.device()
    replicated = nn.Parameter(torch.zeros(10, dtype=torch.bfloat16, device=device))
    split = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16, device=device))
    split.tensor_model_parallel = True
    opt = nxd_smp.Zero1Optimizer(
        [replicated, split], torch.optim.SGD, lr=0.0, max_norm=float("inf"),
        process_group=[[0, 1], [2, 3]], grad_norm_groups=[[0, 2], [1, 3]],
    )
    sync()
    dp_position = rank % 2
    loss = (replicated.float() * _tp_grads("replicated", dp_position, 10).to(device).float()).sum() + (
        split.float() * _tp_grads("split", rank, 7).to(device).float()).sum()
    loss.backward()
    opt.step()
    sync()
    return {"norm": float(opt.grad_norm.cpu())}
