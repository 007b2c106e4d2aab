"""The Trainium code path at DP 2 and 4: nxd_smp on XLA CPU replicas with real in-graph
collectives over replica groups (tests/xla_replicas.py), against the same unsharded oracle
as the gloo tests (with fixed gradients: XLA rounds bf16 model code differently from eager).
Every rank must run one and the same step program, compile nothing new after warm-up and
move nothing to the host inside a step. DP=8 runs in scripts/bench_xla.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.distributed import run_ranks
from tests.oracle import Scenario, assert_params_close, run_oracle, ulp_distance
from tests.xla_dp_worker import (
    CKPT,
    SAVED_AT,
    WARMUP,
    Case,
    _tp_grads,
    cpu_ranks_resume_all,
    cpu_ranks_save,
    load_and_continue,
    save_and_continue,
)
from tests.nxd_layout import LAYOUTS, USER_CONTENT
from tests.nxd_layout import SAVED_AT as NXD_SAVED_AT
from tests.nxd_layout import oracle as nxd_oracle
from tests.nxd_layout import resume
from tests.xla_replicas import run_replicas

pytestmark = pytest.mark.requires_xla  # every test here runs torch_xla (tests/conftest.py skips them without it)

SGD = {"momentum": 0.9}
STEPS = WARMUP + 2


def scenario(name: str, optimizer: str = "AdamW", **kwargs) -> Scenario:
    return Scenario(name, optimizer, fixed_grads=True, steps=STEPS, micro=2, **kwargs)


# Oracle cases: compared with run_oracle at the group's size.
ORACLE_CASES = [
    Case("adamw_smp_clip_active", scenario("adamw", max_norm=0.5)),
    Case("sgd_clip_active", scenario("sgd", "SGD", opt_kwargs=SGD, lr_a=0.05, lr_b=0.02, max_norm=0.05)),
    Case("sgd_clip_inactive", scenario("sgd_inactive", "SGD", opt_kwargs=SGD, lr_a=0.05, lr_b=0.02, max_norm=1e6)),
    Case("adamw_legacy_bf16_states", scenario("legacy", master=False, fp32_acc=False)),
    Case("neuron_zero1_nxd_settings", scenario("neuron", max_norm=0.3), api="neuron"),
    Case("initialize_parallel_optimizer", scenario("nxd", "SGD", opt_kwargs=SGD, lr_a=0.05, lr_b=0.02,
                                                   max_norm=0.05, clear="model"), api="nxd_config"),
    # The memory options: gradients reduce-scattered inside the backward graph (which holds
    # the step too: the loop syncs once per step, as NxD's do), masters as remainders.
    Case("adamw_sharded_grad_acc", scenario("sharded", max_norm=0.5, sharded_acc=True)),
    Case("memory_options_nxd_config", scenario("memory", max_norm=0.3, sharded_acc=True, remainders=True,
                                               clear="model"), api="nxd_config"),
    # Parameters frozen from step 1 on (before warm-up ends): kept by a mask the rank cuts as data,
    # so the program stays one for every rank and compiles nothing new while the set holds.
    Case("adamw_frozen_layers", scenario("frozen", max_norm=0.5,
                                         freeze=((1, ("lin2.weight", "kernel", "temperature")),))),
    # Frozen at the first step, unfrozen one by one before warm-up ends: each parameter's own Adam step
    # (torch's), by a counter per element gathered with an index the rank uploads as data.
    Case("adamw_unfrozen_again", scenario("unfrozen", max_norm=0.5,
                                          freeze=((0, ("lin2.weight", "kernel")), (1, ("kernel",)), (2, ())))),
]
# DP 4 runs the cases whose program depends on more than two ranks' share of a bucket (the plain step,
# the memory options' in-backward reduce-scatter and remainders, the per-element step counters); the
# others' programs are DP 2's with another rank index as data.
AT_DP4 = ("adamw_smp_clip_active", "memory_options_nxd_config", "adamw_unfrozen_again")
PAIRS = Case("adamw_pairs_of_replicas", scenario("pairs", max_norm=0.5), groups=((0, 1), (2, 3)))
FP16_OVERFLOW = Case("fp16_overflow_on_rank_1", scenario("fp16", max_norm=0.5), dtype=torch.float16,
                     overflow=(WARMUP, 1), extra={"loss_scaler": None})
LEGACY_SR = Case("legacy_stochastic_rounding", scenario("sr", master=False, fp32_acc=False),
                 extra={"stochastic_rounding": True, "sr_seed": 0})


def _with_scaler(case: Case) -> Case:
    from nxd_smp import DynamicLossScaler

    return Case(case.name, case.scenario, case.api, case.groups, case.dtype, case.overflow,
                {"loss_scaler": DynamicLossScaler(init_scale=16.0, hysteresis=1)})


@pytest.fixture(scope="module")
def cpu_checkpoints(tmp_path_factory):
    """Checkpoints saved by CPU ranks at DP 1 and 3 (gloo), for the replicas to load; and
    what those CPU runs reached without stopping."""
    root = tmp_path_factory.mktemp("cpu_ckpt")
    paths = {1: str(root / "dp1"), 3: str(root / "dp3")}
    reached = {1: save_and_continue(0, paths[1]), 3: run_ranks(3, cpu_ranks_save, paths[3])[0]}
    return paths, reached


def _run_replicas(n: int, cpu_checkpoints, tmp_path_factory):
    """One replica child at DP ``n`` runs its cases (DP 2: every oracle case; DP 4: ``AT_DP4`` and the
    cases of four replicas, ``tp_norm`` among them), and checkpoints saved there (in the background) and
    loaded from the CPU ones."""
    cases = list(ORACLE_CASES)
    if n == 4:
        cases = [c for c in ORACLE_CASES if c.name in AT_DP4] + [PAIRS, _with_scaler(FP16_OVERFLOW), LEGACY_SR]
    paths, _ = cpu_checkpoints
    root = tmp_path_factory.mktemp(f"xla_dp{n}")
    job = {"save": str(root / "ckpt"), "load": [paths[1], paths[3]], "nxd": str(root / "nxd")}
    return n, run_replicas(n, "tests.xla_dp_worker:train", cases, job, n == 4, timeout=900), job


@pytest.fixture(scope="module")
def replicas_dp2(cpu_checkpoints, tmp_path_factory):
    return _run_replicas(2, cpu_checkpoints, tmp_path_factory)


@pytest.fixture(scope="module")
def replicas_dp4(cpu_checkpoints, tmp_path_factory):
    return _run_replicas(4, cpu_checkpoints, tmp_path_factory)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"dp{n}")
def replicas(request):
    """The replica child at the DP size of the parameter (a test that runs at one size names it
    with ``DP2``/``DP4`` or an indirect parameter); each child runs once per module."""
    return request.getfixturevalue(f"replicas_dp{request.param}")


@pytest.fixture(scope="module")
def resumed_at_dp3(replicas):
    """Three CPU ranks (gloo, one spawn) resume what the replicas wrote: their nxd_smp
    checkpoint, and NxD's folders in both layouts."""
    n, _, job = replicas
    return run_ranks(3, cpu_ranks_resume_all, [job["save"]], [f"{job['nxd']}/{layout}" for layout in LAYOUTS])[0]


