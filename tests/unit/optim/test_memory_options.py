"""The memory options (docs/design.md, "Memory options"): master weights as bf16 parameters
plus int16 remainders, and sharded fp32 gradient accumulation.

Their training against the unsharded oracle, through every loop shape, runs with the other
scenarios: tests/unit/optim/test_zero1_oracle.py (gloo, DP 1 to 3) and tests/integration/test_xla_replicas.py (XLA
replicas, DP 2 and 4). Here: the exactness of remainders over 300 AdamW steps against a
plain fp32-master loop that rounds the same way, what happens to remainders when a parameter
is written from outside and across checkpoints, and the mechanics of sharded accumulation.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from nxd_smp import ConfigError, MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
from nxd_smp.backend.base import PendingShard
from nxd_smp.optim.compiled_adamw import CompiledAdamW
from nxd_smp.precision_ops import join_master, round_ties_away, split_master
from tests.distributed import run_ranks
from tests.oracle import round_ties_away as oracle_round

REMAINDERS = MixedPrecisionConfig(use_param_remainders=True)
SHARDED = MixedPrecisionConfig(use_sharded_grad_acc=True)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32)).to(torch.bfloat16)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)
    return (model(x.bfloat16()).float() - y).pow(2).mean()


def _low_half(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) & 0xFFFF


# ---------------------------------------------------------------------------- the bit operations
def test_split_and_join_are_exact_and_round_ties_away_from_zero():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.exp(torch.randn(200_000, generator=g) * 8)
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x40800000 + 0x8000], dtype=torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, 3.4e38, -3.4e38, 1e-40, -1e-40, 1.0, -1.0])
    x = torch.cat([x, ties, special])
    param, remainder = split_master(x)
    assert param.dtype == torch.bfloat16 and remainder.dtype == torch.int16
    assert torch.equal(join_master(param, remainder).view(torch.int32), x.view(torch.int32))
    assert torch.equal(param.view(torch.int16), oracle_round(x).view(torch.int16))
    # it differs from round-to-nearest-even only on ties under an even upper half
    differs = param.view(torch.int16) != x.to(torch.bfloat16).view(torch.int16)
    assert differs.any()
    assert bool((_low_half(x[differs]) == 0x8000).all())
    assert torch.equal(join_master(param, torch.zeros_like(remainder)), param.float())  # no remainder: the param
    nan_param, _ = split_master(torch.tensor([math.nan, -math.nan]))
    assert torch.isnan(nan_param).all()
    assert torch.equal(round_ties_away(x).view(torch.int16), param.view(torch.int16))


# ---------------------------------------------------------------------------- remainders
@pytest.mark.parametrize("compiled", [False, True], ids=["torch_fused_kernel", "compiled_one_pass"])
def test_remainders_are_exact_over_300_adamw_steps(compiled):
    """Parameters and rebuilt masters bit-identical to a plain fp32-master AdamW loop over the
    same flat layout that rounds its parameters the same way: with torch's fused kernel, or
    with nxd_smp's compiled one-pass update (which rebuilds and splits the masters in the loop)."""
    model = _mlp()
    reference = copy.deepcopy(model)
    hyper = {"lr": 3e-3, "weight_decay": 0.1}
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=REMAINDERS, grad_clipping=False,
                         bucket_cap_mb=math.inf, compile_update=compiled, **hyper)
    assert opt.inner_optimizer.param_groups[0]["fused"] and (opt._inner_step.compiled is not None) == compiled
    (layout,) = opt.bucket_layouts
    params = list(reference.parameters())
    padding = torch.zeros(layout.padded_numel - layout.numel)
    master = torch.cat([p.detach().float().reshape(-1) for p in params] + [padding])
    if compiled:
        one_pass = CompiledAdamW(torch.optim.AdamW([master], **hyper))
        scratch = torch.empty(master.numel(), dtype=torch.bfloat16)

        def ref_step(grad: torch.Tensor) -> None:
            assert one_pass.step([grad], [scratch], None)
    else:
        fused = torch.optim.AdamW([master], fused=True, **hyper)

        def ref_step(grad: torch.Tensor) -> None:
            master.grad = grad
            fused.step()
    differ_from_nearest_even = 0
    for step in range(300):
        _loss(model, step).backward()
        opt.step()
        reference.zero_grad(set_to_none=True)
        _loss(reference, step).backward()
        ref_step(torch.cat([p.grad.float().reshape(-1) for p in params] + [padding]))
        rounded = oracle_round(master)
        nearest_even = master.to(torch.bfloat16)
        differs = rounded.view(torch.int16) != nearest_even.view(torch.int16)
        assert bool((_low_half(master[differs]) == 0x8000).all())  # ties only
        differ_from_nearest_even += int(differs.sum())
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(rounded[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
    for got, expected in zip(model.parameters(), params):
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
    (rebuilt,) = opt.master_shards
    assert torch.equal(rebuilt.view(torch.int32), master.view(torch.int32))
    # Ties happened and rounded otherwise than nearest-even would, and the run still matched:
    # an optimizer rounding to nearest-even would have failed the comparison above.
    assert differ_from_nearest_even > 0


def test_remainders_keep_no_fp32_master_between_steps():
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=REMAINDERS, lr=1e-3)
    _loss(model, 0).backward()
    opt.step()
    assert all(shard.numel() == 0 for shard in opt.inner_shards)  # the inner optimizer's keys, emptied
    assert [m.numel() for m in opt.master_shards] == [layout.shard_numel for layout in opt.bucket_layouts]
    state = opt.inner_optimizer.state[opt.inner_shards[0]]
    assert state["exp_avg"].numel() == opt.bucket_layouts[0].shard_numel


def test_a_parameter_written_from_outside_gets_a_zero_remainder():
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=REMAINDERS,
                         bucket_cap_mb=math.inf, lr=1e-2)
    for step in range(3):
        _loss(model, step).backward()
        opt.step()
    before = opt.master_shards[0].clone()
    assert not torch.equal(before[: 32 * 64], model[0].weight.float().reshape(-1))  # remainders in use
    with torch.no_grad():
        model[0].weight.mul_(1.0)  # same values, but written: its master becomes its value
    opt.adopt_param_changes()
    after = opt.master_shards[0]
    assert torch.equal(after[: 32 * 64], model[0].weight.float().reshape(-1))
    assert torch.equal(after[32 * 64 :], before[32 * 64 :])  # the other parameters keep theirs
    _loss(model, 3).backward()
    opt.step()  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("saver,loader", [(REMAINDERS, MixedPrecisionConfig()), (MixedPrecisionConfig(), REMAINDERS)],
                         ids=["remainders_to_fp32", "fp32_to_remainders"])
