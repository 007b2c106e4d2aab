"""NxD's trainer API: ``neuronx_distributed_config`` (defaults, partial dicts,
non-mutation, refusals, the environment checks it runs), ``initialize_parallel_optimizer``
and ``ClippedOptimizer`` (ZeRO-1 off)."""

from __future__ import annotations

import copy

import pytest
import torch

from nxd_smp import ClippedOptimizer, ConfigError, MixedPrecisionConfig, Zero1Optimizer, initialize_parallel_optimizer
from nxd_smp.interop.nxd import neuronx_distributed_config
from tests.oracle import batch, loss_fn, make_model

ON = {"zero_one_enabled": True}
OFF = {"zero_one_enabled": False}


def mp_of(**kwargs):
    return neuronx_distributed_config(**kwargs)["mixed_precision_config"]


def backward(model, step=0, micro=2, rank=0):
    for m in range(micro):
        x, y = batch(0, rank, step, m)
        loss_fn(model, x, y).backward()


@pytest.mark.parametrize("zero_one, expected", [(True, (True, True, False)), (False, (False, False, False))])
def test_mixed_precision_defaults_follow_zero_one(zero_one, expected):
    mp = mp_of(optimizer_config={"zero_one_enabled": zero_one})
    assert (mp["use_master_weights"], mp["use_fp32_grad_acc"], mp["use_master_weights_in_ckpt"]) == expected
    assert MixedPrecisionConfig.from_dict(None, zero_one_enabled=zero_one) == MixedPrecisionConfig(*expected)


def test_default_optimizer_config_is_nxds():
    cfg = neuronx_distributed_config()
    assert cfg["optimizer_config"] == {"zero_one_enabled": False, "grad_clipping": True, "max_grad_norm": 1.0}
    assert cfg["mixed_precision_config"] == {
        "use_master_weights": False,
        "use_fp32_grad_acc": False,
        "use_master_weights_in_ckpt": False,
    }


def test_partial_dicts_are_filled_and_explicit_values_kept():
    cfg = neuronx_distributed_config(
        optimizer_config={"zero_one_enabled": True, "max_grad_norm": 0.25},
        mixed_precision_config={"use_fp32_grad_acc": False},
    )
    assert cfg["optimizer_config"] == {"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 0.25}
    assert cfg["mixed_precision_config"] == {
        "use_master_weights": True,
        "use_fp32_grad_acc": False,
        "use_master_weights_in_ckpt": False,
    }


def test_inputs_are_not_mutated():
    opt = {"zero_one_enabled": True}
    mp = {"use_master_weights_in_ckpt": True}
    before = copy.deepcopy((opt, mp))
    cfg = neuronx_distributed_config(optimizer_config=opt, mixed_precision_config=mp)
    assert (opt, mp) == before
    assert cfg["optimizer_config"] is not opt and cfg["mixed_precision_config"] is not mp


def test_other_nxd_arguments_are_recorded():
    cfg = neuronx_distributed_config(tensor_parallel_size=8, sequence_parallel=True)
    assert cfg["tensor_parallel_size"] == 8 and cfg["sequence_parallel"] is True
    assert cfg["pipeline_parallel_size"] == 1


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"optimizer_config": {"zero_one_enabled": True, "bogus": 1}}, ["bogus"]),
        ({"mixed_precision_config": {"use_master_weight": True}}, ["use_master_weight"]),
        ({"tensor_paralel_size": 2}, ["tensor_paralel_size"]),
        ({"optimizer_config": {"zero_one_enabled": 1}}, ["zero_one_enabled"]),
        ({"optimizer_config": {**ON, "grad_clipping": "yes"}}, ["grad_clipping"]),
        ({"optimizer_config": ON, "mixed_precision_config": {"use_fp32_grad_acc": 1}}, ["use_fp32_grad_acc"]),
        ({"optimizer_config": {**ON, "max_grad_norm": 0.0}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": -1.0}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": float("nan")}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": True}}, ["max_grad_norm"]),
        ({"optimizer_config": {**ON, "max_grad_norm": "1.0"}}, ["max_grad_norm"]),
        ({"optimizer_config": ["zero_one_enabled"]}, ["optimizer_config"]),
        ({"tensor_parallel_size": 0}, ["tensor_parallel_size"]),
    ],
)
def test_bad_values_are_refused_naming_the_field(kwargs, names):
    with pytest.raises(ConfigError) as info:
        neuronx_distributed_config(**kwargs)
    for name in names:
        assert name in str(info.value)


