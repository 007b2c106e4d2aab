"""A plain, unsharded reference for the sharded optimizer, and the test model and data.

The oracle is standard mixed precision (docs/design.md) written out as a loop in one process: per rank and
micro-batch a bf16 forward/backward, gradients summed in the accumulation dtype, summed
over ranks in the wire dtype, divided by the number of ranks, clipped by the global fp32
norm, one stock ``torch.optim`` step on separate master copies, and the result cast back
into the bf16 model. No buckets, no padding, no collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

IN, HIDDEN, OUT = 7, 13, 6
BATCH = 5


class OddModel(nn.Module):
    """Odd shapes, a 0-dim parameter, a frozen one and one that never gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(IN, HIDDEN)
        self.kernel = nn.Parameter(torch.randn(5, 3, 2) * 0.3)
        self.norm = nn.LayerNorm(HIDDEN)
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.lin2 = nn.Linear(HIDDEN, OUT, bias=False)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(3) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        h = self.norm(h) * self.temperature
        out = self.lin2(h)
        return out + F.pad(self.kernel.sum(dim=(1, 2)), (0, 1)) + self.frozen.sum()


def make_model(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> OddModel:
    torch.manual_seed(seed)
    return OddModel().to(dtype)


def param_groups(model: OddModel, *, lr_a: float, lr_b: float) -> list[dict[str, Any]]:
    """Two groups with their own lr and weight decay; the frozen param rides in group A."""
    a = [model.lin1.weight, model.lin1.bias, model.kernel, model.frozen, model.lin2.weight, model.unused]
    b = [model.norm.weight, model.norm.bias, model.temperature]
    return [
        {"params": a, "lr": lr_a, "weight_decay": 0.1},
        {"params": b, "lr": lr_b, "weight_decay": 0.0},
    ]


def batch(seed: int, rank: int, step: int, micro: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step * 101 + micro)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x).float() - y.float()) ** 2).mean()


# Fixed gradients: XLA computes bf16 model code with other intermediate rounding than eager,
# so tests of the optimizer on XLA feed every device the same gradients: the loss
# ``sum(p * g)`` has gradient exactly ``g`` (bf16) for each parameter it covers.
FIXED_GRAD_PARAMS = ("lin1.weight", "lin1.bias", "kernel", "norm.weight", "norm.bias", "temperature", "lin2.weight")


