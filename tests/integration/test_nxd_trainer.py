"""NxD's trainer wrapper as NxD scripts, NxD Training and optimum-neuron run it
(``neuronx_distributed/trainer/optimizer.py``'s ``NxDOptimizer``, read at 2.29): its step's
reductions against a plain fp32 reference on gloo ranks (sequence parallelism at TP 2 x DP 2,
the data-parallel mean with ZeRO-1 off, context parallelism), and its surface."""

from __future__ import annotations

import pytest
import torch

import nxd_smp
from nxd_smp import ConfigError
from nxd_smp.optim import compiled_adamw
from tests.distributed import run_ranks
from tests.nxd_trainer_worker import (
    ADAMW,
    CP_CASES,
    DP_OPTIMIZERS,
    MARKED,
    SHAPES,
    SP_CASES,
    SP_MAX_NORM,
    SPLIT,
    reference,
    sequence_parallel_ranks,
    two_ranks,
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
    pair = [r[("sp_off_in_config", clip)]["params"] for r in sp_ranks if r[("sp_off_in_config", clip)]["dp"] == 0]
    assert not any(torch.equal(pair[0][n], pair[1][n]) for n in MARKED)  # each TP rank its own


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
        nxd_smp.NeuronZero1Optimizer(model.parameters(), torch.optim.AdamW, sequence_parallel=True)
    with pytest.raises(TypeError, match="NeuronZero1Optimizer.*sequence_parallel=True"):  # NxD's call shapes only
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
    assert nxd_smp.NxDOptimizer(plain, cfg).optimizer is plain  # no tensor-parallel group: nothing to sum
    with pytest.raises(ConfigError, match="ZeRO-1 on"):
        nxd_smp.NxDOptimizer(torch.optim.AdamW(_marked_model().parameters()), cfg)
    cp = nxd_smp.neuronx_distributed_config(context_parallel_size=2, optimizer_config={"zero_one_enabled": True})
    with pytest.raises(ConfigError, match="context-parallel group"):
        nxd_smp.NxDOptimizer(nxd_smp.Zero1Optimizer(_marked_model().parameters(), torch.optim.AdamW), cp)


# ---------------------------------------------------------------- 2 ranks
@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """One pair of gloo ranks runs every 2-rank case; NxD Training's checkpoints go here."""
    directory = tmp_path_factory.mktemp("nxd_training")
    return directory, run_ranks(2, two_ranks, str(directory))


@pytest.mark.parametrize("clip", sorted(SP_MAX_NORM))
@pytest.mark.parametrize("optimizer", sorted(DP_OPTIMIZERS))
def test_zero1_off_averages_over_data_parallel_ranks_then_clips(pair, optimizer, clip):
    """NxD's wrapper with ZeRO-1 off at DP 2 trains as one process stepping on the mean gradient,
    clipped; both ranks end equal (a rank stepping on its own gradient would not)."""
    cls, kwargs = DP_OPTIMIZERS[optimizer]
    want = reference(dp_size=2, tp_size=1, sequence_parallel=False, max_norm=SP_MAX_NORM[clip], dtype=torch.float32,
                     optimizer=cls, opt_kwargs=kwargs)[0]
    for rank in pair[1]:
        _close(rank[("dp_mean", optimizer, clip)]["params"], want)
    own = reference(dp_size=1, tp_size=1, sequence_parallel=False, max_norm=SP_MAX_NORM[clip], dtype=torch.float32,
                    optimizer=cls, opt_kwargs=kwargs)[0]
    assert not all(torch.allclose(own[n], want[n]) for n in want)


@pytest.mark.parametrize("clip", sorted(SP_MAX_NORM))
def test_zero1_off_with_a_per_token_sum_loss_sums_over_the_ranks(pair, clip):
    """A per-token-sum loss (each rank's sum over its tokens divided by the global token count: 1/DP of
    its own mean) with ``grad_reduction="sum"``: NxD's wrapper with ZeRO-1 off sums the ranks' gradients,
    which is the global mean gradient, so it trains as the DP 2 reference of the mean. ``"mean"`` on the
    same loss divides once more (the calibration: its norm is half, and unclipped its weights differ)."""
    want = reference(dp_size=2, tp_size=1, sequence_parallel=False, max_norm=SP_MAX_NORM[clip], dtype=torch.float32)[0]
    for rank in pair[1]:
        _close(rank[("token_sum", "sum", clip)]["params"], want)
    summed, halved = (pair[1][0][("token_sum", reduction, clip)] for reduction in ("sum", "mean"))
    assert halved["norm"] == pytest.approx(summed["norm"] / 2, rel=1e-3)
    if summed["norm"] <= SP_MAX_NORM[clip]:  # (clipped, a scale of the gradient is clipped away)
        assert not all(torch.allclose(halved["params"][n], want[n], rtol=1e-4) for n in want)


@pytest.mark.parametrize("case", sorted(CP_CASES))
def test_context_parallel_ranks_average_their_gradients(pair, case):
    """Context parallelism of 2 ranks: every gradient averaged over them first (ZeRO-1 off; ZeRO-1
    sharded over data parallelism only, where the mean is an all-reduce of its own; and NxD's
    data x context sharding groups, where the data-parallel mean already covers it)."""
    dtype = CP_CASES[case][2]
    want = reference(dp_size=1, tp_size=1, cp_size=2, sequence_parallel=False, max_norm=SP_MAX_NORM["clip_active"],
                     dtype=dtype)[0]
    for rank in pair[1]:
        _close(rank[case]["params"], want)
    alone = reference(dp_size=1, tp_size=1, sequence_parallel=False, max_norm=SP_MAX_NORM["clip_active"], dtype=dtype)[0]
    assert not all(torch.equal(alone[n], want[n]) for n in want)  # rank 0's data alone differs


@pytest.mark.parametrize("clip", sorted(SP_MAX_NORM))
def test_optimum_neurons_zero1_build_and_step(pair, clip):
    """optimum-neuron builds NeuronZero1Optimizer from the user's optimizer's param groups and
    class, sets grad_clipping and max_norm before each step, reads _grad_norm after it and
    switches clipping off: that trains as SMP AdamW at DP 2 with its max_norm."""
    want = reference(dp_size=2, tp_size=1, sequence_parallel=False, max_norm=SP_MAX_NORM[clip], dtype=torch.bfloat16,
                     optimizer=torch.optim.AdamW, opt_kwargs=ADAMW)[0]
    for rank in pair[1]:
        got = rank[("optimum_neuron", clip)]
        _close(got["params"], want)
        assert got["clipping_after"] is False and len(got["norms"]) == 3 and got["norms"][-1] == got["norm"]


# ---------------------------------------------------------------- the wrapper's surface
ON = {"zero_one_enabled": True}


def _lin(seed: int = 0, dtype=torch.bfloat16) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).to(dtype)


