"""NxD's parallel state, where it is initialised, gives ``NeuronZero1Optimizer`` and
``initialize_parallel_optimizer`` their groups as it gives NxD's own: sharding over the
data-parallel replica groups, the gradient norm over the tensor- and pipeline-parallel groups.
Explicit arguments still win. NxD is a stand-in with NxD's names (tests/nxd_stand_in.py);
four gloo ranks, as 2 x 2 tensor- or pipeline-parallel layouts."""

from __future__ import annotations

import math

import pytest
import torch

import nxd_smp
from nxd_smp.interop.nxd.parallel_state import nxd_parallel_groups
from tests import nxd_stand_in
from tests.distributed import run_ranks
from tests.oracle import FIXED_GRAD_PARAMS, fixed_grad_loss, make_model, param_groups

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
WAYS = ("nxd_state", "explicit", "no_model_parallel_groups", "explicit_sharding_wins",
        "initialize_parallel_optimizer", "initialize_explicit")


def test_no_state_without_nxd_or_before_it_is_initialised():
    nxd_stand_in.uninstall()
    assert nxd_parallel_groups() is None  # not installed (PyPI's package is a placeholder)
    try:
        nxd_stand_in.install(world=4, tp=2, initialized=False)
        assert nxd_parallel_groups() is None
        nxd_stand_in.install(world=8, tp=2, pp=2)
        groups = nxd_parallel_groups()
        assert groups.data == [[0, 2], [1, 3], [4, 6], [5, 7]]
        assert groups.tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert groups.pipeline == [[0, 4], [1, 5], [2, 6], [3, 7]]
    finally:
        nxd_stand_in.uninstall()


def grads_for(rank: int, tp: int, step: int, model) -> dict[str, torch.Tensor]:
    """Gradients as tensor parallelism makes them: a replicated parameter's the same on every
    tensor-parallel rank (it depends on the data position only), the split one's per rank."""
    data_position = rank // tp
    out = {}
    for i, name in enumerate(FIXED_GRAD_PARAMS):
        key = rank if name == "lin1.weight" else data_position
        g = torch.Generator().manual_seed(1000 * step + 10 * key + i)
        shape = dict(model.named_parameters())[name].shape
        out[name] = (torch.randn(shape, generator=g) * 0.3).bfloat16()
    return out


def build(way: str, model, groups: dict[str, list[list[int]]], tp: int, pp: int):
    params = param_groups(model, lr_a=1e-2, lr_b=3e-2)
    if way.startswith("initialize"):
        cfg = nxd_smp.neuronx_distributed_config(
            tensor_parallel_size=tp, pipeline_parallel_size=pp,
            optimizer_config={"zero_one_enabled": True, "max_grad_norm": 0.5},
        )
        explicit = {"process_group": groups["dp"], "grad_norm_groups": groups["tp"] if tp > 1 else None,
                    "pipeline_groups": groups["pp"] if pp > 1 else None}
        return nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, params, momentum=0.9,
                                                     **(explicit if way == "initialize_explicit" else {}))
    kwargs = {
        "nxd_state": {},
        "explicit": {"sharding_groups": groups["dp"], "grad_norm_groups": groups["tp"] if tp > 1 else None,
                     "pipeline_groups": groups["pp"] if pp > 1 else None},
        "no_model_parallel_groups": {"sharding_groups": groups["dp"]},
        "explicit_sharding_wins": {"sharding_groups": [[0, 1, 2, 3]]},
    }[way]
    return nxd_smp.NeuronZero1Optimizer(params, torch.optim.SGD, momentum=0.9, max_norm=0.5, use_grad_acc_hook=True,
                                        higher_cc_precision=True, **kwargs)


def nxd_ranks(rank: int, world: int) -> dict:
    out = {}
    for name, (tp, pp) in LAYOUTS.items():
        groups = nxd_stand_in.layout(world, tp, pp)
        for way in WAYS:
            if way in ("nxd_state", "explicit_sharding_wins", "initialize_parallel_optimizer"):
                nxd_stand_in.install(world, tp, pp)
            try:
                model = make_model(0)
                model.lin1.weight.tensor_model_parallel = True
                opt = build(way, model, groups, tp, pp)
                norms = []
                for step in range(3):
                    fixed_grad_loss(model, grads_for(rank, tp, step, model)).backward()
                    opt.step()
                    norms.append(float(opt.grad_norm))
            finally:
                nxd_stand_in.uninstall()
            out[(name, way)] = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                                "norms": norms, "world_size": opt.world_size}
    return out


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(4, nxd_ranks)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("api", ["neuron", "initialize"])
def test_the_groups_come_from_nxds_parallel_state(four_ranks, layout, api):
    from_state, explicit = (("nxd_state", "explicit") if api == "neuron"
                            else ("initialize_parallel_optimizer", "initialize_explicit"))
    for rank in four_ranks:
        got, want = rank[(layout, from_state)], rank[(layout, explicit)]
        assert got["world_size"] == want["world_size"] == 2  # sharded over the DP pairs
        assert got["norms"] == want["norms"]
        assert all(torch.equal(v, want["params"][n]) for n, v in got["params"].items())


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_model_parallel_groups_change_the_norm(four_ranks, layout):
    """The stand-in's groups matter: without them the norm covers this rank's part only."""
    for rank in four_ranks:
        with_groups, without = rank[(layout, "nxd_state")]["norms"], rank[(layout, "no_model_parallel_groups")]["norms"]
        assert all(not math.isclose(a, b, rel_tol=1e-3) for a, b in zip(with_groups, without))


def test_explicit_groups_win_over_the_parallel_state(four_ranks):
    for rank in four_ranks:
        assert rank[("tp2", "explicit_sharding_wins")]["world_size"] == 4