@pytest.mark.parametrize("replicas, case", [
    *[pytest.param(2, case, id=f"dp2-{case.name}") for case in ORACLE_CASES],
    *[pytest.param(4, case, id=f"dp4-{case.name}") for case in ORACLE_CASES if case.name in AT_DP4],
], indirect=["replicas"])
def test_matches_the_unsharded_oracle(replicas, case):
    n, ranks, _ = replicas
    expected, expected_norms = run_oracle(case.scenario, n)
    for rank in ranks:
        got = rank[case.name]
        if case.scenario.master:
            assert_params_close(got["params"], expected)
            assert got["norms"] == pytest.approx(expected_norms, rel=1e-5)
        else:  # bf16 states: XLA fuses the update in fp32 and rounds once, eager per op
            assert_params_close(got["params"], expected, max_ulp=4, max_flip_fraction=0.1)
            assert got["norms"] == pytest.approx(expected_norms, rel=1e-2)


DP2 = pytest.mark.parametrize("replicas", [2], indirect=True, ids=["dp2"])
DP4 = pytest.mark.parametrize("replicas", [4], indirect=True, ids=["dp4"])


def test_each_parameter_keeps_its_own_adam_step_on_the_replicas(replicas):
    """Unfrozen again on XLA: every rank reports torch's per-parameter counters (the steps each parameter
    took), and the oracle with torch's counters is not the one with a counter of the bucket's."""
    n, ranks, _ = replicas
    case = next(c for c in ORACLE_CASES if c.name == "adamw_unfrozen_again")
    s = case.scenario
    for rank in ranks:
        steps = rank[case.name]["steps"]
        assert steps["lin1.weight"] == s.steps
        assert steps["lin2.weight"] == s.steps - 1 and steps["kernel"] == s.steps - 2
    per_param, _ = run_oracle(s, n)
    bucket, _ = run_oracle(dataclasses.replace(s, bucket_step_counter=True), n)
    assert any(not torch.equal(per_param[name], bucket[name]) for name in ("lin2.weight", "kernel"))