def _steps(model, opt, n: int = 2, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(4, 8, generator=g).to(next(model.parameters()).dtype)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def test_the_wrapper_has_nxds_surface_and_forwards_the_rest():
    model = _lin()
    cfg = nxd_smp.neuronx_distributed_config(optimizer_config=ON)
    opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, model.parameters(), lr=1e-3)
    inner = opt.optimizer
    assert isinstance(opt, nxd_smp.NxDOptimizer) and isinstance(opt, torch.optim.Optimizer)
    assert isinstance(inner, nxd_smp.Zero1Optimizer) and opt.nxd_config is cfg
    assert opt.params == list(model.parameters()) and opt.grad_norm is None
    assert opt.state is inner.state and opt.param_groups is inner.param_groups and opt.defaults is inner.defaults
    # what code written against the Zero1Optimizer reads goes through
    for name in ("master_shards", "inner_optimizer", "bucket_layouts", "loss_scaler", "backend", "world_size",
                 "mixed_precision", "config", "managed_params"):
        got, want = getattr(opt, name), getattr(inner, name)
        assert got == want or got is want, name
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # acts on the inner groups
    _steps(model, opt, 1)
    scheduler.step()
    assert inner.param_groups[0]["lr"] == 5e-4
    assert torch.equal(opt.grad_norm, inner.grad_norm)
    saved = opt.state_dict()
    assert saved["nxd_smp"]["format"] == inner.state_dict()["nxd_smp"]["format"]
    with pytest.warns(UserWarning, match="no master weights"):
        opt.load_state_dict(saved)
    with pytest.raises(RuntimeError, match="cannot add a param group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    opt.param_groups = opt.param_groups  # settable, as NxD's
    assert "NxDOptimizer(" in repr(opt) and opt.__getstate__()["param_groups"] is inner.param_groups


def test_zero_grad_keeps_gradients_allocated_by_default_as_nxds_wrapper():
    model = _lin(dtype=torch.float32)
    cfg = nxd_smp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": False})
    opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=0.1)
    assert isinstance(opt, nxd_smp.ClippedOptimizer) and isinstance(opt.optimizer, torch.optim.SGD)
    model(torch.randn(2, 8)).sum().backward()
    opt.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_zero_one_off_takes_param_groups_whose_first_is_empty():
    """A decay/no-decay split can leave the first group empty; NxD's wrapper builds the inner
    optimizer over the groups as given, as torch does."""
    model = _lin(dtype=torch.float32)
    cfg = nxd_smp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": False})
    groups = [{"params": [], "weight_decay": 0.1}, {"params": list(model.parameters()), "weight_decay": 0.0}]
    opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, groups, lr=0.1)
    reference = torch.optim.SGD([dict(g) for g in groups], lr=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in reference.param_groups]