def fixed_grads(seed: int, data_rank: int, step: int, micro: int, model: nn.Module) -> dict[str, torch.Tensor]:
    """Per parameter name (all but ``frozen`` and ``unused``), a bf16 gradient that depends
    on the data rank, step and micro-batch only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + data_rank * 10_007 + step * 101 + micro + 7)
    named = dict(model.named_parameters())
    return {n: (torch.randn(named[n].shape, generator=g) * 0.3).to(named[n].dtype) for n in FIXED_GRAD_PARAMS}


def fixed_grad_loss(model: nn.Module, grads: dict[str, torch.Tensor]) -> torch.Tensor:
    named = dict(model.named_parameters())
    return sum((named[n].float() * g.to(named[n].device).float()).sum() for n, g in grads.items())


@dataclass(frozen=True)
class Scenario:
    """One training setup, run both by the oracle and by the sharded optimizer."""

    name: str
    optimizer: str  # "AdamW" or "SGD"
    opt_kwargs: dict[str, Any] = field(default_factory=dict)
    lr_a: float = 1e-3
    lr_b: float = 3e-3
    master: bool = True
    fp32_acc: bool = True
    wire: torch.dtype | None = None  # None: fp32 if fp32_acc else bf16
    grad_clipping: bool = True
    max_norm: float = 0.5
    steps: int = 4
    micro: int = 3
    seed: int = 0
    api: str = "zero1"  # "zero1", "nxd_config" or "neuron"
    # How the training loop clears gradients between steps: "optimizer" (opt.zero_grad()),
    # "model" (model.zero_grad(), as the Hugging Face Trainer does) or "none". The math,
    # and so the oracle, is the same for all three.
    clear: str = "optimizer"
    fixed_grads: bool = False  # gradients from ``fixed_grads`` instead of the model's loss
    # Memory options: each micro-batch's gradient summed over ranks (in the wire dtype), then
    # over micro-batches in fp32; parameters rounded to nearest with ties away from zero.
    sharded_acc: bool = False
    remainders: bool = False
    bucket_cap_mb: float = 0.0004  # ~100 fp32 elements: several buckets per group
    # Parameters frozen at step time: (first step, names frozen from it on), in order; each entry
    # replaces the previous set (``()`` unfreezes them). torch.optim's meaning: a frozen parameter
    # gets no gradient, so the step skips it (no update, no state change) and the norm leaves it out.
    freeze: tuple[tuple[int, tuple[str, ...]], ...] = ()
    # Calibration only: a bias-correction step counter of the bucket's rather than the parameter's
    # (every existing state's ``step`` is the number of steps taken, frozen or not), which the tests
    # show gives another result than torch's per-parameter counter that nxd_smp keeps.
    bucket_step_counter: bool = False

    @property
    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        return getattr(torch.optim, self.optimizer)

    def frozen_at(self, step: int) -> tuple[str, ...]:
        """The names frozen (``requires_grad=False``) during ``step``."""
        names: tuple[str, ...] = ()
        for start, frozen in self.freeze:
            if step >= start:
                names = frozen
        return names

    @property
    def wire_dtype(self) -> torch.dtype:
        if self.wire is not None:
            return self.wire
        return torch.float32 if self.fp32_acc else torch.bfloat16


def apply_freeze(s: Scenario, model: nn.Module, step: int) -> None:
    """Set ``requires_grad`` of the parameters ``s.freeze`` names as they are during ``step``."""
    frozen = set(s.frozen_at(step))
    named = dict(model.named_parameters())
    for name in {n for _, names in s.freeze for n in names}:
        named[name].requires_grad_(name not in frozen)


def run_oracle(
    s: Scenario, world_size: int, data_ranks: list[int] | None = None, *, worlds: list[int] | None = None
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train ``s`` unsharded; return the final bf16 parameters by name and the
    per-step global gradient norms. ``data_ranks``: whose data each of the ``world_size``
    ranks trains on (default: its own). ``worlds``: a DP size per step instead (a run
    resumed at another size: each rank trains on its own data).

    Runs single-threaded like the spawned ranks: CPU kernels sum in a thread-count
    dependent order, and Adam turns a last-bit difference in a near-zero gradient into a
    full ``lr`` step.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if worlds is not None:
            assert data_ranks is None and len(worlds) == s.steps
            return _run_oracle(s, [list(range(w)) for w in worlds])
        return _run_oracle(s, [list(range(world_size)) if data_ranks is None else data_ranks] * s.steps)
    finally:
        torch.set_num_threads(threads)


def _run_oracle(s: Scenario, ranks_per_step: list[list[int]]) -> tuple[dict[str, torch.Tensor], list[float]]:
    model = make_model(s.seed)
    groups = param_groups(model, lr_a=s.lr_a, lr_b=s.lr_b)
    managed = [p for g in groups for p in g["params"] if p.requires_grad]
    shard_dtype = torch.float32 if s.master else torch.bfloat16
    acc_dtype = torch.float32 if s.fp32_acc else torch.bfloat16
    masters = {id(p): p.detach().to(shard_dtype).clone() for p in managed}
    inner = s.optimizer_class(
        [{**g, "params": [masters[id(p)] for p in g["params"] if p.requires_grad]} for g in groups],
        **s.opt_kwargs,
    )
    norms = []
    for step in range(s.steps):
        data_ranks = ranks_per_step[step]
        world_size = len(data_ranks)
        apply_freeze(s, model, step)  # (a frozen parameter's gradient is None: zeros below, skipped at the step)
        def backward(rank: int, micro: int) -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            if s.fixed_grads:
                fixed_grad_loss(model, fixed_grads(s.seed, data_ranks[rank], step, micro, model)).backward()
            else:
                x, y = batch(s.seed, data_ranks[rank], step, micro)
                loss_fn(model, x, y).backward()
            return [torch.zeros(p.shape) if p.grad is None else p.grad.float() for p in managed]

        total = [None] * len(managed)
        if s.sharded_acc:  # micro-batch by micro-batch: a sum over ranks, then into fp32
            total = [torch.zeros(p.shape) for p in managed]
            for micro in range(s.micro):
                wire = [None] * len(managed)
                for rank in range(world_size):
                    for i, g in enumerate(backward(rank, micro)):
                        wire[i] = g.to(s.wire_dtype) if rank == 0 else wire[i] + g.to(s.wire_dtype)
                total = [t + w.float() for t, w in zip(total, wire)]
        else:
            for rank in range(world_size):
                acc = [torch.zeros(p.shape, dtype=acc_dtype) for p in managed]
                for micro in range(s.micro):
                    acc = [a + g.to(acc_dtype) for a, g in zip(acc, backward(rank, micro))]
                for i in range(len(managed)):
                    wire = acc[i].to(s.wire_dtype)
                    total[i] = wire if rank == 0 else total[i] + wire
        grads = [t.to(shard_dtype) / world_size for t in total]
        norm = math.sqrt(sum(float(g.float().pow(2).sum()) for g in grads))
        if s.grad_clipping:
            coef = min(1.0, s.max_norm / (norm + 1e-6))
            grads = [g * coef for g in grads]
        for p, g in zip(managed, grads):
            masters[id(p)].grad = g if p.requires_grad else None
        if s.bucket_step_counter:
            for state in inner.state.values():
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"].fill_(float(step))
        inner.step()
        with torch.no_grad():
            for p in managed:
                p.copy_(round_ties_away(masters[id(p)]) if s.remainders else masters[id(p)].to(p.dtype))
        norms.append(norm)
    model.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def round_ties_away(x: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16 on the bit pattern, TransformerEngine's way: the upper 16 bits, plus one
    when the lower 16 are 0x8000 or more (to nearest, ties away from zero). Unsigned
    arithmetic in int64, written apart from nxd_smp's signed version."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    upper = ((bits >> 16) + ((bits & 0xFFFF) >= 0x8000).to(torch.int64)) & 0xFFFF
    return torch.where(upper >= 0x8000, upper - 0x10000, upper).to(torch.int16).view(torch.bfloat16)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of the (common) float dtype lie
    between ``a`` and ``b`` (0: equal; +0 and -0 are equal)."""
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16, torch.float32)
    int_dtype = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    sign_mask = 0x7FFF if int_dtype is torch.int16 else 0x7FFFFFFF

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(int_dtype).to(torch.int64)
        return torch.where(i < 0, -(i & sign_mask), i)

    return (ordered(a) - ordered(b)).abs()