def test_infinite_max_grad_norm_is_allowed():
    cfg = neuronx_distributed_config(optimizer_config={**ON, "max_grad_norm": float("inf")})
    assert cfg["optimizer_config"]["max_grad_norm"] == float("inf")


@pytest.mark.parametrize(
    "flag, message",
    [
        ("use_master_weights", "ZeRO-1 optimizer is not enabled, while use_master_weights is True"),
        ("use_fp32_grad_acc", "Non Zero-1 optimizer does not support use_fp32_grad_acc"),
        ("use_master_weights_in_ckpt", "Non Zero-1 optimizer does not support use_master_weights_in_ckpt"),
    ],
)
def test_smp_flags_without_zero_one_are_refused_as_nxd_does(flag, message):
    with pytest.raises(ConfigError, match=message):
        neuronx_distributed_config(optimizer_config=OFF, mixed_precision_config={flag: True})


def test_master_weights_in_checkpoint_need_master_weights():
    with pytest.raises(ConfigError, match="use_master_weights_in_ckpt"):
        neuronx_distributed_config(
            optimizer_config=ON,
            mixed_precision_config={"use_master_weights": False, "use_master_weights_in_ckpt": True},
        )
    with pytest.raises(ConfigError, match="use_master_weights_in_ckpt"):
        MixedPrecisionConfig(use_master_weights=False, use_master_weights_in_ckpt=True)


@pytest.mark.parametrize("value, refused", [("1", True), ("true", True), ("0", False), ("", False)])
def test_xla_use_bf16_is_refused_with_master_weights(monkeypatch, value, refused):
    monkeypatch.setenv("XLA_USE_BF16", value)
    if refused:
        with pytest.raises(ConfigError) as info:
            neuronx_distributed_config(optimizer_config=ON)
        assert "XLA_USE_BF16" in str(info.value) and "model.to(torch.bfloat16)" in str(info.value)
    else:
        neuronx_distributed_config(optimizer_config=ON)
    # without master weights the variable does not matter to us
    neuronx_distributed_config(optimizer_config=ON, mixed_precision_config={"use_master_weights": False})


def test_xla_downcast_bf16_is_nxd_trainings_default_precision_and_accepted(monkeypatch):
    monkeypatch.setenv("XLA_DOWNCAST_BF16", "1")  # precision.type: mixed_precision
    cfg = neuronx_distributed_config(optimizer_config=ON)
    assert cfg["mixed_precision_config"]["use_master_weights"] is True


# ---------------------------------------------------------------- ZeRO-1 off
def test_zero_one_off_returns_a_clipping_wrapper_that_matches_torch():
    cfg = neuronx_distributed_config(optimizer_config={"zero_one_enabled": False, "max_grad_norm": 0.05})
    model, reference = make_model(), make_model()
    opt = initialize_parallel_optimizer(cfg, torch.optim.SGD, model.parameters(), lr=0.1, momentum=0.9)
    assert isinstance(opt, ClippedOptimizer) and isinstance(opt, torch.optim.Optimizer)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        backward(model, step)
        backward(reference, step)
        grads = [p.grad for p in reference.parameters() if p.grad is not None]
        expected_norm = torch.stack([g.float().norm() for g in grads]).norm()
        torch._foreach_mul_(grads, (0.05 / (expected_norm + 1e-6)).clamp(max=1.0))
        opt.step()
        ref_opt.step()
        torch.testing.assert_close(opt.grad_norm, expected_norm)
        opt.zero_grad()
        ref_opt.zero_grad()
        scheduler.step()
        for g in ref_opt.param_groups:
            g["lr"] *= 0.5
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------- NxD 2.29's signature
NXD_KEYS = {
    "tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size", "context_parallel_size",
    "pipeline_config", "optimizer_config", "activation_checkpoint_config", "pad_model",
    "sequence_parallel", "model_init_config", "lora_config", "mixed_precision_config", "lnc_size",
}