def test_init_zero_after_loading_weights_starts_the_next_step_from_them():
    """NxD's Llama scripts build the optimizer, load pretrained weights into the model and call
    ``optimizer.optimizer.init_zero()``. Weights written through ``.data`` are invisible to
    torch's version counter: without it the stale masters would be written back."""
    model, pretrained = _lin(0), _lin(1)
    cfg = nxd_smp.neuronx_distributed_config(optimizer_config={**ON, "max_grad_norm": 1e6})
    opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=0.0)
    for p, q in zip(model.parameters(), pretrained.parameters()):
        p.data.copy_(q.data)
    opt.optimizer.init_zero()
    _steps(model, opt, 1)  # lr 0: the parameters are the masters
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), pretrained.parameters()))


def test_nxd_trainings_call_with_adamw_defaults_trains_as_the_plain_call(monkeypatch):
    """NxD Training: ``initialize_parallel_optimizer(cfg, cls, groups, **torch_optimizer.defaults)``.
    torch 2.9's AdamW.defaults holds decoupled_weight_decay (dropped, as NxD drops it) and the
    kernel options at their defaults (no choice: the fused kernel and the compiled CPU update
    stay on, the latter from ``COMPILE_MIN_NUMEL`` elements, lowered here for the small model);
    it trains bit for bit as the same hyperparameters passed plainly."""
    monkeypatch.setattr(compiled_adamw, "COMPILE_MIN_NUMEL", 0)
    cfg = nxd_smp.neuronx_distributed_config(optimizer_config=ON)
    a, b = _lin(), _lin()
    torch_optimizer = torch.optim.AdamW(a.parameters(), lr=2e-3, weight_decay=0.05)
    assert {"decoupled_weight_decay", "fused", "foreach", "capturable", "differentiable"} <= set(torch_optimizer.defaults)
    nxdt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, a.parameters(), **torch_optimizer.defaults)
    plain = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, b.parameters(), lr=2e-3, weight_decay=0.05)
    assert nxdt.inner_optimizer.defaults["fused"] is True and nxdt.optimizer._inner_step.compiled is not None
    _steps(a, nxdt, 3)
    _steps(b, plain, 3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(TypeError, match="decoupled_wight_decay"):  # a misspelt name stays an error
        nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, _lin().parameters(), decoupled_wight_decay=True)
    # Adam takes it: kept
    adam = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.Adam, _lin().parameters(), decoupled_weight_decay=True)
    assert adam.inner_optimizer.param_groups[0]["decoupled_weight_decay"] is True
    off = nxd_smp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": False})
    plain_off = nxd_smp.initialize_parallel_optimizer(off, torch.optim.AdamW, _lin(dtype=torch.float32).parameters(),
                                                      **torch_optimizer.defaults)
    assert isinstance(plain_off.optimizer, torch.optim.AdamW)


