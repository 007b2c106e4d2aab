"""The one state-fit check: a saved optimizer state is checked against the hyperparameters being
installed with it, as torch's ``load_state_dict`` installs them, never against the ones the live
optimizer happened to be built with.

The peer case is torch's own ``ZeroRedundancyOptimizer`` test (``test_state_dict``): SGD saved
with momentum 0.9 and loaded into an optimizer built with ``lr=0.01`` and no momentum. torch
installs the saved ``lr`` and ``momentum`` with the momentum buffers, and the next step uses them.
The oracle is torch's SGD doing the same: saved, loaded into a fresh SGD built without momentum,
stepped. Every door that loads an optimizer state takes it: the rank-local state dict, nxd_smp's
checkpoint, and torch's native checkpoint (``import_torch``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

import nxd_smp
from nxd_smp.checkpoint import load_checkpoint, save_checkpoint
from nxd_smp.interop.native_torch import import_torch

LR_SAVED, LR_BUILT, MOMENTUM = 0.1, 0.01, 0.9
FP32 = nxd_smp.MixedPrecisionConfig(use_master_weights_in_ckpt=True)


def torch_run() -> dict:
    """torch's SGD: one step with momentum, saved; a fresh SGD without momentum loads it and steps."""
    x = torch.nn.Parameter(torch.tensor([1.0]))
    saving = torch.optim.SGD([x], lr=LR_SAVED, momentum=MOMENTUM)
    x.grad = torch.ones(1)
    saving.step()
    saved = copy.deepcopy(saving.state_dict())
    loading = torch.optim.SGD([x], lr=LR_BUILT)
    loading.load_state_dict(saved)
    x.grad = torch.ones(1)
    loading.step()
    return {"x": x.detach().clone(), "momentum_buffer": loading.state[x]["momentum_buffer"].clone(),
            "lr": loading.param_groups[0]["lr"], "momentum": loading.param_groups[0]["momentum"]}


class One(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.tensor([1.0]))


def zero1(model: One, **hyper) -> nxd_smp.Zero1Optimizer:
    # (no clipping: torch's test steps with the raw gradient)
    return nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.SGD, mixed_precision=FP32, grad_clipping=False,
                                  **hyper)


def step(model: One, opt: nxd_smp.Zero1Optimizer) -> None:
    model.x.sum().backward()  # d/dx = 1, as torch's test
    opt.step()


def result(model: One, opt: nxd_smp.Zero1Optimizer) -> dict:
    shard = opt.inner_shards[0]
    return {"x": model.x.detach().clone(), "momentum_buffer": opt.inner_optimizer.state[shard]["momentum_buffer"][:1],
            "lr": opt.param_groups[0]["lr"], "momentum": opt.param_groups[0]["momentum"]}


def assert_trains_like_torch(got: dict, expected: dict) -> None:
    assert got["lr"] == expected["lr"] == LR_SAVED and got["momentum"] == expected["momentum"] == MOMENTUM
    assert torch.equal(got["x"], expected["x"]), (got["x"], expected["x"])
    assert torch.equal(got["momentum_buffer"], expected["momentum_buffer"])


def saved_with_momentum() -> tuple[One, nxd_smp.Zero1Optimizer]:
    model = One()
    opt = zero1(model, lr=LR_SAVED, momentum=MOMENTUM)
    step(model, opt)
    return model, opt


def test_the_oracle_is_torchs_own_reload():
    """torch's numbers, as its ZeroRedundancyOptimizer test states them."""
    expected = torch_run()
    assert torch.allclose(expected["x"], torch.tensor([0.71])) and torch.allclose(expected["momentum_buffer"],
                                                                                  torch.tensor([1.9]))


def test_a_rank_local_state_dict_with_momentum_loads_into_an_optimizer_built_without_it():
    model, opt = saved_with_momentum()
    state = copy.deepcopy(opt.state_dict())
    fresh = zero1(model, lr=LR_BUILT)  # (the same parameter, as torch's test reuses ``x``)
    fresh.load_state_dict(state)
    step(model, fresh)
    assert_trains_like_torch(result(model, fresh), torch_run())


def test_a_checkpoint_with_momentum_loads_into_an_optimizer_built_without_it(tmp_path):
    model, opt = saved_with_momentum()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    fresh_model = One()
    fresh = zero1(fresh_model, lr=LR_BUILT)
    load_checkpoint(tmp_path / "ckpt", model=fresh_model, optimizer=fresh)
    step(fresh_model, fresh)
    assert_trains_like_torch(result(fresh_model, fresh), torch_run())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # dcp.save in one process, as intended
@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")  # torch's own DCP writer
def test_torchs_own_checkpoint_with_momentum_imports_into_an_optimizer_built_without_it(tmp_path):
    """A native run saves ``get_state_dict`` with DCP after a momentum step; nxd_smp imports it."""
    native = One()
    sgd = torch.optim.SGD(native.parameters(), lr=LR_SAVED, momentum=MOMENTUM)
    native.x.grad = torch.ones(1)
    sgd.step()
    model_sd, optim_sd = get_state_dict(native, sgd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "native", no_dist=True)
    model = One()
    opt = zero1(model, lr=LR_BUILT)
    import_torch(tmp_path / "native", model=model, optimizer=opt)
    step(model, opt)
    assert_trains_like_torch(result(model, opt), torch_run())


def test_state_that_the_installed_hyperparameters_would_not_make_is_still_refused():
    """The check did not become lax: SGD without momentum keeps no state, so a state saved without
    momentum but holding a buffer (a hand-made dict) is refused, whatever the live group says."""
    model, opt = saved_with_momentum()
    state = copy.deepcopy(opt.state_dict())
    for group in state["param_groups"]:
        group["momentum"] = 0.0
    fresh = zero1(One(), lr=LR_BUILT, momentum=MOMENTUM)  # (its own group would make the buffer)
    with pytest.raises(ValueError, match="momentum_buffer"):
        fresh.load_state_dict(state)


def test_a_saved_value_is_judged_by_its_key_where_nothing_can_be_asked_of_the_class():
    """Where the class cannot be probed and the live optimizer holds no state yet (``kinds`` None), a saved
    value is a moment unless its key is ``step``: a file's 0-dim ``exp_avg`` for a shaped parameter is refused
    (it passed for a counter by its shape alone), and a 0-dim parameter's 0-dim moments are its moments."""
    from nxd_smp.optim.state_fit import check_state_entry, is_moment

    step = torch.tensor(3.0)
    problems = check_state_entry({"step": step, "exp_avg": torch.tensor(0.5)}, None, (3,), "w")
    assert len(problems) == 1 and problems[0].startswith("w/exp_avg: torch.float32 of shape ()"), problems
    assert check_state_entry({"step": step, "exp_avg": torch.zeros(3)}, None, (3,), "w") == []
    assert check_state_entry({"step": step, "exp_avg": torch.tensor(0.5)}, None, (), "s") == []
    assert is_moment("exp_avg", torch.tensor(0.5), saved=True) and not is_moment("exp_avg", torch.tensor(0.5))
    assert not is_moment("exp_avg", torch.zeros(3), {"exp_avg": False}, saved=True)  # (the class's word first)
