"""fp32 precision-sensitive ops, fp32 modules, dtype names and stochastic rounding,
each against an fp64 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nxd_smp import ConfigError, Zero1Optimizer
from nxd_smp import precision_ops as P
from tests.oracle import ulp_distance

BF16 = torch.bfloat16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def assert_rounded_from(actual: torch.Tensor, reference: torch.Tensor, max_ulp: int = 1):
    """``actual`` (low precision) is within ``max_ulp`` of the exact value rounded to its dtype."""
    expected = reference.to(actual.dtype)
    assert int(ulp_distance(actual, expected).max()) <= max_ulp


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max())


# ---------------------------------------------------------------- softmax family
@pytest.mark.parametrize("op, ref_op", [(P.softmax, torch.softmax), (P.log_softmax, torch.log_softmax)])
def test_softmax_family_matches_fp64_with_scale_and_masks(op, ref_op):
    x = (torch.randn(4, 3, 50, generator=gen()) * 6).to(BF16)
    keep = torch.rand(4, 1, 50, generator=gen(1)) > 0.3
    y = op(x, scale=0.5, mask=keep)
    ref = ref_op((x.double() * 0.5).masked_fill(~keep, torch.finfo(torch.float64).min), -1)
    assert y.dtype == BF16
    finite = torch.isfinite(ref)
    assert int(ulp_distance(y[finite], ref[finite].to(BF16)).max()) <= 1
    additive = torch.where(keep, 0.0, float("-inf"))
    assert torch.equal(op(x, scale=0.5, mask=additive, out_dtype=torch.float32)[keep.expand_as(x)],
                       op(x, scale=0.5, mask=keep, out_dtype=torch.float32)[keep.expand_as(x)])
    assert op(x, out_dtype=torch.float32).dtype == torch.float32


def test_fully_masked_row_is_not_nan():
    y = P.softmax(torch.randn(2, 5).to(BF16), mask=torch.zeros(2, 5, dtype=torch.bool))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("op", [P.softmax, P.log_softmax])
def test_softmax_family_gradients(op):
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True, generator=gen())
    mask = torch.rand(3, 7, generator=gen(2)) > 0.2
    # log_softmax of a masked entry is ~ -1.8e308: finite differences cannot see past it
    checked_mask = mask if op is P.softmax else None
    assert torch.autograd.gradcheck(lambda t: op(t, scale=0.7, mask=checked_mask), (x,))
    xb = x.detach().to(BF16).requires_grad_()
    w = torch.randn(3, 7, dtype=torch.float64, generator=gen(3))
    (op(xb, scale=0.7, mask=mask).double() * w).sum().backward()
    xr = xb.detach().double().requires_grad_()
    (op(xr, scale=0.7, mask=mask) * w).sum().backward()
    torch.testing.assert_close(xb.grad.double(), xr.grad, rtol=2e-2, atol=1e-2)


# ---------------------------------------------------------------- cross-entropy
def test_cross_entropy_matches_fp64_and_naive_bf16_is_worse():
    logits = (torch.randn(64, 32000, generator=gen()) * 3).to(BF16)
    target = torch.randint(0, 32000, (64,), generator=gen(1))
    target[::7] = -100
    ref = F.cross_entropy(logits.double(), target, ignore_index=-100)
    loss = P.cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    ours = abs(float(loss) - float(ref)) / float(ref)
    naive = abs(float(F.cross_entropy(logits, target)) - float(ref)) / float(ref)  # bf16 result
    assert ours < 1e-6 and naive > 20 * ours
    per = P.cross_entropy(logits, target, reduction="none")
    ref_per = F.cross_entropy(logits.double(), target, reduction="none")
    torch.testing.assert_close(per.double(), ref_per, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(P.cross_entropy(logits, target, reduction="sum").double(),
                               ref_per.sum(), rtol=1e-6, atol=1e-5)


def test_cross_entropy_chunks_give_the_same_result(monkeypatch):
    logits = torch.randn(2, 9, 300, generator=gen()).to(BF16).requires_grad_()
    target = torch.randint(0, 300, (2, 9), generator=gen(1))
    whole = P.cross_entropy(logits, target)
    whole.backward()
    g_whole = logits.grad.clone()
    logits.grad = None
    monkeypatch.setattr(P, "_CE_CHUNK_ELEMENTS", 600)  # two rows at a time
    chunked = P.cross_entropy(logits, target)
    chunked.backward()
    assert torch.equal(whole, chunked) and torch.equal(g_whole, logits.grad)


def test_cross_entropy_gradients():
    x = torch.randn(5, 11, dtype=torch.float64, requires_grad=True, generator=gen())
    t = torch.tensor([0, 3, -100, 10, 4])
    assert torch.autograd.gradcheck(lambda z: P.cross_entropy(z, t), (x,))
    xb = x.detach().to(BF16).requires_grad_()
    P.cross_entropy(xb, t).backward()
    xr = xb.detach().double().requires_grad_()
    F.cross_entropy(xr, t).backward()
    assert_rounded_from(xb.grad, xr.grad, max_ulp=1)


def test_cross_entropy_refuses_bad_input():
    with pytest.raises(ValueError, match="do not match"):
        P.cross_entropy(torch.randn(3, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="reduction"):
        P.cross_entropy(torch.randn(3, 5), torch.zeros(3, dtype=torch.long), reduction="avg")


# ---------------------------------------------------------------- norms and residual
@pytest.mark.parametrize("weight_dtype", [BF16, torch.float32])
def test_layer_norm_matches_fp64_where_naive_bf16_fails(weight_dtype):
    x = (100 + torch.randn(8, 256, generator=gen())).to(BF16)  # a large mean: bf16 statistics lose it
    w = (1 + 0.1 * torch.randn(256, generator=gen(1))).to(weight_dtype)
    b = (0.1 * torch.randn(256, generator=gen(2))).to(weight_dtype)
    ref = F.layer_norm(x.double(), (256,), w.double(), b.double())
    y = P.layer_norm(x, w, b)
    assert y.dtype == BF16
    assert_rounded_from(y, ref)
    xb = x.to(BF16)
    mean = xb.mean(-1, keepdim=True)  # every step rounded to bf16
    naive = ((xb - mean) / ((xb - mean).pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()) * w.to(BF16) + b.to(BF16)
    assert rel_err(naive, ref) > 5 * rel_err(y, ref)


def test_rms_norm_matches_fp64_and_has_gradients():
    x = torch.randn(4, 33, dtype=torch.float64, requires_grad=True, generator=gen())
    w = torch.randn(33, dtype=torch.float64, requires_grad=True, generator=gen(1))
    assert torch.autograd.gradcheck(lambda a, b: P.rms_norm(a, b), (x, w))
    xb = (x.detach() * 3).to(BF16)
    ref = xb.double() * torch.rsqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.detach()
    assert_rounded_from(P.rms_norm(xb, w.detach().to(BF16)), ref)


def test_layer_norm_gradients():
    x = torch.randn(3, 9, dtype=torch.float64, requires_grad=True, generator=gen())
    w = torch.randn(9, dtype=torch.float64, requires_grad=True, generator=gen(1))
    b = torch.randn(9, dtype=torch.float64, requires_grad=True, generator=gen(2))
    assert torch.autograd.gradcheck(P.layer_norm, (x, w, b))


def test_residual_add_keeps_an_fp32_stream_exact():
    stream = torch.full((1000,), 1.0)
    update = torch.full((1000,), 1e-3).to(BF16)
    out = stream
    for _ in range(100):
        out = P.residual_add(update, out)
    assert out.dtype == torch.float32
    naive = stream.to(BF16)
    for _ in range(100):
        naive = naive + update  # bf16 stream: 1 + 1e-3 rounds back to 1
    exact = 1 + 100 * float(update[0])
    assert abs(float(out[0]) - exact) < 1e-5 and abs(float(naive[0]) - exact) > 0.05
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    r = torch.randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(P.residual_add, (x, r))


# ---------------------------------------------------------------- fp32 modules
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = P.set_fp32_attr_to_module(nn.LayerNorm(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.norm(self.proj(x)))


def test_cast_model_keeps_marked_modules_fp32_and_casts_their_io():
    torch.manual_seed(0)
    model = P.cast_model(Block(), "torch.bfloat16")
    assert model.proj.weight.dtype == BF16 and model.head.weight.dtype == BF16
    assert model.norm.weight.dtype == torch.float32 and P.is_fp32_module(model.norm)
    seen = {}
    model.norm.register_forward_hook(lambda m, args, out: seen.update(inp=args[0].dtype))
    y = model(torch.randn(2, 8).to(BF16))
    assert seen["inp"] == torch.float32 and y.dtype == BF16
    P.cast_model(model, BF16)  # again: hooks are replaced, not stacked
    assert model(torch.randn(2, 8).to(BF16)).dtype == BF16


def test_naive_amp_model_casts_inputs_and_optionally_outputs():
    torch.manual_seed(0)
    amp = P.NaiveAMPModel(Block(), output_to_fp32=True, dtype=BF16)
    assert amp(torch.randn(2, 8)).dtype == torch.float32  # fp32 input accepted, fp32 out
    assert P.NaiveAMPModel(Block(), output_to_fp32=False)(torch.randn(2, 8)).dtype == BF16


def test_naive_amp_model_takes_internevos_call_shapes():
    model = Block()
    amp = P.NaiveAMPModel(model=model, output_to_fp32=True, dtype=torch.bfloat16, sync_buffer=False)
    assert amp(torch.randn(2, 8)).dtype == torch.float32
    positional = P.NaiveAMPModel(Block(), True, None, True, torch.float16)  # InternEvo's order
    assert positional.dtype == torch.float16 and positional.model.proj.weight.dtype == torch.float16
    assert positional.model.norm.weight.dtype == torch.float32  # marked fp32 stays fp32
    assert not positional.sync_buffer  # a single process: nothing to synchronise
    with pytest.raises(TypeError, match="parallel_mode"):
        P.NaiveAMPModel(Block(), parallel_mode="data")
    with pytest.raises(ConfigError, match="sync_buffer"):
        P.NaiveAMPModel(Block(), sync_buffer="yes")


class WithBuffer(nn.Module):
    def __init__(self, value: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), value))
        self.register_buffer("count", torch.tensor(int(value)))

    def forward(self, x):
        return self.lin(x) * self.scale


def _sync_buffer_worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    amp = P.NaiveAMPModel(WithBuffer(float(rank + 2)), parallel_mode=dist.group.WORLD)
    out = {"sync": amp.sync_buffer}
    amp(torch.ones(1, 4))
    out["train"] = (amp.model.scale.float().clone(), int(amp.model.count))
    amp.model.scale.fill_(10.0 + rank)
    amp.eval()
    amp(torch.ones(1, 4))  # the first forward after eval() synchronises
    out["first_eval"] = amp.model.scale.float().clone()
    amp.model.scale.fill_(20.0 + rank)
    amp(torch.ones(1, 4))  # later eval forwards do not
    out["later_eval"] = amp.model.scale.float().clone()
    return out


def test_naive_amp_model_broadcasts_buffers_over_the_data_parallel_group():
    from tests.distributed import run_ranks

    r0, r1 = run_ranks(2, _sync_buffer_worker)
    assert r0["sync"] and r1["sync"]
    for r in (r0, r1):
        assert torch.equal(r["train"][0], torch.full((4,), 2.0)) and r["train"][1] == 2  # rank 0's
        assert torch.equal(r["first_eval"], torch.full((4,), 10.0))
    assert torch.equal(r1["later_eval"], torch.full((4,), 21.0))


def test_marked_modules_stay_fp32_through_zero1_training():
    torch.manual_seed(0)
    model = P.cast_model(Block(), BF16)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    assert {layout.key[1] for layout in opt.bucket_layouts} == {BF16, torch.float32}
    before = model.norm.weight.detach().clone()
    for _ in range(3):
        model(torch.randn(4, 8).to(BF16)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert model.norm.weight.dtype == torch.float32 and model.proj.weight.dtype == BF16
    assert not torch.equal(model.norm.weight, before)


# ---------------------------------------------------------------- dtype names
@pytest.mark.parametrize("name, dtype", [
    ("torch.float16", torch.float16), ("torch.half", torch.float16), ("torch.bfloat16", BF16),
    ("torch.float32", torch.float32), ("torch.tf32", torch.float32), (torch.bfloat16, BF16),
])
def test_parse_dtype(name, dtype):
    assert P.parse_dtype(name) == dtype


@pytest.mark.parametrize("bad", ["bf16", "torch.int8", torch.int8, "float32", None])
def test_parse_dtype_refuses_listing_the_accepted_names(bad):
    with pytest.raises(ConfigError, match="torch.tf32"):
        P.parse_dtype(bad)


def test_tf32_flags_are_set_only_on_cuda():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert P.apply_dtype("torch.tf32", "cpu") == torch.float32
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert P.apply_dtype("torch.tf32", "cuda") == torch.float32
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ---------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
    x = torch.randn(64, generator=gen()) * 3
    draws = torch.stack([P.stochastic_round(x, generator=gen(i)) for i in range(4000)]).double()
    spacing = torch.tensor([float(torch.finfo(BF16).eps) * 2 ** float(torch.floor(torch.log2(v.abs()))) for v in x],
                           dtype=torch.float64)
    # each draw is one of the two bf16 values around x
    assert ((draws - x.double()).abs() <= spacing + 1e-12).all()
    # the mean is x to within 5 standard errors (the per-draw sd is at most spacing / 2)
    se = spacing / 2 / (4000 ** 0.5)
    assert ((draws.mean(0) - x.double()).abs() <= 5 * se).all()


@pytest.mark.parametrize("value", [1 - 3e-4, -(1 - 3e-4), 2 + 3e-3, 1.5e-40, -4e-39, 3.0e38])
def test_stochastic_rounding_is_unbiased_at_binade_edges_and_among_subnormals(value):
    """Just below a power of two the bf16 spacing halves; among subnormals it is 2^-133."""
    x = torch.full((4000,), value)
    draws = P.stochastic_round(x, generator=gen(3)).double()
    values = sorted(set(draws.tolist()))
    assert len(values) == 2 and values[0] < value < values[1]  # the two neighbours
    spacing = values[1] - values[0]
    assert abs(float(draws.mean()) - value) <= 5 * spacing / 2 / 4000**0.5


def test_stochastic_rounding_is_reproducible_and_exact_on_representable_values():
    x = torch.randn(1000, generator=gen())
    assert torch.equal(P.stochastic_round(x, generator=gen(5)), P.stochastic_round(x, generator=gen(5)))
    exact = x.to(BF16).float()
    assert torch.equal(P.stochastic_round(exact, generator=gen(6)), exact.to(BF16))
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0])
    out = P.stochastic_round(special)
    assert out[0] == float("inf") and out[1] == float("-inf") and out[2].isnan() and out[3] == 0
    with pytest.raises(ValueError, match="fp32"):
        P.stochastic_round(x.to(BF16))


def test_small_updates_stall_in_bf16_and_track_fp32_with_stochastic_rounding():
    """SGD on bf16 weights with steps far below half an ulp: round-to-nearest never moves,
    stochastic rounding follows the fp32 trajectory on average."""
    w0 = torch.full((4096,), 1.0)
    step = -1e-4  # the bf16 spacing at 1.0 is 2^-7 = 7.8e-3
    fp32 = w0 + 200 * step
    nearest = w0.to(BF16)
    sr = w0.to(BF16)
    g = gen(0)
    for _ in range(200):
        nearest = (nearest.float() + step).to(BF16)
        sr = P.stochastic_round(sr.float() + step, generator=g)
    assert torch.equal(nearest.float(), w0)  # stalled
    assert abs(float(sr.float().mean()) - float(fp32.mean())) < 1e-3  # tracks 0.98
