"""NxD's trainer wrapper as NxD scripts, NxD Training and optimum-neuron run it
(``neuronx_distributed/trainer/optimizer.py``'s ``NxDOptimizer``, read at 2.29): its step's
reductions against a plain fp32 reference on gloo ranks (sequence parallelism at TP 2 x DP 2,
the data-parallel mean with ZeRO-1 off, context parallelism), and its surface."""

from __future__ import annotations

import pytest
import torch

import nxd_smp
from nxd_smp import ConfigError
from tests.distributed import run_ranks
from tests.nxd_trainer_worker import (
    MARKED,
    SHAPES,
    SP_CASES,
    SP_MAX_NORM,
    SPLIT,
    reference,
    sequence_parallel_ranks,
)
from tests.oracle import assert_params_close


@pytest.fixture(scope="module")
def sp_ranks():
    """One set of 4 gloo ranks (TP 2 x DP 2, NxD's layout) runs every sequence-parallel case."""
    return run_ranks(4, sequence_parallel_ranks)


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    if next(iter(want.values())).dtype == torch.float32:
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=2e-6, atol=1e-7, msg=n)
    else:
        assert_params_close(got, want, max_ulp=1, max_flip_fraction=0.02)


@pytest.mark.parametrize("clip", sorted(SP_MAX_NORM))
@pytest.mark.parametrize("case", [c for c in SP_CASES if c != "sp_off_in_config"])
def test_sequence_parallel_gradients_are_summed_over_tensor_parallel_ranks(sp_ranks, case, clip):
    """The marked parameters end identical on the two tensor-parallel ranks and equal to the
    reference that sums their gradients over them; the split and the unmarked replicated
    parameters keep their own gradient (summed, the replicated one would move twice as far)."""
    dtype = SP_CASES[case][2]
    want = reference(dp_size=2, tp_size=2, sequence_parallel=True, max_norm=SP_MAX_NORM[clip], dtype=dtype)
    for rank in sp_ranks:
        got = rank[(case, clip)]
        _close(got["params"], want[got["tp"]])
    for dp in (0, 1):
        a, b = (r[(case, clip)]["params"] for r in sp_ranks if r[(case, clip)]["dp"] == dp)
        for n in MARKED:
            assert torch.equal(a[n], b[n]), n  # bit for bit across the tensor-parallel pair
        assert not any(torch.equal(a[n], b[n]) for n in SPLIT)
    unsummed = reference(dp_size=2, tp_size=2, sequence_parallel=False, max_norm=SP_MAX_NORM[clip], dtype=dtype)
    assert not all(torch.equal(want[0][n], unsummed[0][n]) for n in MARKED)  # the data tells the two apart


@pytest.mark.parametrize("clip", sorted(SP_MAX_NORM))
def test_without_sequence_parallel_in_the_config_nothing_is_summed(sp_ranks, clip):
    """The control: with ``sequence_parallel=False`` the marked parameters follow each rank's
    own partial gradient, and differ across the tensor-parallel pair (what NxD would do too)."""
    want = reference(dp_size=2, tp_size=2, sequence_parallel=False, max_norm=SP_MAX_NORM[clip], dtype=torch.bfloat16)
    for rank in sp_ranks:
        got = rank[("sp_off_in_config", clip)]
        _close(got["params"], want[got["tp"]])


def test_every_rank_clips_with_the_same_norm(sp_ranks):
    """The summed marked gradients are the same on both tensor-parallel ranks, so every rank
    measures one norm; unsummed (the control) each pair counts its own partial gradient."""
    for key in sp_ranks[0]:
        norms = {r[key]["norm"] for r in sp_ranks}
        assert len(norms) == (2 if key[0] == "sp_off_in_config" else 1), (key, norms)


# ---------------------------------------------------------------- bad inputs, changing nothing
def _marked_model():
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    model.weight.sequence_parallel_enabled = True
    return model


def test_sequence_parallel_without_a_tensor_parallel_group_is_refused():
    model = _marked_model()
    before = [p.detach().clone() for p in model.parameters()]
    cfg = nxd_smp.neuronx_distributed_config(tensor_parallel_size=2, sequence_parallel=True,
                                             optimizer_config={"zero_one_enabled": True})
    with pytest.raises(ConfigError, match="grad_norm_groups.*sequence_parallel"):
        nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters())
    # optimum-neuron's build: the hooks take .grad, so nxd_smp must sum, and cannot without a group
    with pytest.raises(ConfigError, match="sequence_parallel_enabled.*tensor-parallel group"):
        nxd_smp.NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, use_grad_acc_hook=True)
    with pytest.raises(ConfigError, match="sequence_parallel_enabled"):
        nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, sequence_parallel=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None and not p._backward_hooks for p in model.parameters())


def test_legacy_neuron_zero1_leaves_grad_to_the_callers_own_sum():
    """Without fp32 accumulation ``.grad`` stays where NxD's and optimum-neuron's own
    sequence-parallel sums read it: nxd_smp does not sum it a second time."""
    opt = nxd_smp.NeuronZero1Optimizer(_marked_model().parameters(), torch.optim.AdamW, optimizer_dtype=torch.bfloat16)
    assert not opt.sequence_parallel


def test_context_parallelism_without_its_groups_is_refused():
    cfg = nxd_smp.neuronx_distributed_config(context_parallel_size=2, optimizer_config={"zero_one_enabled": False})
    with pytest.raises(ConfigError, match="context_parallel_groups"):
        nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, _marked_model().float().parameters(), lr=0.1)


def test_a_zero1_optimizer_built_without_the_configs_sequence_parallelism_is_refused_by_the_wrapper():
    cfg = nxd_smp.neuronx_distributed_config(sequence_parallel=True, optimizer_config={"zero_one_enabled": True})
    plain = nxd_smp.Zero1Optimizer(_marked_model().parameters(), torch.optim.AdamW)
    assert nxd_smp.trainer.NxDOptimizer(plain, cfg).optimizer is plain  # no tensor-parallel group: nothing to sum
    with pytest.raises(ConfigError, match="ZeRO-1 on"):
        nxd_smp.trainer.NxDOptimizer(torch.optim.AdamW(_marked_model().parameters()), cfg)