@DP4
def test_a_subset_of_replicas_per_group(replicas):
    n, ranks, _ = replicas
    for pair, data_ranks in ((0, [0, 1]), (1, [2, 3])):
        expected, norms = run_oracle(PAIRS.scenario, 2, data_ranks=data_ranks)
        for rank in data_ranks:
            assert_params_close(ranks[rank][PAIRS.name]["params"], expected)
            assert ranks[rank][PAIRS.name]["norms"] == pytest.approx(norms, rel=1e-5)


def test_every_rank_runs_the_same_step_program_and_nothing_recompiles(replicas):
    n, ranks, _ = replicas
    for name in (case.name for case in ORACLE_CASES if case.name in ranks[0]):
        hlo = ranks[0][name]["hlo"]
        assert hlo and "reduce-scatter" in hlo and "all-gather" in hlo, name
        for rank in range(1, n):
            assert ranks[rank][name]["hlo"] == hlo, f"{name}: rank {rank}'s step graph differs from rank 0's"
        marks = ranks[0][name]["marks"]
        warm, end = marks[WARMUP], marks[STEPS]
        assert warm["compiles"] > 0
        assert end["compiles"] == warm["compiles"], f"{name}: a new graph after warm-up"
        transfers = end["from_device"] - warm["from_device"] - marks["harness_transfers"]
        assert transfers == 0 and end["item_calls"] == warm["item_calls"], f"{name}: step() moved data to the host"


def test_the_step_graph_has_no_rank_baked_in_and_no_slice_update_chains(replicas):
    n, ranks, _ = replicas
    case = ranks[0]["adamw_smp_clip_active"]
    hlo, buckets = case["hlo"], case["buckets"]
    assert "dynamic-update-slice" not in hlo  # no bucket built by per-parameter slice updates
    # one reduce-scatter and one all-gather per bucket, and the norm's sum (an all-gather of
    # one element per rank on the XLA CPU device, whose all-reduce takes no channel id)
    assert buckets > 1 and hlo.count("reduce-scatter(") == buckets
    assert hlo.count("all-gather(") == buckets + 1


@DP2
def test_sharded_accumulation_reduce_scatters_each_micro_batch_inside_the_backward_graph(replicas):
    """One graph per step (the loop syncs after the step): each of the 2 micro-batches'
    backward reduce-scatters every bucket, and the step adds none of its own."""
    n, ranks, _ = replicas
    sharded, default = ranks[0]["adamw_sharded_grad_acc"], ranks[0]["adamw_smp_clip_active"]
    assert sharded["buckets"] == default["buckets"] > 1
    assert default["hlo"].count("reduce-scatter(") == default["buckets"]
    assert sharded["hlo"].count("reduce-scatter(") == 2 * sharded["buckets"]


@DP2
@pytest.mark.parametrize("name,per_bucket,per_param", [
    ("adamw_smp_clip_active", 3, 0),  # master, exp_avg, exp_avg_sq
    ("adamw_sharded_grad_acc", 3, 0),
    ("memory_options_nxd_config", 3, 1),  # remainder, exp_avg, exp_avg_sq; and the parameters
])
def test_the_step_graph_updates_the_optimizer_state_in_place(replicas, name, per_bucket, per_param):
    """Inputs donated to their outputs (input/output aliasing): the graph holds no second copy
    of the state it updates."""
    n, ranks, _ = replicas
    case = ranks[0][name]
    managed = 7  # tests/oracle.py: OddModel's parameters that get gradients
    assert case["aliased"] >= per_bucket * case["buckets"] + per_param * managed


def test_the_memory_phases_script_reads_each_graph_on_the_replicas(replicas):
    """scripts/xla_memory_phases.py's replica, tiny: rank 0 reads the resident size between
    steps and each graph's peak above it (never below: the peak was reset to the size then)."""
    n, ranks, _ = replicas
    first = ranks[0]["memory_phases"]
    assert first["params"] == 2 * (32 * 32 + 32)
    assert set(first["bytes"]) == {"between steps", "forward+backward", "step"}
    assert first["bytes"]["between steps"] > 0 and min(first["bytes"].values()) >= 0
    assert all(not rank["memory_phases"]["bytes"] for rank in ranks[1:])  # only rank 0 reads


@DP4
def test_an_overflow_on_one_rank_skips_the_step_on_all(replicas):
    n, ranks, _ = replicas
    first = ranks[0][FP16_OVERFLOW.name]
    for rank in ranks:
        got = rank[FP16_OVERFLOW.name]
        assert math.isinf(got["norms"][WARMUP]) and got["scale"] == 8.0  # 16, halved once
        before, after = got["snapshots"]["before_overflow"], got["snapshots"]["after_overflow"]
        assert all(torch.equal(a, b) for a, b in zip(before, after))  # params, masters, states
        assert all(torch.equal(v, first["params"][k]) for k, v in got["params"].items())
    assert not all(torch.equal(a, b) for a, b in zip(first["snapshots"]["after_overflow"], first["params"].values()))


