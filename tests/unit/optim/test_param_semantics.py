"""torch's parameter semantics with a Zero1Optimizer (issue 31): a parameter frozen at step time is
not touched on any kernel path, at any DP size; one frozen at the build stays unmanaged and is
refused once unfrozen; a ``clip_grad_norm_`` that finds no ``.grad`` says where the gradients are;
and ``torch.compile`` of the step runs the eager step, with nxd_smp's own compiled kernels inside.
(The frozen parameters against the torch.optim oracle: tests/unit/optim/test_zero1_oracle.py.)"""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn as nn

from nxd_smp import DynamicLossScaler, MixedPrecisionConfig, Zero1Optimizer
from tests.distributed import run_python, run_ranks
from tests.oracle import assert_params_close, batch, loss_fn, make_model, param_groups

ROOT = Path(__file__).resolve().parents[3]
FROZEN = ("lin2.weight", "kernel", "temperature")  # (several buckets; at DP 2 they straddle shards)
CAP = 0.0004  # ~100 fp32 elements a bucket


def backward(model, step=0, micro=2, rank=0, scale=lambda loss: loss, dtype=torch.bfloat16):
    for m in range(micro):
        x, y = batch(0, rank, step, m, dtype=dtype)
        scale(loss_fn(model, x, y)).backward()


# ---------------------------------------------------------------- frozen at step time: every kernel
@dataclass(frozen=True)
class Path:
    """One kernel path of the step: the inner optimizer, its options and the wrapper's."""

    name: str
    optimizer: str = "AdamW"
    opt_kwargs: dict[str, Any] = field(default_factory=dict)
    precision: dict[str, bool] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16


LEGACY = {"use_master_weights": False, "use_fp32_grad_acc": False}
PATHS = [
    Path("compiled_adamw", extra={"compile_update": True}),  # CPU: the one-pass update, which writes the parameters
    Path("fused_adamw", extra={"compile_update": False}),
    Path("foreach_adamw", opt_kwargs={"foreach": True}),  # the plain path: gradients scaled in place
    Path("fused_sgd", "SGD", {"momentum": 0.9}),
    Path("foreach_sgd", "SGD", {"momentum": 0.9, "foreach": True}),
    Path("remainders_compiled", precision={"use_param_remainders": True}, extra={"compile_update": True}),
    Path("remainders_stock", precision={"use_param_remainders": True}, extra={"compile_update": False}),
    Path("sharded_accumulation", precision={"use_sharded_grad_acc": True}),
    Path("legacy_bf16_shards", precision=LEGACY),  # the shard is the parameters' own memory
    Path("stochastic_rounding", precision=LEGACY, extra={"stochastic_rounding": True}),
    Path("fp16_loss_scaler", extra={"loss_scaler": True}, dtype=torch.float16),
]


def build(path: Path, model: nn.Module) -> Zero1Optimizer:
    extra = dict(path.extra)
    if extra.pop("loss_scaler", False):
        extra["loss_scaler"] = DynamicLossScaler(init_scale=16.0)
    return Zero1Optimizer(param_groups(model, lr_a=1e-2, lr_b=3e-2), getattr(torch.optim, path.optimizer),
                          mixed_precision=MixedPrecisionConfig(**path.precision), max_norm=0.5, bucket_cap_mb=CAP,
                          **extra, **path.opt_kwargs)


