"""The fp32 masters under the names the model's own state dict gives them: a model whose state-dict hooks
split fused parameters (TorchTitan's fused attention, ``wqkv`` saved as ``wq``/``wk``/``wv`` with grouped
KV heads, and its fused SwiGLU, ``w13`` of shape ``(hidden, 2, dim)`` saved as ``w1``/``w3``), exported
offline from an instance of the model (on the meta device) and taken from the live optimizer.

The oracle is the masters themselves, cut by plain indexing written here (not by the model's hooks): each
exported entry must be exactly that cut of the fp32 master, and a model of that architecture in fp32 that
loads the export (its own load hooks merging the pieces) holds exactly the masters."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from nxd_smp import CheckpointError, MixedPrecisionConfig, Zero1Optimizer, save_checkpoint
from nxd_smp.checkpoint import read_checkpoint
from nxd_smp.interop.native_torch import export_safetensors, export_torch, master_state_dict
from tests.distributed import run_ranks

DIM, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 8, 4, 2, 2, 12
PER_KV = HEADS // KV_HEADS  # query heads per KV head
R = PER_KV + 2  # a KV group's rows: its query heads, one K, one V


class FusedAttention(nn.Module):
    """One projection for Q, K and V, grouped by KV head; saved as ``wq``/``wk``/``wv``."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, KV_HEADS * R * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.register_state_dict_post_hook(FusedAttention._split)
        self.register_load_state_dict_pre_hook(FusedAttention._merge)

    @staticmethod
    def _split(module, state, prefix, local_metadata) -> None:
        w = state.pop(f"{prefix}wqkv.weight").reshape(KV_HEADS, R, HEAD_DIM, DIM)
        state[f"{prefix}wq.weight"] = w[:, :PER_KV].reshape(-1, DIM).contiguous()
        state[f"{prefix}wk.weight"] = w[:, PER_KV].reshape(-1, DIM).contiguous()
        state[f"{prefix}wv.weight"] = w[:, PER_KV + 1].reshape(-1, DIM).contiguous()

    @staticmethod
    def _merge(module, state, prefix, *args) -> None:
        q = state.pop(f"{prefix}wq.weight").reshape(KV_HEADS, PER_KV, HEAD_DIM, DIM)
        k = state.pop(f"{prefix}wk.weight").reshape(KV_HEADS, 1, HEAD_DIM, DIM)
        v = state.pop(f"{prefix}wv.weight").reshape(KV_HEADS, 1, HEAD_DIM, DIM)
        state[f"{prefix}wqkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, DIM)

    def forward(self, x):
        qkv = self.wqkv(x).reshape(*x.shape[:-1], KV_HEADS, R, HEAD_DIM)
        q, v = qkv[..., :PER_KV, :], qkv[..., PER_KV + 1:, :]
        return self.wo((q * v.tanh()).reshape(*x.shape[:-1], -1))


class FusedSwiGLU(nn.Module):
    """Gate and up projection as one ``(hidden, 2, dim)`` weight; saved as ``w1``/``w3``."""

    def __init__(self) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.randn(HIDDEN, 2, DIM) / DIM ** 0.5)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.register_state_dict_post_hook(FusedSwiGLU._split)
        self.register_load_state_dict_pre_hook(FusedSwiGLU._merge)

    @staticmethod
    def _split(module, state, prefix, local_metadata) -> None:
        w13 = state.pop(f"{prefix}w13")
        state[f"{prefix}w1.weight"], state[f"{prefix}w3.weight"] = w13[:, 0].contiguous(), w13[:, 1].contiguous()

    @staticmethod
    def _merge(module, state, prefix, *args) -> None:
        state[f"{prefix}w13"] = torch.stack([state.pop(f"{prefix}w1.weight"), state.pop(f"{prefix}w3.weight")], dim=1)

    def forward(self, x):
        gate, up = torch.einsum("...d,hgd->...hg", x, self.w13).unbind(-1)
        return self.w2(nn.functional.silu(gate) * up)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = FusedAttention()
        self.feed_forward = FusedSwiGLU()
        self.norm = nn.LayerNorm(DIM)
        self.register_buffer("scale", torch.full((DIM,), 0.5))

    def forward(self, x):
        x = x + self.attention(self.norm(x) * self.scale)
        return x + self.feed_forward(x)