def test_a_null_gradient_clip_value_measures_the_norm_and_clips_nothing():
    """NxD Training's ``gradient_clip_val: null``: grad_clipping False, max_grad_norm None."""
    cfg = nxd_smp.neuronx_distributed_config(optimizer_config={**ON, "grad_clipping": False, "max_grad_norm": None})
    assert cfg["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": False, "max_grad_norm": None}
    a, b = _lin(), _lin()
    opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.SGD, a.parameters(), lr=1.0)
    unclipped = nxd_smp.Zero1Optimizer(b.parameters(), torch.optim.SGD, lr=1.0, max_norm=float("inf"))
    _steps(a, opt, 2)
    _steps(b, unclipped, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert opt.max_norm is None and float(opt.grad_norm) > 0
    with pytest.raises(ConfigError, match="grad_clipping=True"):
        nxd_smp.neuronx_distributed_config(optimizer_config={**ON, "grad_clipping": True, "max_grad_norm": None})
    with pytest.raises(ConfigError, match="max_norm"):  # switching clipping on needs a threshold
        opt.grad_clipping = True
    opt.max_norm  # (unchanged by the refusal)
    assert opt.grad_clipping is False


def test_sequence_parallel_as_nxds_scripts_pass_it():
    """run_llama_nxd.py passes ``--use_sequence_parallel`` as an int (default 1)."""
    assert nxd_smp.neuronx_distributed_config(sequence_parallel=1)["sequence_parallel"] is True
    assert nxd_smp.neuronx_distributed_config(sequence_parallel=0)["sequence_parallel"] is False
    with pytest.raises(ConfigError, match="sequence_parallel"):
        nxd_smp.neuronx_distributed_config(sequence_parallel="False")


# ---------------------------------------------------------------- NxD Training's checkpoint IO
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_nxd_trainings_state_dicts_save_fill_and_resume_bit_for_bit(pair, async_save):
    directory, ranks = pair
    for rank in ranks:
        got = rank[("nxd_training", async_save)]
        assert got["user_content"]["global_step"] == 2 and "loops" in got["user_content"]
        assert all(torch.equal(got["resumed"][n], got["reached"][n]) for n in got["reached"])
        assert got["weights_only"] == sorted(SHAPES) and got["filled"]
    tag = directory / str(async_save) / "step=2"
    names = sorted(str(f.relative_to(tag)) for f in tag.rglob("*") if f.is_file())
    assert names == ["checkpoint", "done", "model/dp_rank_00_tp_rank_00_pp_rank_00.pt", "nxd_smp_state_dicts.json",
                     "optim/dp_rank_00_tp_rank_00_pp_rank_00.pt", "optim/dp_rank_01_tp_rank_00_pp_rank_00.pt",
                     "user_content.pt"]  # NxD's layout, one folder per tag, every rank's optimizer file
    assert nxd_smp.has_checkpoint(directory / str(async_save))


def test_state_dicts_saved_at_dp2_are_refused_at_dp1_and_nothing_is_filled(pair):
    directory, _ = pair
    model_state, optimizer_state = {"kept": 1}, {}
    with pytest.raises(nxd_smp.CheckpointError, match="DP size 2.*this run: 1"):
        nxd_smp.load_checkpoint(directory / "False", "step=2", model=model_state, optimizer=optimizer_state)
    assert model_state == {"kept": 1} and optimizer_state == {}
    nxd_smp.load_checkpoint(directory / "False", model=model_state, optimizer=None)  # the weights load anywhere
    assert set(model_state) == set(SHAPES) | {"kept"}


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_optimum_neurons_wrapped_save_resumes_bit_for_bit(pair, async_save):
    """optimum-neuron saves with its optimizer wrapper (ours in ``.optimizer``) into the tag
    ``shards``, touching ``done`` there first when asynchronous and writing its metadata into it
    right after: the checkpoint takes both, and resumes bit for bit."""
    for rank in pair[1]:
        got = rank[("optimum_save", async_save)]
        assert all(torch.equal(got["resumed"][n], got["reached"][n]) for n in got["reached"])
        assert got["metadata_kept"] and got["is_link"]


def test_optimum_neurons_param_groups_choose_no_kernel_unless_the_user_did(monkeypatch):
    """optimum-neuron builds from a torch optimizer's ``param_groups``, which carry every kernel
    option: at the class default they choose nothing (the fused kernel and the compiled CPU
    update stay, the latter from ``COMPILE_MIN_NUMEL`` elements, lowered here for the small
    model), a user's own choice in them is kept."""
    monkeypatch.setattr(compiled_adamw, "COMPILE_MIN_NUMEL", 0)
    for chosen, compiled in (({}, True), ({"foreach": True}, False), ({"fused": False}, False)):
        model = _lin()
        user_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **chosen)
        opt = nxd_smp.NeuronZero1Optimizer(user_optimizer.param_groups, user_optimizer.__class__,
                                           use_grad_acc_hook=True, higher_cc_precision=True)
        assert (opt._inner_step.compiled is not None) is compiled, chosen
        assert all(group.get(k) == v for group in opt.inner_optimizer.param_groups for k, v in chosen.items())
        _steps(model, opt, 1)