def frozen_elements(opt: Zero1Optimizer, model: nn.Module) -> dict[str, Any]:
    """What this rank holds of the FROZEN parameters: their values, and their elements of its master
    shards and of every shard-shaped state tensor; and each managed parameter's ``step`` counter, by name
    (``opt.state``'s view, what its state dict holds)."""
    names = {id(p): n for n, p in model.named_parameters()}
    masters, shards = opt.master_shards, opt.inner_shards
    held: dict[str, dict[str, list[torch.Tensor]]] = {n: {} for n in FROZEN}
    counters = {names[id(p)]: float(opt.state[p]["step"]) for p in opt.managed_params if "step" in opt.state[p]}
    for b, layout in enumerate(opt.bucket_layouts):
        state = opt.inner_optimizer.state.get(shards[b], {})
        tensors = {"master": masters[b], **{k: v for k, v in state.items()
                                            if isinstance(v, torch.Tensor) and v.numel() == layout.shard_numel}}
        for piece in layout.pieces(opt.rank):
            name = names[id(opt.managed_params[layout.param_indices[piece.index]])]
            if name in held:
                for key, t in tensors.items():
                    part = t[piece.shard_start:piece.shard_start + piece.numel].clone()
                    held[name].setdefault(key, []).append(part)
    named = dict(model.named_parameters())
    return {"params": {n: named[n].detach().clone() for n in FROZEN}, "held": held, "counters": counters,
            "moving": named["lin1.weight"].detach().clone()}


def frozen_runs(rank: int, world: int, paths: list[Path]) -> dict[tuple[str, int], tuple[dict, dict]]:
    """Per path and first frozen step (0: before any state exists; 1: after one step): what this
    rank holds of the frozen parameters when they froze and two steps later."""
    out = {}
    for path in paths:
        for freeze_at in (0, 1):
            model = make_model(0, dtype=path.dtype)
            opt = build(path, model)
            named = dict(model.named_parameters())
            for step in range(freeze_at + 2):
                if step == freeze_at:
                    for n in FROZEN:
                        named[n].requires_grad_(False)
                    before = frozen_elements(opt, model)
                backward(model, step, rank=rank, scale=opt.scale_loss, dtype=path.dtype)
                opt.step()
                opt.zero_grad()
            out[(path.name, freeze_at)] = (before, frozen_elements(opt, model))
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=lambda n: f"dp{n}")
def frozen(request):
    return request.param, run_ranks(request.param, frozen_runs, PATHS)


@pytest.mark.parametrize("freeze_at", [0, 1], ids=["from_the_first_step", "after_a_step"])
@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_a_parameter_frozen_at_step_time_is_not_touched(frozen, path, freeze_at):
    """Its value on every rank, this rank's master and state elements of it, bit for bit, while the
    others train; a state the frozen steps created holds zeros there (a fresh state's value); its step
    counter stands still while the others' advance, as torch's per-parameter counters do."""
    world, ranks = frozen
    for rank, results in enumerate(ranks):
        before, after = results[(path.name, freeze_at)]
        for n in FROZEN:
            assert torch.equal(after["params"][n], before["params"][n]), (rank, n)
            assert world > 1 or after["held"][n], n  # (at DP 1 this rank holds every element)
            if freeze_at == 1:  # the state existed: the same keys
                assert after["held"][n].keys() == before["held"][n].keys(), (rank, n)
            for key, parts in after["held"][n].items():
                old = before["held"][n].get(key)  # (None: created by a frozen step)
                for i, part in enumerate(parts):
                    assert torch.equal(part, torch.zeros_like(part) if old is None else old[i]), (rank, n, key)
        assert not torch.equal(after["moving"], before["moving"])  # the others trained
        if path.optimizer == "AdamW":  # the frozen ones' counters stood still, the others' went on
            assert after["counters"] and after["counters"].keys() == before["counters"].keys()
            for name, count in after["counters"].items():
                assert count == before["counters"][name] + (0 if name in FROZEN else 2), (rank, name)


def test_a_gradient_accumulated_before_the_parameter_froze_counts_nowhere():
    """Frozen after its backward: its gradient is neither applied nor part of the norm."""
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, max_norm=math.inf)
    backward(model)
    others = [p for p in opt.managed_params if p is not model.lin2.weight]
    expected = math.sqrt(sum(float(opt.main_grad(p).double().pow(2).sum()) for p in others))
    assert float(opt.main_grad(model.lin2.weight).abs().sum()) > 0
    before = model.lin2.weight.detach().clone()
    model.lin2.weight.requires_grad_(False)
    opt.step()
    assert torch.equal(model.lin2.weight, before)
    assert float(opt.grad_norm) == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- frozen at the build
