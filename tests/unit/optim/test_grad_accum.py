"""grad_accum: the fp32 main_grad lifecycle (first gradient copied, later ones added,
untouched parameters zero, nothing cleared by hand), in both buffer layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from nxd_smp.backend import EagerBackend
from nxd_smp.core.layout import plan_buckets
from nxd_smp.grad_accum import MainGradBuffers
from nxd_smp.optim.precision import PrecisionPlan
from nxd_smp.optim.topology import Topology

CPU = Topology(EagerBackend(torch.device("cpu")))


def make(contiguous: bool, world_size: int = 2):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, dtype=torch.bfloat16)) for shape in [(5, 3), (7,), (), (4, 2)]]
    layouts = plan_buckets([p.numel() for p in params], [0] * len(params), world_size, cap_numel=16)
    return params, layouts, MainGradBuffers(params, layouts, CPU, PrecisionPlan(), contiguous)


def reference_flat(params, layout, grads_per_micro):
    """Plain fp32 sum per parameter, laid out as the bucket."""
    flat = torch.zeros(layout.padded_numel)
    for k, index in enumerate(layout.param_indices):
        start, end = layout.param_range(k)
        for grads in grads_per_micro:
            if grads[index] is not None:
                flat[start:end] += grads[index].float().reshape(-1)
    return flat


def backward_with(params, grads):
    loss = sum((p.float() * g.float()).sum() for p, g in zip(params, grads) if g is not None)
    loss.backward()


@pytest.mark.parametrize("contiguous", [True, False], ids=["flat_buffers", "per_parameter"])
def test_each_accumulation_starts_anew_and_untouched_parameters_count_zero(contiguous):
    params, layouts, buffers = make(contiguous)
    g = torch.Generator().manual_seed(1)

    def grads(skip=()):
        return [None if i in skip else torch.randn(p.shape, generator=g).bfloat16() for i, p in enumerate(params)]

    first = [grads(), grads()]
    for micro in first:
        backward_with(params, micro)
    assert all(p.grad is None for p in params)  # the hooks freed the bf16 gradients
    for b, layout in enumerate(layouts):
        assert torch.equal(buffers.flat(b), reference_flat(params, layout, first))
        buffers.flat(b).fill_(float("nan"))  # what a step may leave behind (scaled, NaN)

    buffers.start_new_accumulation()
    second = [grads(skip={1}), grads(skip={1, 3})]  # parameter 1 gets no gradient at all
    for micro in second:
        backward_with(params, micro)
    for b, layout in enumerate(layouts):
        assert torch.equal(buffers.flat(b), reference_flat(params, layout, second))
    assert torch.equal(buffers.main_grad(1), torch.zeros(7))


@pytest.mark.parametrize("contiguous", [True, False], ids=["flat_buffers", "per_parameter"])
def test_main_grad_of_an_untouched_parameter_is_zero_and_later_gradients_add(contiguous):
    params, _, buffers = make(contiguous)
    assert torch.equal(buffers.main_grad(0), torch.zeros(5, 3))
    g = torch.ones(5, 3, dtype=torch.bfloat16)
    buffers.add(0, g)
    buffers.add(0, g)
    assert torch.equal(buffers.main_grad(0), torch.full((5, 3), 2.0))
    buffers.start_new_accumulation()
    buffers.add(0, g)
    assert torch.equal(buffers.main_grad(0), torch.ones(5, 3))


def test_a_second_owner_takes_the_hooks_over():
    params, layouts, first = make(True)
    second = MainGradBuffers(params, layouts, CPU, PrecisionPlan())
    backward_with(params, [torch.ones(p.shape) for p in params])
    assert torch.equal(second.main_grad(0), torch.ones(5, 3))
    assert torch.equal(first.main_grad(0), torch.zeros(5, 3))