def test_a_trn2_scripts_call_works_and_returns_nxds_dict():
    cfg = neuronx_distributed_config(
        tensor_parallel_size=8,
        optimizer_config={"zero_one_enabled": True, "grad_clipping": True, "max_grad_norm": 1.0},
        sequence_parallel=True,
        sequential_move_factor=11,
        lnc_size=2,
    )
    assert set(cfg) == NXD_KEYS
    assert cfg["lnc_size"] == 2 and cfg["tensor_parallel_size"] == 8 and cfg["sequence_parallel"] is True
    assert cfg["model_init_config"] == {"sequential_move_factor": 11, "meta_device_init": False, "param_init_fn": None}


def test_arguments_can_be_positional_as_in_nxd():
    cfg = neuronx_distributed_config(2, 4, 1, 1, {"num_microbatches": 8}, {"zero_one_enabled": True})
    assert (cfg["tensor_parallel_size"], cfg["pipeline_parallel_size"]) == (2, 4)
    assert cfg["pipeline_config"] == {"num_microbatches": 8}
    assert cfg["mixed_precision_config"]["use_master_weights"] is True


def test_model_init_config_is_filled_as_nxd_fills_it_without_touching_the_input():
    given = {"meta_device_init": True, "param_init_fn": print}
    cfg = neuronx_distributed_config(model_init_config=given, sequential_move_factor=5)
    assert cfg["model_init_config"] == {"meta_device_init": True, "param_init_fn": print, "sequential_move_factor": 5}
    assert given == {"meta_device_init": True, "param_init_fn": print}
    with pytest.raises(ConfigError, match="param_init_fn"):
        neuronx_distributed_config(model_init_config={"meta_device_init": True})