def test_a_parameter_frozen_at_the_build_gets_no_masters_no_buffers_and_no_hook():
    """What LoRA's memory rests on: the frozen parameter has no element in any bucket (so none in the
    fp32 masters, states or main_grad buffers), and no hook takes its gradient."""
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, bucket_cap_mb=math.inf)
    assert all(p is not model.frozen for p in opt.managed_params)
    (layout,) = opt.bucket_layouts
    assert layout.numel == sum(p.numel() for p in opt.managed_params)
    assert [m.numel() for m in opt.master_shards] == [layout.padded_numel] == [b.numel() for b in opt._grads.buffers]
    with pytest.raises(ValueError, match="not managed"):
        opt.main_grad(model.frozen)
    model.frozen.requires_grad_(True)
    backward(model)
    assert model.frozen.grad is not None  # autograd's, untouched: no hook of the optimizer's


def test_a_parameter_unfrozen_after_the_build_is_refused_with_nothing_changed():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model)
    opt.step()
    model.frozen.requires_grad_(True)
    backward(model, step=1)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    generation, norm = opt.state_generation, opt.grad_norm
    with pytest.raises(RuntimeError, match=r"shape \(4,\) had requires_grad=False when this optimizer was built.*"
                                           r"Build the optimizer after unfreezing it"):
        opt.step()
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert opt.state_generation == generation and opt.grad_norm is norm
    model.frozen.requires_grad_(False)  # frozen again: the step runs on what was accumulated
    opt.step()
    assert not torch.equal(model.lin1.weight, params["lin1.weight"])


def test_parameters_the_optimizer_was_not_given_are_not_its_business():
    model = make_model()
    opt = Zero1Optimizer(list(model.lin1.parameters()), torch.optim.SGD, lr=0.1)
    model.frozen.requires_grad_(True)  # trained by another optimizer, or by nothing
    frozen, weight = model.frozen.detach().clone(), model.lin1.weight.detach().clone()
    backward(model)
    opt.step()  # (no refusal: the optimizer was never given it)
    assert torch.equal(model.frozen, frozen) and not torch.equal(model.lin1.weight, weight)


def test_the_parameters_frozen_at_the_build_are_held_weakly():
    trained = nn.Parameter(torch.randn(5).bfloat16())
    dropped = nn.Parameter(torch.randn(3).bfloat16(), requires_grad=False)
    opt = Zero1Optimizer([trained, dropped], torch.optim.SGD, lr=0.1)
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None
    trained.float().sum().backward()
    opt.step()


# ---------------------------------------------------------------- clip_grad_norm_ without .grad
NO_GRAD = "clip_grad_norm_ found no .grad"


def torch_clip(parameters, max_norm):
    """torch's own clip_grad_norm_ under its module's name, which torch_xla leaves alone (imported in
    this process, it puts at torch.nn.utils its own, whose result on no .grad is an XLA tensor: that
    would start the XLA runtime here)."""
    return torch.nn.utils.clip_grad.clip_grad_norm_(parameters, max_norm)