def assert_params_close(
    actual: dict[str, torch.Tensor],
    expected: dict[str, torch.Tensor],
    *,
    max_ulp: int = 1,
    max_flip_fraction: float = 0.02,
) -> None:
    """Low-precision params equal up to rare flips of at most ``max_ulp`` units in the
    last place (reduction order differs between gloo and a Python sum).

    A unit in the last place is taken at the larger of the element's magnitude and its
    tensor's RMS: next to zero the representable values are dense, and Adam's
    ``m / sqrt(v)`` moves a near-zero weight by a full ``lr`` step on a last-bit change of
    its gradient, which is noise at the tensor's scale, not an error.
    """
    assert actual.keys() == expected.keys()
    total = flips = 0
    for name in expected:
        a, e = actual[name], expected[name]
        assert a.shape == e.shape and a.dtype == e.dtype, name
        differ = ulp_distance(a, e) > 0
        af, ef = a.float(), e.float()
        rms = float(ef.pow(2).mean().sqrt()) if e.numel() else 0.0
        scale = torch.maximum(torch.maximum(af.abs(), ef.abs()), torch.tensor(rms))
        unit = torch.finfo(a.dtype).eps * scale  # spacing of values near ``scale``
        ulps = (af - ef).abs() / unit
        worst = float(ulps.max()) if ulps.numel() else 0.0
        assert worst <= max_ulp, f"{name}: {worst:.1f} ulp apart (max {max_ulp})\n{a}\n{e}"
        total += a.numel()
        flips += int(differ.sum())
    assert flips <= max(2, max_flip_fraction * total), f"{flips} of {total} elements differ"


def assert_same_run(got: dict, expected: dict) -> None:
    """A run that resumed (or ran elsewhere) ended bit for bit as ``expected``: ``{"error",
    "params": {name: tensor}, "masters": [this rank's shard per bucket]}`` as the loop workers
    (tests/trainer_dp_worker.py, tests/accelerate_dp_worker.py) record them."""
    assert got["error"] is None, got["error"]
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name
    for a, b in zip(got["masters"], expected["masters"], strict=True):
        assert torch.equal(a, b)