@DP4
def test_legacy_stochastic_rounding_runs_rank_free_and_tracks_the_oracle(replicas):
    n, ranks, _ = replicas
    smp, _ = run_oracle(scenario("sr_reference"), 4)
    for rank in ranks:
        got = rank[LEGACY_SR.name]["params"]
        assert all(torch.equal(v, ranks[0][LEGACY_SR.name]["params"][k]) for k, v in got.items())
        differ = sum(int((ulp_distance(got[k], smp[k]) > 2).sum()) for k in smp)
        assert differ <= 0.05 * sum(t.numel() for t in smp.values())


@DP4
def test_grad_norm_groups_over_replica_groups(replicas):
    """``tests/xla_dp_worker.py``'s ``tp_norm``, run in the DP 4 child after its cases."""
    n, ranks, _ = replicas
    # DP mean per part: the replicated gradient is the pair's mean (the same for both TP
    # ranks, counted once); the split part of each TP rank is its pair's mean.
    replicated = (_tp_grads("replicated", 0, 10).float() + _tp_grads("replicated", 1, 10).float()) / 2
    split_parts = [(_tp_grads("split", a, 7).float() + _tp_grads("split", b, 7).float()) / 2 for a, b in ((0, 1), (2, 3))]
    expected = math.sqrt(float(replicated.pow(2).sum()) + sum(float(p.pow(2).sum()) for p in split_parts))
    for rank in ranks:
        assert rank["tp_norm"]["norm"] == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- checkpoints across devices
def resumed_oracle(before: int, after: int) -> dict[str, torch.Tensor]:
    """The oracle of a run at DP ``before`` until the save, at DP ``after`` from there."""
    return run_oracle(CKPT, before, worlds=[before] * SAVED_AT + [after] * (CKPT.steps - SAVED_AT))[0]


def test_replicas_saving_in_the_background_train_on_like_the_oracle(replicas):
    n, ranks, _ = replicas
    expected = resumed_oracle(n, n)
    for rank in ranks:
        assert_params_close(rank["checkpoints"]["uninterrupted"], expected)


@pytest.mark.parametrize("cpu_dp", [1, 3])
def test_a_checkpoint_from_the_replicas_resumes_on_cpu(replicas, cpu_dp, request):
    n, _, job = replicas
    if cpu_dp == 1:
        resumed = load_and_continue(0, job["save"])
    else:
        resumed = request.getfixturevalue("resumed_at_dp3")[job["save"]]
    assert_params_close(resumed, resumed_oracle(n, cpu_dp), max_ulp=2, max_flip_fraction=0.05)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nxd_checkpoints_written_by_torch_xla_resume_on_the_replicas(replicas, layout):
    # what a Trainium run does with its NxD checkpoint: load it on the XLA device and go on
    n, ranks, _ = replicas
    expected = nxd_oracle(n, n)
    for rank in ranks:
        resumed = rank["checkpoints"]["nxd_resumed"][layout]
        assert resumed["user_content"] == USER_CONTENT and resumed["scheduler_epoch"] == NXD_SAVED_AT
        assert_params_close(resumed["params"], expected)


@pytest.mark.parametrize("cpu_dp", [1, 3])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_nxd_checkpoints_written_by_torch_xla_resume_at_another_dp_size(replicas, layout, cpu_dp, request):
    # NxD's folders (torch_xla's ZeRO-1 at DP n, NxD's file names) load at DP 1 or 3 and go on
    n, _, job = replicas
    root = f"{job['nxd']}/{layout}"
    resumed = resume(0, root) if cpu_dp == 1 else request.getfixturevalue("resumed_at_dp3")[root]
    assert resumed["user_content"] == USER_CONTENT and resumed["scheduler_epoch"] == NXD_SAVED_AT
    assert_params_close(resumed["params"], nxd_oracle(n, cpu_dp))


@pytest.mark.parametrize("cpu_dp", [1, 3])
def test_the_replicas_resume_a_checkpoint_from_cpu(replicas, cpu_checkpoints, cpu_dp):
    n, ranks, _ = replicas
    paths, reached = cpu_checkpoints
    assert_params_close(reached[cpu_dp], resumed_oracle(cpu_dp, cpu_dp), max_ulp=2, max_flip_fraction=0.05)
    expected = resumed_oracle(cpu_dp, n)
    for rank in ranks:
        assert_params_close(rank["checkpoints"]["resumed"][paths[cpu_dp]], expected, max_ulp=2, max_flip_fraction=0.05)