@pytest.mark.parametrize(
    "kwargs, field",
    [({"lnc_size": 0}, "lnc_size"), ({"sequential_move_factor": "11"}, "sequential_move_factor"),
     ({"pad_model": 1}, "pad_model"), ({"model_init_config": [1]}, "model_init_config"),
     ({"expert_parallel_size": -1}, "expert_parallel_size")],
)
def test_nxd_arguments_of_the_wrong_kind_are_refused(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        neuronx_distributed_config(**kwargs)


def test_model_parallel_configs_need_their_groups():
    cfg = neuronx_distributed_config(tensor_parallel_size=2, pipeline_parallel_size=2, optimizer_config=ON)
    with pytest.raises(ConfigError) as info:
        initialize_parallel_optimizer(cfg, torch.optim.AdamW, make_model().parameters())
    for needed in ("grad_norm_groups", "pipeline_groups", "process_group"):
        assert needed in str(info.value)
    off = neuronx_distributed_config(pipeline_parallel_size=2)
    with pytest.raises(ConfigError, match="pipeline_groups"):
        initialize_parallel_optimizer(off, torch.optim.AdamW, make_model().parameters())


# ---------------------------------------------------------------- the norm over TP x PP
TP_PP_CASES = [(True, True), (True, False), (False, True)]  # (with the pipeline groups, ZeRO-1)


def _tp_pp_ranks(rank: int, world_size: int) -> dict:
    """Every case of ``_tp_pp_worker`` on one set of ranks."""
    return {case: _tp_pp_worker(rank, world_size, *case) for case in TP_PP_CASES}


def _tp_pp_worker(rank: int, world_size: int, with_pipeline: bool, zero_one: bool) -> dict:
    """4 ranks: 2 pipeline stages x 2 tensor-parallel ranks, DP size 1. Each stage has a
    replicated and a split parameter; the tied embedding lives on both stages, marked
    shared on stage 1 (as NxD marks it)."""
    import torch.distributed as dist

    stage, tp_rank = divmod(rank, 2)
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    g = torch.Generator().manual_seed(100 * stage)
    replicated = torch.nn.Parameter(torch.randn(6, generator=g))
    embedding = torch.nn.Parameter(torch.randn(5, generator=torch.Generator().manual_seed(7)))
    embedding.shared = stage == 1
    split = torch.nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(10 * rank + 1)))
    split.tensor_model_parallel = True
    params = [replicated, split, embedding]
    cfg = neuronx_distributed_config(
        tensor_parallel_size=2, pipeline_parallel_size=2,
        optimizer_config={"zero_one_enabled": zero_one, "max_grad_norm": 0.1},
    )
    if with_pipeline:
        opt = initialize_parallel_optimizer(
            cfg, torch.optim.SGD, params, lr=1.0, process_group=singles[rank],
            grad_norm_groups=tp_groups[stage], pipeline_groups=pp_groups[tp_rank],
        )
    else:  # what the config check refuses: the norm of this stage only
        opt = Zero1Optimizer(params, torch.optim.SGD, lr=1.0, max_norm=0.1,
                             process_group=singles[rank], grad_norm_groups=tp_groups[stage])
    before = [p.detach().clone() for p in params]
    (sum((p * p).sum() for p in params) / 2).backward()  # gradient = the parameter itself
    grads = [b.clone() for b in before]
    opt.step()
    return {
        "norm": float(opt.grad_norm),
        "stage": stage,
        "sq": {"replicated": float(grads[0].pow(2).sum()), "split": float(grads[1].pow(2).sum()),
               "embedding": float(grads[2].pow(2).sum())},
        "update": [(b - p.detach()) for b, p in zip(before, params)],
    }


@pytest.fixture(scope="module")
def tp_pp_ranks():
    """4 gloo ranks (2 pipeline stages x 2 tensor-parallel ranks) run every case once."""
    from tests.distributed import run_ranks

    ranks = run_ranks(4, _tp_pp_ranks)
    return {case: [r[case] for r in ranks] for case in TP_PP_CASES}


@pytest.mark.parametrize("zero_one", [True, False], ids=["zero1", "zero1_off"])
def test_the_norm_spans_tensor_and_pipeline_parallel_ranks_counting_tied_weights_once(tp_pp_ranks, zero_one):
    ranks = tp_pp_ranks[(True, zero_one)]
    by_stage = {s: [r for r in ranks if r["stage"] == s] for s in (0, 1)}
    expected_sq = sum(
        by_stage[s][0]["sq"]["replicated"] + sum(r["sq"]["split"] for r in by_stage[s]) for s in (0, 1)
    ) + by_stage[0][0]["sq"]["embedding"]
    for r in ranks:
        assert r["norm"] == pytest.approx(expected_sq ** 0.5, rel=1e-6)
    # clipping with that norm: the whole model's update has norm max_grad_norm
    update_sq = sum(
        float(by_stage[s][0]["update"][0].pow(2).sum()) + sum(float(r["update"][1].pow(2).sum()) for r in by_stage[s])
        for s in (0, 1)
    ) + float(by_stage[0][0]["update"][2].pow(2).sum())
    assert update_sq ** 0.5 == pytest.approx(0.1, rel=1e-4)


def test_without_pipeline_groups_the_norm_covers_one_stage(tp_pp_ranks):
    """What the pipeline groups fix: one stage's norm is smaller, so the clipped update of
    the whole model exceeds max_grad_norm."""
    ranks = tp_pp_ranks[(False, True)]
    assert ranks[0]["norm"] != pytest.approx(ranks[2]["norm"], rel=1e-3)