def clip_warnings(model, opt, clip=None, steps=2) -> list[warnings.WarningMessage]:
    """A plain loop, ``clip(model.parameters(), 1.0)`` before each step where given."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            backward(model, step)
            if clip is not None:
                clip(model.parameters(), 1.0)
            opt.step()
    return [w for w in caught if NO_GRAD in str(w.message)]


@pytest.mark.parametrize("where", ["torch.nn.utils", "torch.nn.utils.clip_grad"])
def test_a_clip_grad_norm_that_finds_no_grad_warns_once_per_optimizer(where):
    if where == "torch.nn.utils" and "torch_xla" in sys.modules:
        pytest.skip("torch_xla put its own function at torch.nn.utils in this process (its own test: a child process)")
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    module = torch.nn.utils if where == "torch.nn.utils" else torch.nn.utils.clip_grad
    norms = []
    caught = clip_warnings(model, opt, lambda ps, m: norms.append(module.clip_grad_norm_(ps, m)))
    assert len(caught) == 1 and caught[0].category is UserWarning
    message = str(caught[0].message)
    assert "max_norm" in message and "optimizer.grad_norm" in message and "Zero1TrainerCallback" in message
    assert caught[0].filename == __file__  # (it points at the loop's call)
    assert all(float(n) == 0.0 for n in norms)  # what torch measured: nothing
    again = Zero1Optimizer(model.parameters(), torch.optim.AdamW)  # another optimizer says it again
    assert len(clip_warnings(model, again, lambda ps, m: module.clip_grad_norm_(ps, m))) == 1


def test_no_warning_where_the_loop_does_not_clip_or_the_gradients_are_in_grad():
    model = make_model()
    assert clip_warnings(model, Zero1Optimizer(model.parameters(), torch.optim.AdamW)) == []
    model = make_model()  # fp32 accumulation off: autograd's .grad, which torch's clipping measures
    legacy = Zero1Optimizer(model.parameters(), torch.optim.AdamW,
                            mixed_precision=MixedPrecisionConfig(use_master_weights=False, use_fp32_grad_acc=False))
    norms = []
    assert clip_warnings(model, legacy, lambda ps, m: norms.append(torch_clip(ps, m))) == []
    assert all(float(n) > 0 for n in norms)
    model = make_model()  # nothing accumulated yet (or any more): nothing missed
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch_clip(model.parameters(), 1.0)
        backward(model)
        opt.step()
        torch_clip(model.parameters(), 1.0)


def test_the_trainer_callback_routes_clipping_to_the_optimizer_and_silences_it():
    from nxd_smp.interop.hf_trainer import Zero1TrainerCallback

    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    state = SimpleNamespace(log_history=[], global_step=0)
    Zero1TrainerCallback().on_train_begin(SimpleNamespace(max_grad_norm=1.0), state, None, optimizer=opt)
    assert clip_warnings(model, opt, torch_clip) == []


def test_the_wrapper_is_installed_once_and_calls_what_it_wraps_unchanged():
    from nxd_smp.optim import clip_watch

    Zero1Optimizer(make_model().parameters(), torch.optim.AdamW)  # (installs it)
    # (torch_xla puts its own function at torch.nn.utils on import: then the two names differ)
    installed = (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_)
    for fn in installed:
        assert fn._nxd_smp_clip_watch and not getattr(fn.__wrapped__, "_nxd_smp_clip_watch", False)
    Zero1Optimizer(make_model().parameters(), torch.optim.AdamW)
    assert (torch.nn.utils.clip_grad_norm_, torch.nn.utils.clip_grad.clip_grad_norm_) == installed

    calls = []

    def spy(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        calls.append((parameters, [p for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters)],
                      max_norm, norm_type, error_if_nonfinite, foreach))
        return "result"

    wrapper = clip_watch._wrap(spy)
    params = list(make_model().parameters())
    assert wrapper((p for p in params), 0.5, 3.0, error_if_nonfinite=True, foreach=False) == "result"
    given, seen, *rest = calls[-1]
    assert isinstance(given, types.GeneratorType) and seen == params and rest == [0.5, 3.0, True, False]
    wrapper(params[0], 1.0)
    assert calls[-1][0] is params[0]
    wrapper(iter(params), 1.0)  # a one-shot iterator: torch reads it once, so does the wrapper
    assert calls[-1][1] == params

    torch.manual_seed(0)  # torch's own function behind the wrapper: the same result, its own warning
    plain = nn.Linear(8, 4)
    plain(torch.randn(3, 8)).sum().backward()
    grads = [p.grad.clone() for p in plain.parameters()]
    results = []
    for fn in (installed[1], installed[1].__wrapped__):
        for p, g in zip(plain.parameters(), grads):
            p.grad = g.clone()
        results.append((fn(plain.parameters(), 0.1), [p.grad.clone() for p in plain.parameters()]))
    assert torch.equal(results[0][0], results[1][0]) and all(map(torch.equal, results[0][1], results[1][1]))
    with pytest.warns(UserWarning, match="empty generator"):  # a generator stays one
        installed[1]((p for p in []), 1.0)


XLA_CLIP = """
import warnings, torch
import torch_xla  # (puts its own clip_grad_norm_ at torch.nn.utils)
import nxd_smp
from tests.oracle import batch, loss_fn, make_model
theirs = torch.nn.utils.clip_grad_norm_
model = make_model()
opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW)
assert torch.nn.utils.clip_grad_norm_.__wrapped__ is theirs
loss_fn(model, *batch(0, 0, 0, 0)).backward()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
assert sum("clip_grad_norm_ found no .grad" in str(w.message) for w in caught) == 1, caught
"""


def test_torch_xlas_own_clip_grad_norm_is_watched_too():
    """torch_xla replaces torch.nn.utils.clip_grad_norm_ on import; an optimizer built after it (as on
    an XLA device) wraps that one."""
    pytest.importorskip("torch_xla", reason="torch_xla is part of the pinned test environment")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16")}
    out = run_python(["-c", XLA_CLIP], timeout=300, cwd=ROOT, env={**env, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]


# ---------------------------------------------------------------- torch.compile
def compiled_steps(rank: int, world: int, compile_updates: list) -> dict:
    """Eager, ``torch.compile(opt.step)`` and a compiled function that calls ``opt.step()``, each
    from the same start: the parameters and norms after three steps."""
    out = {}
    for compile_update in compile_updates:
        for mode in ("eager", "compiled_step", "compiled_function"):
            torch._dynamo.reset()
            model = make_model()
            opt = Zero1Optimizer(param_groups(model, lr_a=1e-2, lr_b=3e-2), torch.optim.AdamW, max_norm=0.5,
                                 bucket_cap_mb=CAP, compile_update=compile_update)
            step = opt.step
            if mode == "compiled_step":
                step = torch.compile(opt.step)
            elif mode == "compiled_function":
                step = torch.compile(lambda: opt.step())
            norms = []
            for s in range(3):
                backward(model, s, rank=rank)
                step()
                norms.append(opt.grad_norm.clone())
            out[(compile_update, mode)] = ({n: p.detach().clone() for n, p in model.named_parameters()}, norms)
    return out


@pytest.mark.parametrize("world", [1, 2], ids=lambda n: f"dp{n}")
def test_a_compiled_step_equals_the_eager_step(world):
    """At DP 1 and 2, with the compiled CPU update (``compile_update=True``) and without it
    (False, where inductor once ran a silently different program at DP 2; also what None chooses for
    a model this small, ``COMPILE_MIN_NUMEL``): bit for bit."""
    updates = [True, False]
    for rank, results in enumerate(run_ranks(world, compiled_steps, updates)):
        for compile_update in updates:
            params, norms = results[(compile_update, "eager")]
            for mode in ("compiled_step", "compiled_function"):
                got, got_norms = results[(compile_update, mode)]
                assert all(torch.equal(got[n], params[n]) for n in params), (rank, compile_update, mode)
                assert all(torch.equal(a, b) for a, b in zip(got_norms, norms)), (rank, compile_update, mode)


def _kernel_calls(prof) -> int:
    return sum("CompiledFxGraph" in event.name for event in prof.events())


def test_under_torch_compile_the_step_still_runs_nxd_smps_own_compiled_kernels():
    """The step runs eagerly under torch.compile, and the kernels nxd_smp compiles itself (the CPU
    AdamW update and the norm) still run compiled inside it: as many inductor graphs per step as in
    the eager step, the same result bit for bit."""

    def run(compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = nn.Linear(64, 64).bfloat16()  # (4160 elements: the norm's compiled kernel runs too)
        opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, max_norm=0.5, compile_update=True)
        step = torch.compile(opt.step) if compiled else opt.step
        calls = []
        for s in range(3):
            model(torch.randn(4, 64, generator=torch.Generator().manual_seed(s)).bfloat16()).float().pow(2).mean() \
                .backward()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                step()
            calls.append(_kernel_calls(prof))
        return [p.detach().clone() for p in model.parameters()], calls

    eager, eager_calls = run(False)
    compiled, compiled_calls = run(True)
    assert min(eager_calls) >= 2 and compiled_calls == eager_calls
    assert all(torch.equal(a, b) for a, b in zip(compiled, eager))


def test_importing_nxd_smp_leaves_dynamo_unimported():
    """The step's ``torch.compiler.disable`` is applied at the first build, not at import."""
    code = "import sys, nxd_smp; assert 'torch._dynamo' not in sys.modules, 'import nxd_smp imported dynamo'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]


