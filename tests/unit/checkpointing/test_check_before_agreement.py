"""Everything a load installs is checked as it is, not as it declares itself, before the ranks agree
(DESIGN §5, "One spine"); what can still fail after the agreement fails on every rank at once.

The doors that carry tensors nxd_smp did not read itself: ``Zero1Optimizer.load_state_dict`` of a dict a
loop or framework ``torch.load``ed (Lightning's ``.ckpt``, a user's own file: ``weights_only=True`` keeps
meta tensors) and ``load_full_optimizer_state`` of a caller's tensors. For each field a load reads (a
moment, a master weight, a step counter, a hyperparameter) a tensor without data (meta), of another layout
(sparse) or that does not narrow exactly into its shard is refused with a ``CheckpointError`` naming the
field, and nothing changes: the parameters, the masters, the inner optimizer's state and the param groups
are as they were. At DP 2 on gloo, a crafted dict on rank 1 alone is refused by both ranks within seconds,
and a failure injected after the agreement (the model's own ``load_state_dict`` refusing on rank 1, or
the master shards failing to build there) is every rank's ``CheckpointError``, promptly, never a rank left
waiting in the masters' collective.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nxd_smp import CheckpointError, load_checkpoint, save_checkpoint
from nxd_smp.checkpoint import load_full_optimizer_state, read_checkpoint
from tests.checkpoint_scenario import build, train
from tests.distributed import run_ranks
from tests.hostile_worker import timed_call

#: What "promptly" means at DP 2: far below the process group's timeout (300 s in these tests).
PROMPT_S = 20


# ---------------------------------------------------------------- the live objects and what a load may change
def snapshot(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """Copies of everything a load installs into: parameters, masters, inner state, hyperparameters."""
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "masters": [m.detach().clone() for m in opt.master_shards],
            "inner": [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                      for s in opt.inner_optimizer.state.values()],
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}


def changes(before: dict[str, Any], model: torch.nn.Module, opt: Any) -> list[str]:
    """What differs from ``before`` (``snapshot``), by part."""
    after = snapshot(model, opt)

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    return [part for part in before if not same(before[part], after[part])]


def trained(seed: int = 0, steps: int = 2) -> tuple[torch.nn.Module, Any]:
    model, opt = build(seed=seed)
    train(model, opt, steps, 0)
    return model, opt


def round_trip(value: Any) -> Any:
    """``value`` as a loop or framework hands it back: ``torch.save`` then ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


# ---------------------------------------------------------------- the crafted values, one per kind
def meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(t, device="meta")


def sparse(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).to_sparse() if t.dim() else t


def too_wide(t: torch.Tensor) -> torch.Tensor:
    """A float64 tensor one of whose values overflows the fp32 shard it is installed into."""
    out = t.double().clone()
    out.reshape(-1)[0] = 1e300
    return out


KINDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"meta": meta, "sparse": sparse, "overflowing": too_wide}


def first_with_state(state: dict) -> Any:
    return next(k for k, entry in state.items() if entry and entry["exp_avg"].numel())


def edit_state_dict(sd: dict, field: str, make: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """Replace ``field`` of ``sd`` (a rank-local state dict) with ``make`` of it; returns the name a
    refusal must give."""
    key = first_with_state(sd["state"])
    if field == "lr":
        sd["param_groups"][0]["lr"] = make(torch.tensor(sd["param_groups"][0]["lr"]))
        return "lr"
    sd["state"][key][field] = make(sd["state"][key][field])
    return field


# ---------------------------------------------------------------- one rank: each door, each field, each kind
DICT_CASES = [(field, kind) for field in ("exp_avg", "master", "step", "lr") for kind in ("meta", "sparse")
              if not (kind == "sparse" and field in ("step", "lr"))] + [("exp_avg", "overflowing"),
                                                                       ("master", "overflowing")]


@pytest.mark.parametrize("field,kind", DICT_CASES)
def test_a_state_dict_with_a_tensor_the_install_cannot_read_is_refused_and_changes_nothing(field, kind):
    model, opt = trained()
    sd = round_trip(opt.state_dict())
    named = edit_state_dict(sd, field, KINDS[kind])
    before = snapshot(model, opt)
    with pytest.raises(CheckpointError, match=named) as refused:
        opt.load_state_dict(sd)
    assert "could not be loaded" not in str(refused.value)  # (a refusal by the check, not a wrapped surprise)
    assert changes(before, model, opt) == []


@pytest.mark.parametrize("field,kind", [("exp_avg", "meta"), ("exp_avg", "sparse"), ("exp_avg", "overflowing"),
                                        ("step", "meta"), ("master", "meta"), ("master", "overflowing")])
def test_a_full_state_with_a_tensor_the_install_cannot_read_is_refused_and_changes_nothing(field, kind, tmp_path):
    model, opt = trained()
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    full = read_checkpoint(tmp_path / "ckpt")["optimizer"]
    state, masters = full["state"], full["master_weights"]
    name = first_with_state(state)
    if field == "master":
        masters[name] = KINDS[kind](masters[name])
    else:
        state[name][field] = KINDS[kind](state[name][field])
    hypers = [g["hyper"] for g in full["groups"]]
    fresh, fresh_opt = trained(seed=1, steps=1)
    before = snapshot(fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=field if field != "master" else "master weight") as refused:
        load_full_optimizer_state(fresh, fresh_opt, state, hypers, masters)
    assert name in str(refused.value)
    assert changes(before, fresh, fresh_opt) == []


def test_the_same_state_loads_once_every_tensor_is_real(tmp_path):
    """The control: the round-tripped state dict and the full state above load, and the loaded optimizer
    holds the saved state (so the refusals above are of the crafted field, not of the door)."""
    model, opt = trained()
    sd = round_trip(opt.state_dict())
    fresh, fresh_opt = trained(seed=1, steps=1)
    fresh_opt.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(opt.master_shards, fresh_opt.master_shards))
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    full = read_checkpoint(tmp_path / "ckpt")["optimizer"]
    other, other_opt = trained(seed=2, steps=1)
    load_full_optimizer_state(other, other_opt, full["state"], [g["hyper"] for g in full["groups"]],
                              full["master_weights"])
    assert all(torch.equal(a, b) for a, b in zip(opt.master_shards, other_opt.master_shards))