def test_checkpoints_hold_full_fp32_masters_in_both_modes(tmp_path, saver, loader):
    def build(cfg: MixedPrecisionConfig):
        model = _mlp()
        cfg = MixedPrecisionConfig(use_master_weights_in_ckpt=True, use_param_remainders=cfg.use_param_remainders)
        return model, Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=cfg, lr=1e-2)

    model, opt = build(saver)
    for step in range(3):
        _loss(model, step).backward()
        opt.step()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    other_model, other = build(loader)
    load_checkpoint(tmp_path / "ckpt", model=other_model, optimizer=other)
    for got, saved in zip(other.master_shards, opt.master_shards):
        assert torch.equal(got.view(torch.int32), saved.view(torch.int32))
    for got, saved in zip(other.inner_optimizer.state.values(), opt.inner_optimizer.state.values()):
        assert torch.equal(got["exp_avg_sq"], saved["exp_avg_sq"])


def test_remainders_need_bf16_parameters_and_master_weights():
    model = _mlp().float()
    with pytest.raises(ValueError, match="use_param_remainders.*torch.bfloat16"):
        Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=REMAINDERS)
    with pytest.raises(ConfigError, match="use_param_remainders=True needs use_master_weights=True"):
        MixedPrecisionConfig(use_master_weights=False, use_param_remainders=True)
    with pytest.raises(ConfigError, match="use_sharded_grad_acc=True needs use_fp32_grad_acc=True"):
        MixedPrecisionConfig(use_fp32_grad_acc=False, use_sharded_grad_acc=True)
    for key in ("use_param_remainders", "use_sharded_grad_acc"):
        with pytest.raises(ConfigError, match=f"does not support {key}"):
            MixedPrecisionConfig.from_dict({key: True}, zero_one_enabled=False)
        assert getattr(MixedPrecisionConfig.from_dict({key: True}, zero_one_enabled=True), key)
        assert not getattr(MixedPrecisionConfig.from_dict(None, zero_one_enabled=True), key)


