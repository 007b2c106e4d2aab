"""The local sum of squares against an fp64 oracle, compiled and eager, and the clip
coefficient's rule."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from nxd_smp.optim import norm as grad_norm
from nxd_smp.optim.norm import clip_coefficient, sum_of_squares


def fp64_sum_of_squares(tensors: list[torch.Tensor]) -> float:
    return math.fsum(float((t.double() ** 2).sum()) for t in tensors)


def gradients(sizes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over several decades, as gradients of different layers have
    return [(torch.randn(s, generator=g) * 10.0 ** (i % 5 - 4)).to(dtype) for i, s in enumerate(sizes)]


SIZES = [(), (1,), (255,), (256,), (257,), (3, 1000), (513, 7), (1 << 21) + 37]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_of_squares_matches_fp64(compiled, dtype):
    tensors = gradients([s if isinstance(s, tuple) else (s,) for s in SIZES], dtype)
    got = sum_of_squares(tensors, torch.device("cpu"), compiled)
    assert got.dtype == torch.float32 and got.dim() == 0
    want = fp64_sum_of_squares(tensors)
    # fp32 rounding of the result (eager: each fp32 square summed in fp64; compiled: rows of 256 in fp32)
    assert abs(float(got) - want) <= 2e-7 * want


def _norms_at(rank: int, world: int, compile_update: bool) -> list[float]:
    """The optimizer's norm of the gradients rank 0 holds (the others hold zeros, so their sum is
    rank 0's exactly), over five draws of magnitudes across decades: on ``world`` ranks each holds
    its own cut of each bucket."""
    from nxd_smp import Zero1Optimizer

    norms = []
    for seed in range(5):
        params = [torch.nn.Parameter(torch.zeros(s)) for s in (4099, 777, 70001, 3)]
        opt = Zero1Optimizer(params, torch.optim.AdamW, max_norm=math.inf, compile_update=compile_update,
                             bucket_cap_mb=0.1, grad_reduction="sum")
        for p, g in zip(params, gradients([p.shape for p in params], torch.float32, seed), strict=True):
            p.grad = g if rank == 0 else torch.zeros_like(g)
        opt.step()
        norms.append(float(opt.grad_norm))
    return norms


def test_the_norm_is_the_same_at_any_dp_size():
    """The shards cut the gradient differently at each DP size; the norm must not see the cuts
    (else a run at DP 2 clips by another last bit than at DP 1, and the runs part). The eager
    path (what ``compile_update=None`` takes below ``COMPILE_MIN_NUMEL``); the compiled rows
    kernel rounds each row of 256 in fp32, ~1e-10 off, so a cut flips the last bit rarely."""
    from tests.distributed import run_ranks

    single = _norms_at(0, 1, False)
    for world in (2, 3):
        for rank, norms in enumerate(run_ranks(world, _norms_at, False)):
            assert norms == single, (world, rank, norms, single)


def test_the_compiled_sum_is_accurate_where_torchs_norm_is_not():
    # 8M elements of similar size: torch's CPU norm keeps one fp32 running sum per thread
    # and drifts by ~1e-3; rows of 256 summed in fp64 stay at fp32 rounding of the result.
    x = torch.full((1 << 23,), 0.1) + torch.rand(1 << 23, generator=torch.Generator().manual_seed(1)) * 1e-3
    want = fp64_sum_of_squares([x])
    naive = float(torch.linalg.vector_norm(x)) ** 2
    got = float(sum_of_squares([x], torch.device("cpu"), compiled=True))
    assert abs(got - want) <= 1e-6 * want
    assert abs(naive - want) > 1e-6 * want, "the oracle should separate the two here"


def test_empty_and_zero():
    assert float(sum_of_squares([], torch.device("cpu"), compiled=True)) == 0.0
    assert float(sum_of_squares([torch.zeros(1000)], torch.device("cpu"), compiled=True)) == 0.0


def test_a_missing_compiler_warns_once_and_falls_back(monkeypatch):
    from tests.crafted import compiler_missing

    def broken(fn):
        raise compiler_missing()

    monkeypatch.setattr(grad_norm, "_compiled_rows", None)
    monkeypatch.setattr(grad_norm, "compile_cpu_kernel", broken)
    tensors = gradients([(1000,), (300,)], torch.float32)
    want = fp64_sum_of_squares(tensors)
    with pytest.warns(UserWarning, match="(?s)gradient-norm kernel failed.*no C\\+\\+ compiler"):
        first = sum_of_squares(tensors, torch.device("cpu"), compiled=True)
    assert abs(float(first) - want) <= 1e-6 * want
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        again = sum_of_squares(tensors, torch.device("cpu"), compiled=True)
    assert float(again) == float(first)


@pytest.mark.parametrize(
    "norm, clipping, max_norm, want",
    [(4.0, True, 1.0, 1.0 / (4.0 + 1e-6)), (0.5, True, 1.0, 1.0), (4.0, False, 1.0, None), (4.0, True, math.inf, None)],
)
def test_clip_coefficient(norm, clipping, max_norm, want):
    got = clip_coefficient(torch.tensor(norm), clipping, max_norm)
    if want is None:
        assert got is None
    else:
        assert float(got) == pytest.approx(want, rel=1e-7)


def test_a_real_error_in_the_norm_kernel_surfaces(monkeypatch):
    def broken(fn):
        def kernel(*args):
            raise RuntimeError("shapes do not match")
        return kernel

    monkeypatch.setattr(grad_norm, "_compiled_rows", None)
    monkeypatch.setattr(grad_norm, "compile_cpu_kernel", broken)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        sum_of_squares(gradients([(1000,)], torch.float32), torch.device("cpu"), compiled=True)