def expected_entries(masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The masters cut into the stock names by plain row selection (the oracle)."""
    qkv = masters["attention.wqkv.weight"]
    rows = {"wq": [], "wk": [], "wv": []}
    for g in range(KV_HEADS):
        base = g * R * HEAD_DIM
        rows["wq"] += range(base, base + PER_KV * HEAD_DIM)
        rows["wk"] += range(base + PER_KV * HEAD_DIM, base + (PER_KV + 1) * HEAD_DIM)
        rows["wv"] += range(base + (PER_KV + 1) * HEAD_DIM, base + R * HEAD_DIM)
    out = {f"attention.{name}.weight": qkv[torch.tensor(index)] for name, index in rows.items()}
    w13 = masters["feed_forward.w13"]
    out["feed_forward.w1.weight"] = torch.stack([w13[h, 0] for h in range(HIDDEN)])
    out["feed_forward.w3.weight"] = torch.stack([w13[h, 1] for h in range(HIDDEN)])
    for name in ("attention.wo.weight", "feed_forward.w2.weight", "norm.weight", "norm.bias"):
        out[name] = masters[name]
    return out


def trained_block(rank: int = 0, world_size: int = 1) -> tuple[Block, Zero1Optimizer]:
    torch.manual_seed(0)
    model = Block().to(torch.bfloat16)
    opt = Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, compile_update=False, bucket_cap_mb=0.0002,
                         mixed_precision=MixedPrecisionConfig(use_master_weights_in_ckpt=True))
    for step in range(3):
        torch.manual_seed(100 * step + rank)
        model(torch.randn(4, DIM).bfloat16()).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("fused") / "ckpt"
    model, opt = trained_block()
    save_checkpoint(path, model=model, optimizer=opt)
    return path, read_checkpoint(path)["optimizer"]["master_weights"]


def meta_block() -> Block:
    with torch.device("meta"):
        return Block().to(torch.bfloat16)


def test_without_the_model_the_split_masters_are_refused(saved, tmp_path):
    path, _ = saved
    with pytest.raises(CheckpointError, match=r"wqkv\.weight.*model="):
        export_safetensors(path, tmp_path / "w.safetensors", masters=True)
    assert not (tmp_path / "w.safetensors").exists()


def test_safetensors_export_through_a_meta_model_gives_each_piece_of_each_fp32_master(saved, tmp_path):
    from safetensors.torch import load_file

    path, masters = saved
    export_safetensors(path, tmp_path / "w.safetensors", masters=True, model=meta_block())
    got = load_file(tmp_path / "w.safetensors")
    expected = expected_entries(masters)
    assert set(got) == set(expected) | {"scale"}
    for name, value in expected.items():
        assert got[name].dtype == torch.float32 and torch.equal(got[name], value), name
    assert got["scale"].dtype == torch.bfloat16 and torch.equal(got["scale"], torch.full((DIM,), 0.5).bfloat16())


def test_dcp_export_through_a_meta_model_loads_into_the_fp32_model_as_the_masters(saved, tmp_path):
    """What TorchTitan does with such an export: ``dcp.load`` into its model's own (split) state dict, then
    ``load_state_dict``, whose pre-hooks merge the pieces: the fused fp32 parameters are the masters."""
    path, masters = saved
    export_torch(path, tmp_path / "dcp", model=meta_block())
    model = Block()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    model.load_state_dict(state["model"])
    for name, param in model.named_parameters():
        assert torch.equal(param, masters[name]), name


def test_a_model_that_is_not_the_saved_one_is_refused(saved, tmp_path):
    path, _ = saved

    class Other(Block):
        def __init__(self) -> None:
            super().__init__()
            self.attention.register_state_dict_post_hook(lambda m, s, p, _: s.update(
                {f"{p}wq.weight": s[f"{p}wq.weight"] * 2}))

    with torch.device("meta"):
        doubled = Other().to(torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"attention\.wq\.weight.*does not round"):
        export_torch(path, tmp_path / "d1", model=doubled)
    with torch.device("meta"):
        wider = nn.Sequential(nn.Linear(DIM, 2 * DIM))
    with pytest.raises(CheckpointError, match="not the one saved"):
        export_safetensors(path, tmp_path / "w.safetensors", masters=True, model=wider)
    with pytest.raises(TypeError, match="masters=True"):
        export_safetensors(path, tmp_path / "w.safetensors", model=meta_block())
    assert not (tmp_path / "d1").exists() and not (tmp_path / "w.safetensors").exists()


def live_masters(rank: int, world_size: int, path: str) -> dict:
    model, opt = trained_block(rank, world_size)
    save_checkpoint(path, model=model, optimizer=opt)
    return {"got": master_state_dict(model, opt), "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("world_size", [1, 2])
def test_the_live_optimizer_gives_its_masters_under_the_models_own_names(tmp_path, world_size):
    """``master_state_dict(model, opt)`` on every rank: the model's own state dict (split names, buffers)
    with the masters gathered over the data-parallel group, equal to the checkpoint's masters cut by hand."""
    path = tmp_path / "ckpt"
    results = run_ranks(world_size, live_masters, str(path))
    expected = expected_entries(read_checkpoint(path)["optimizer"]["master_weights"])
    for rank, result in enumerate(results):
        got = result["got"]
        assert set(got) == set(expected) | {"scale"}, rank
        for name, value in expected.items():
            assert got[name].dtype == torch.float32 and torch.equal(got[name], value), (rank, name)
        assert not torch.equal(got["attention.wq.weight"].bfloat16().float(), got["attention.wq.weight"])


def test_masters_rounded_ties_away_as_param_remainders_keep_them_are_the_saved_parameters():
    """Under ``use_param_remainders`` a parameter is its master rounded with ties away from zero, not to
    nearest even: a master whose lower half is exactly 0x8000 under an even upper half rounds to its saved
    parameter only that way, and is still its master."""
    from nxd_smp.interop.native_torch import masters_through_model
    from nxd_smp.optim.rounding import round_ties_away

    tie = torch.tensor([0x3F808000], dtype=torch.int32).view(torch.float32)  # 1.0 + half a bf16 ulp
    master = torch.cat([tie, torch.randn(7)]).view(2, 4)
    saved = {"weight": round_ties_away(master)}
    assert not torch.equal(master.to(torch.bfloat16), saved["weight"])  # (nearest even rounds the tie down)
    with torch.device("meta"):
        model = nn.Linear(4, 2, bias=False).to(torch.bfloat16)
    assert torch.equal(masters_through_model(model, saved, {"weight": master}, "ckpt")["weight"], master)