def test_fullgraph_compilation_of_the_step_is_refused_with_the_way_out():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    backward(model)
    with pytest.raises(Exception, match=r"torch\.compile runs nxd_smp's Zero1Optimizer\.step eagerly.*fullgraph"):
        torch.compile(opt.step, fullgraph=True)()


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).bfloat16()


def _mlp_batches():
    g = torch.Generator().manual_seed(0)
    return [[(torch.randn(8, 16, generator=g).bfloat16(), torch.randn(8, 4, generator=g)) for _ in range(2)]
            for _ in range(3)]


def test_a_compiled_model_trains_with_the_optimizer_as_the_oracle_does_and_as_the_eager_model():
    """``torch.compile(model)``: the optimizer's hooks take each micro-batch's gradient from the
    compiled backward, and the step is the oracle's on those gradients (the same compiled model
    without the optimizer, an fp32 AdamW on fp32 copies, clipping at 0.5); and the run ends where the
    eager model's run with the optimizer does (up to inductor's rounding, none on this model)."""
    torch._dynamo.reset()
    model, reference, eager = _mlp(), _mlp(), _mlp()
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, max_norm=0.5)
    eager_opt = Zero1Optimizer(eager.parameters(), torch.optim.AdamW, lr=1e-2, max_norm=0.5)
    masters = [p.detach().float().clone() for p in reference.parameters()]
    inner = torch.optim.AdamW(masters, lr=1e-2)
    compiled, compiled_reference = torch.compile(model), torch.compile(reference)
    for micro_batches in _mlp_batches():
        acc = [torch.zeros(p.shape) for p in reference.parameters()]
        for x, y in micro_batches:
            (compiled(x).float() - y).pow(2).mean().backward()
            assert all(p.grad is None for p in model.parameters())  # the hooks took them
            (eager(x).float() - y).pow(2).mean().backward()
            reference.zero_grad()
            (compiled_reference(x).float() - y).pow(2).mean().backward()
            acc = [a + p.grad.float() for a, p in zip(acc, reference.parameters())]
        opt.step()
        eager_opt.step()
        norm = math.sqrt(sum(float(a.double().pow(2).sum()) for a in acc))
        coef = min(1.0, 0.5 / (norm + 1e-6))
        for m, a in zip(masters, acc):
            m.grad = a * coef
        inner.step()
        with torch.no_grad():
            for p, m in zip(reference.parameters(), masters):
                p.copy_(m.to(p.dtype))
        assert float(opt.grad_norm) == pytest.approx(norm, rel=1e-5)
    got = {n: p.detach() for n, p in model.named_parameters()}
    assert_params_close(got, {n: p.detach() for n, p in reference.named_parameters()})
    assert_params_close(got, {n: p.detach() for n, p in eager.named_parameters()})
