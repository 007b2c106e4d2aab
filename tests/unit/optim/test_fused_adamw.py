"""The compiled one-pass Adam/AdamW update against torch.optim's own step."""

from __future__ import annotations

import pytest
import torch

from nxd_smp import MixedPrecisionConfig, Zero1Optimizer
from nxd_smp.optim import compiled_adamw as fused_adamw
from nxd_smp.optim.compiled_adamw import CompiledAdamW, applies_to
from tests.crafted import compiler_missing
from tests.oracle import batch, loss_fn, make_model


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_matches_torch_adam_and_writes_the_cast(cls):
    g = torch.Generator().manual_seed(0)
    shapes = [1000, 37]
    ours = [torch.randn(n, generator=g) for n in shapes]
    reference = [t.clone() for t in ours]
    kwargs = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    compiled = CompiledAdamW(cls([{"params": [ours[0]]}, {"params": [ours[1]], "lr": 3e-2}], **kwargs))
    stock = cls([{"params": [reference[0]]}, {"params": [reference[1]], "lr": 3e-2}], **kwargs)
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in shapes]
    for step in range(4):
        grads = [torch.randn(n, generator=g) for n in shapes]
        coef = torch.tensor(0.25 + 0.25 * step)
        assert compiled.step([x.clone() for x in grads], outs, coef)
        for p, x in zip(reference, grads):
            p.grad = x * coef
        stock.step()
        for p, q, out in zip(ours, reference, outs):
            torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
            assert torch.equal(out, p.to(torch.bfloat16))
    ours_state = compiled.optimizer.state_dict()["state"]
    ref_state = stock.state_dict()["state"]
    for i in ref_state:
        assert ours_state[i].keys() == ref_state[i].keys()
        assert float(ours_state[i]["step"]) == float(ref_state[i]["step"]) == 4
        torch.testing.assert_close(ours_state[i]["exp_avg_sq"], ref_state[i]["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_stays_as_close_to_fp64_as_torchs_fused_kernel(cls):
    """Over 60 steps, the compiled pass's distance from an fp64 run is the stock fused
    kernel's own: its constants (1 - beta2, -lr / bias_correction1, ...) are derived in
    double on the host. Derived in fp32 they drifted ~40% further."""
    g = torch.Generator().manual_seed(0)
    n = 200_000
    init = torch.randn(n, generator=g) * 0.05
    kwargs = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    exact = init.double()
    fp64 = cls([exact], **kwargs)
    fused_param = init.clone()
    fused = cls([fused_param], fused=True, **kwargs)
    ours = init.clone()
    compiled = CompiledAdamW(cls([ours], **kwargs))
    out = torch.empty(n, dtype=torch.bfloat16)
    for step in range(60):
        grad = torch.randn(n, generator=g) * (0.01 * (1 + step % 7)) + 0.001
        exact.grad = grad.double()
        fp64.step()
        fused_param.grad = grad.clone()
        fused.step()
        assert compiled.step([grad.clone()], [out], None)

    def distance(p):
        return float((p.double() - exact).abs().mean())

    assert distance(ours) <= 1.01 * distance(fused_param), (distance(ours), distance(fused_param))
    assert float((ours.double() - exact).abs().max()) <= 1.05 * float((fused_param.double() - exact).abs().max())


def test_applies_only_where_it_computes_the_same_thing():
    p = [torch.zeros(4)]
    assert applies_to(torch.optim.AdamW(p), torch.device("cpu"))
    assert not applies_to(torch.optim.AdamW(p, amsgrad=True), torch.device("cpu"))
    assert not applies_to(torch.optim.AdamW(p, maximize=True), torch.device("cpu"))
    assert not applies_to(torch.optim.SGD(p, lr=0.1), torch.device("cpu"))
    assert not applies_to(torch.optim.AdamW([torch.zeros(4, dtype=torch.bfloat16)]), torch.device("cpu"))
    assert not applies_to(torch.optim.AdamW(p), torch.device("cuda"))


def _train(opt, model, steps=3):
    for step in range(steps):
        for m in range(2):
            loss_fn(model, *batch(0, 0, step, m)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_zero1_uses_it_by_default_on_cpu_where_the_shards_are_large_enough_and_not_when_told_otherwise():
    """``compile_update=None`` compiles from ``COMPILE_MIN_NUMEL`` shard elements on the rank (below it
    torch's fused kernel is as fast) and with parameter remainders at any size (no fp32 shard in memory),
    True always, False never; a variant the caller chose is theirs."""
    def compiled(model, **kwargs):
        return Zero1Optimizer(model.parameters(), torch.optim.AdamW, **kwargs)._inner_step.compiled is not None

    small, large = make_model(), torch.nn.Linear(1024, 1024).bfloat16()  # 4.5K and 1.05M elements
    assert sum(p.numel() for p in large.parameters()) >= fused_adamw.COMPILE_MIN_NUMEL > 100 * sum(
        p.numel() for p in small.parameters())
    assert compiled(large) and not compiled(small)
    assert compiled(small, compile_update=True) and compiled(large, compile_update=True)
    assert not compiled(large, compile_update=False) and not compiled(large, fused=True)
    assert not compiled(large, foreach=True)
    remainders = MixedPrecisionConfig(use_param_remainders=True)
    assert compiled(small, mixed_precision=remainders) and not compiled(small, mixed_precision=remainders,
                                                                        compile_update=False)
    with pytest.raises(ValueError, match="compile_update=True"):
        Zero1Optimizer(small.parameters(), torch.optim.SGD, lr=0.1, compile_update=True)


@pytest.fixture
def compiled_by_default(monkeypatch):
    """``compile_update=None`` takes the compiled update for the small test model too."""
    monkeypatch.setattr(fused_adamw, "COMPILE_MIN_NUMEL", 0)


def test_a_missing_compiler_falls_back_to_the_stock_step(monkeypatch, compiled_by_default):
    expected = _train(*_opt_and_model(compile_update=False))

    def broken(fn=None):
        def kernel(*args):
            raise compiler_missing()
        return kernel

    monkeypatch.setattr(fused_adamw, "_kernel", broken)
    opt, model = _opt_and_model(compile_update=None)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        got = _train(opt, model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_real_error_in_the_kernel_surfaces(monkeypatch, compiled_by_default):
    def broken(fn=None):
        def kernel(*args):
            raise RuntimeError("shapes do not match")
        return kernel

    monkeypatch.setattr(fused_adamw, "_kernel", broken)
    opt, model = _opt_and_model(compile_update=None)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        _train(opt, model)


def _opt_and_model(compile_update):
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, compile_update=compile_update)
    return opt, model


def test_an_option_the_kernel_lacks_installed_by_a_load_is_computed_by_torchs_step():
    """A state dict saved with ``maximize=True`` installs it (it is a hyperparameter, not a kernel
    choice); the compiled update, chosen at construction without it, must then step as torch does,
    not silently minimise."""
    def build(**kwargs):
        torch.manual_seed(0)
        model = make_model(0)
        return model, Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, **kwargs)

    reference_model, reference = build(maximize=True, compile_update=False)
    model, opt = build(compile_update=True)
    opt.load_state_dict(reference.state_dict())
    assert all(group["maximize"] for group in opt.param_groups)
    for step in range(2):
        for m, o in ((reference_model, reference), (model, opt)):
            loss_fn(m, *batch(0, 0, step, 0)).backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p, q)


def test_a_step_under_a_users_dispatch_mode_runs_and_matches(tmp_path):
    """torch's debug and counting tools (FlopCounterMode, CommDebugMode, a profiler's mode) are
    TorchDispatchModes; under one, torch 2.10+ compiles nothing with fullgraph=True and raises.
    The compiled CPU kernels (the one-pass update, the norm's rows) then run as plain torch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    runs = []
    for mode in (None, Counting()):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).bfloat16()
        opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, max_norm=0.1, compile_update=True)
        assert opt._inner_step.compiling
        for step in range(3):
            model(torch.randn(8, 64, generator=torch.Generator().manual_seed(step)).bfloat16()).float().pow(2).sum().backward()
            if mode is None or step < 2:
                opt.step()
            else:
                with mode:
                    opt.step()
        runs.append(([p.detach().clone() for p in model.parameters()], opt.grad_norm.item(), mode))
    (plain, plain_norm, _), (under, under_norm, mode) = runs
    assert mode.calls > 0  # the step ran under the mode
    assert under_norm == pytest.approx(plain_norm, rel=1e-6)
    for a, b in zip(under, plain):  # the kernels as plain torch: the same arithmetic, last-bit rounding aside
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=float(b.float().abs().max()) * 2**-7)