# ---------------------------------------------------------------------------- sharded accumulation
class _Counting:
    """Wraps a backend's ``reduce_scatter_start``: how many were launched, and the most that
    were under way (launched, not yet waited on) at once."""

    def __init__(self, backend):
        self.launched = self.open = self.most_open = 0
        start = backend.reduce_scatter_start

        def counted(flat: torch.Tensor, out: torch.Tensor | None = None) -> PendingShard:
            pending = start(flat, out)
            self.launched += 1
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            return _Counted(self, pending)

        backend.reduce_scatter_start = counted


class _Counted(PendingShard):
    def __init__(self, counting: _Counting, pending: PendingShard):
        self._counting, self._pending = counting, pending

    def wait(self) -> torch.Tensor:
        self._counting.open -= 1
        return self._pending.wait()


def test_sharded_accumulation_reduces_during_backward_bucket_by_bucket():
    model = _mlp()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, mixed_precision=SHARDED,
                         bucket_cap_mb=0.002, lr=1e-3)  # 512 elements: several buckets
    buckets = len(opt.bucket_layouts)
    assert buckets > 3
    counting = _Counting(opt.backend)
    for micro in range(3):
        _loss(model, micro).backward()
        assert counting.launched == (micro + 1) * buckets  # every bucket, within each backward
        assert counting.open == 0
        assert all(p.grad is None for p in model.parameters())
    assert 1 < counting.most_open <= 2  # bucket-sized staging: at most two under way

    def no_reduce_scatter(*args, **kwargs):
        raise AssertionError("step() reduce-scattered again")

    opt.backend.reduce_scatter = no_reduce_scatter
    opt.step()
    assert counting.launched == 3 * buckets
    with pytest.raises(RuntimeError, match="use_sharded_grad_acc"):
        opt.main_grad(model[0].weight)


def _sharded_on_two_ranks(rank: int, world: int) -> dict:
    """Each rank keeps shards only; a parameter only rank 1 uses still trains on both."""
    torch.manual_seed(0)
    model = _mlp()
    extra = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    groups = [{"params": list(model.parameters()) + [extra]}]
    opt = Zero1Optimizer(groups, torch.optim.SGD, mixed_precision=SHARDED, bucket_cap_mb=0.002,
                         grad_clipping=False, lr=0.5)
    for micro in range(2):
        loss = _loss(model, 10 * rank + micro)
        if rank == 1:
            loss = loss + extra.float().sum()  # gradient 1 per element, on rank 1 only
        loss.backward()
    sums = opt._grads._sums
    shard_sizes = [t.numel() for t in sums] == [layout.shard_numel for layout in opt.bucket_layouts]
    opt.step()
    return {"shard_sizes": shard_sizes, "extra": extra.detach().clone(), "weight": model[0].weight.detach().clone()}


def test_sharded_accumulation_on_two_gloo_ranks_keeps_shards_and_sums_every_rank():
    ranks = run_ranks(2, _sharded_on_two_ranks)
    assert all(r["shard_sizes"] for r in ranks)
    # mean over 2 ranks of (0, then 2 micro-batches x 1) = 1 per element: 1 - 0.5 * 1
    expected = torch.full((8,), 0.5, dtype=torch.bfloat16)
    for r in ranks:
        assert torch.equal(r["extra"], expected)
        assert torch.equal(r["weight"], ranks[0]["weight"])


def test_the_readme_trainium_settings_build_an_optimizer_with_sharded_accumulation():
    import re
    from pathlib import Path

    import nxd_smp

    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("## Memory options"):]
    section = section[: section.index("\n## ", 4)]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace = {"nxd_smp": nxd_smp}
    exec(code, namespace)
    model = _mlp()
    opt = nxd_smp.initialize_parallel_optimizer(namespace["cfg"], torch.optim.AdamW, model.parameters(), lr=1e-3)
    assert opt.mixed_precision.use_sharded_grad_acc and opt.mixed_precision.use_master_weights
    _loss(model, 0).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="use_sharded_grad_acc"):
        opt.main_grad(model[0].weight)