# ---------------------------------------------------------------- DP 2: refused together, failing together
def _crafted_on_rank_one(rank: int, world: int) -> dict[str, Any]:
    """Each rank loads its own state dict back, rank 1's master weight made a meta tensor (what a
    ``torch.load`` of a crafted ``.ckpt`` keeps)."""
    import faulthandler

    faulthandler.dump_traceback_later(120, exit=True)  # a hung collective ends the test, not the suite
    model, opt = build()
    train(model, opt, 1, 0, rank, world)
    sd = round_trip(opt.state_dict())
    if rank == 1:
        edit_state_dict(sd, "master", meta)
    before = snapshot(model, opt)
    return {**timed_call(lambda: opt.load_state_dict(sd)), "changes": changes(before, model, opt)}


def test_a_crafted_state_on_one_rank_is_refused_by_every_rank_at_once():
    outcomes = run_ranks(2, _crafted_on_rank_one)
    for rank, outcome in enumerate(outcomes):
        assert outcome["type"] == "CheckpointError", (rank, outcome)
        assert outcome["seconds"] < PROMPT_S, (rank, outcome)
        assert outcome["changes"] == [], (rank, outcome)
    assert "meta tensor" in outcomes[1]["message"] and "another rank" in outcomes[0]["message"], outcomes


def _failing_after_the_agreement(rank: int, world: int, root: str, where: str) -> dict[str, Any]:
    """Every rank loads the checkpoint both saved; on rank 1 alone the part after the agreement fails: the
    model's own ``load_state_dict`` (a pre-hook of the model's, as a framework registers) or the
    building of the master shards."""
    import faulthandler

    from nxd_smp.optim.loading import install

    faulthandler.dump_traceback_later(120, exit=True)
    model, opt = build()
    train(model, opt, 1, 0, rank, world)
    save_checkpoint(root, model=model, optimizer=opt)
    fresh, fresh_opt = build(seed=4)
    train(fresh, fresh_opt, 1, 3, rank, world)
    if rank == 1:
        def refuse(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"rank 1's {where} failed")

        if where == "model hook":
            fresh.register_load_state_dict_pre_hook(refuse)
        else:
            install._masters = refuse
    groups_before = [dict((k, v) for k, v in g.items() if k != "params") for g in fresh_opt.param_groups]
    inner_before = snapshot(fresh, fresh_opt)["inner"]
    loaded = timed_call(lambda: load_checkpoint(root, model=fresh, optimizer=fresh_opt))
    after = snapshot(fresh, fresh_opt)
    return {**loaded,
            "optimizer put back": after["groups"] == groups_before and all(
                all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
                for a, b in zip(after["inner"], inner_before))}


@pytest.mark.parametrize("where", ["model hook", "master shards"])
def test_a_failure_after_the_agreement_on_one_rank_is_every_ranks_failure_at_once(where, tmp_path):
    outcomes = run_ranks(2, _failing_after_the_agreement, str(tmp_path / "ckpt"), where)
    for rank, outcome in enumerate(outcomes):
        assert outcome["type"] == "CheckpointError", (rank, outcome)
        assert outcome["seconds"] < PROMPT_S, (rank, outcome)
        assert f"rank 1: RuntimeError: rank 1's {where} failed" in outcome["message"], (rank, outcome)
        assert "load the checkpoint again" in outcome["message"], (rank, outcome)
        assert outcome["optimizer put back"], (rank, outcome)
