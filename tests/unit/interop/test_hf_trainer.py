"""nxd_smp.hf_trainer.Zero1TrainerCallback on its own: what it sets and what it refuses
(the real Trainer runs are in test_training_loops.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from nxd_smp import Zero1Optimizer
from nxd_smp.interop.hf_trainer import Zero1TrainerCallback
from tests.oracle import make_model


class Wrapped:  # what accelerate's AcceleratedOptimizer looks like from outside
    def __init__(self, optimizer):
        self.optimizer = optimizer


def begin(callback, optimizer, max_grad_norm):
    state = SimpleNamespace(log_history=[], global_step=0)
    callback.on_train_begin(SimpleNamespace(max_grad_norm=max_grad_norm), state, None, optimizer=optimizer)
    return state


@pytest.mark.parametrize("max_grad_norm, clipping, max_norm", [(0.5, True, 0.5), (0.0, False, 1.0), (None, False, 1.0)])
def test_the_trainers_max_grad_norm_governs_the_optimizers_clipping(max_grad_norm, clipping, max_norm):
    opt = Zero1Optimizer(make_model().parameters(), torch.optim.AdamW)
    with pytest.warns(UserWarning, match="clips as TrainingArguments says"):
        begin(Zero1TrainerCallback(), Wrapped(opt), max_grad_norm)
    assert (opt.grad_clipping, opt.max_norm) == (clipping, max_norm)


def test_it_replaces_the_logged_norm_in_the_logs_and_the_history():
    model = make_model()
    opt = Zero1Optimizer(model.parameters(), torch.optim.SGD, lr=0.1, max_norm=math.inf)
    callback = Zero1TrainerCallback()
    state = begin(callback, Wrapped(Wrapped(opt)), math.inf)
    (model.lin1.weight.float().sum() * 3).backward()
    opt.step()
    state.global_step = 1
    state.log_history.append({"loss": 1.0, "grad_norm": 0.0, "step": 1})
    logs = {"loss": 1.0, "grad_norm": 0.0}
    callback.on_log(None, state, None, logs=logs)
    expected = 3 * math.sqrt(model.lin1.weight.numel())
    assert logs["grad_norm"] == pytest.approx(expected) and state.log_history[-1]["grad_norm"] == logs["grad_norm"]


def test_it_refuses_a_trainer_without_a_zero1_optimizer():
    plain = torch.optim.AdamW(make_model().parameters())
    with pytest.raises(TypeError, match="Zero1Optimizer"):
        begin(Zero1TrainerCallback(), Wrapped(plain), 1.0)


def test_it_takes_nxds_wrapper_from_initialize_parallel_optimizer():
    import nxd_smp

    cfg = nxd_smp.neuronx_distributed_config(optimizer_config={"zero_one_enabled": True})
    opt = nxd_smp.initialize_parallel_optimizer(cfg, torch.optim.AdamW, make_model().parameters())
    with pytest.warns(UserWarning, match="clips as TrainingArguments says"):
        begin(Zero1TrainerCallback(), Wrapped(opt), 0.25)  # accelerate's wrapper around NxD's
    assert (opt.optimizer.grad_clipping, opt.optimizer.max_norm) == (True, 0.25)


def ddp_skip_checks(rank: int, world: int) -> dict:
    from nxd_smp.interop.hf_trainer import skip_ddp_allreduce

    model = make_model()
    partial = Zero1Optimizer(list(model.lin1.parameters()), torch.optim.AdamW)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    refused = ""
    try:
        skip_ddp_allreduce(ddp, Wrapped(partial))
    except ValueError as e:
        refused = str(e)
    full = Zero1Optimizer(model.parameters(), torch.optim.AdamW)
    return {"refused": refused, "first": skip_ddp_allreduce(ddp, full), "again": skip_ddp_allreduce(ddp, full),
            "not_ddp": skip_ddp_allreduce(model)}


def test_ddps_all_reduce_is_skipped_only_where_the_optimizer_reduces_every_gradient():
    """Parameters the nxd_smp optimizer does not manage need DDP's all-reduce: refused then. The
    hook goes on once (DDP takes one), and a model that is not DDP is left alone."""
    from tests.distributed import run_ranks

    for result in run_ranks(2, ddp_skip_checks):
        assert "the optimizer does not manage" in result["refused"], result
        assert result["first"] and result["again"] and not result["not_ddp"]
