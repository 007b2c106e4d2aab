"""Where the CPU step's buffers start: each stream at its own offset within a page, in
tensors that behave like fresh allocations, kept so through the optimizer's life."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
import torch.nn as nn

from nxd_smp import MixedPrecisionConfig, Zero1Optimizer
from nxd_smp.core.memory import STREAMS, is_staggered, staggered_empty


@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_stream_starts_at_its_offset_in_a_tensor_of_its_own(stream, dtype):
    t = staggered_empty(1000, dtype, "cpu", stream)
    assert t.data_ptr() % 4096 == STREAMS[stream] and is_staggered(t, stream)
    assert t.numel() == 1000 and t.dtype == dtype and t.storage_offset() == 0 and t._base is None
    assert t.untyped_storage().nbytes() == 1000 * t.element_size()  # saves only its own bytes
    t.copy_(torch.arange(1000, dtype=dtype))
    buf = io.BytesIO()
    torch.save(t, buf)
    assert len(buf.getvalue()) < 1000 * t.element_size() + 2048
    buf.seek(0)
    assert torch.equal(torch.load(buf), t)


def test_the_offsets_differ_and_a_plain_tensor_is_not_moved_by_accident():
    assert len(set(STREAMS.values())) == len(STREAMS)
    with pytest.raises(ValueError, match="unknown stream"):
        staggered_empty(4, torch.float32, "cpu", "momentum")
    assert is_staggered(torch.empty(4, device="meta"), "master")  # only CPU memory is placed


def test_other_devices_get_a_plain_allocation():
    t = staggered_empty(10, torch.float32, "meta", "grad")
    assert t.device.type == "meta" and t.shape == (10,)


def test_the_allocation_outlives_the_name_it_was_made_under():
    t = staggered_empty(1 << 16, torch.float32, "cpu", "exp_avg").fill_(3.0)
    junk = [torch.full((1 << 16,), 7.0) for _ in range(8)]  # reuse of freed memory would show
    assert torch.all(t == 3.0)
    del junk


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 8)).to(torch.bfloat16)


def run_steps(m: nn.Module, opt: Zero1Optimizer, n: int) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for _ in range(n):
        m(x).float().pow(2).mean().backward()
        opt.step()


def streams_of(opt: Zero1Optimizer) -> dict[str, list[torch.Tensor]]:
    state = opt.inner_optimizer.state
    return {
        "master": list(opt.master_shards),
        "exp_avg": [state[m]["exp_avg"] for m in opt.master_shards],
        "exp_avg_sq": [state[m]["exp_avg_sq"] for m in opt.master_shards],
        "grad": list(opt._grads.buffers),
        "param": list(opt.backend._flat_params),
    }


def test_the_optimizer_places_every_stream_and_a_loaded_state_is_moved_into_place():
    mp = MixedPrecisionConfig(use_master_weights_in_ckpt=True)  # so the two runs go on identically
    m = model()
    opt = Zero1Optimizer(m.parameters(), torch.optim.AdamW, mixed_precision=mp, lr=1e-3, compile_update=True)
    run_steps(m, opt, 2)
    for stream, tensors in streams_of(opt).items():
        assert all(is_staggered(t, stream) for t in tensors), stream

    saved = opt.state_dict()
    m2 = model()
    m2.load_state_dict(m.state_dict())
    opt2 = Zero1Optimizer(m2.parameters(), torch.optim.AdamW, mixed_precision=mp, lr=1e-3, compile_update=True)
    opt2.load_state_dict(saved)
    for stream in ("exp_avg", "exp_avg_sq"):
        assert all(is_staggered(t, stream) for t in streams_of(opt2)[stream]), stream
        for mine, theirs in zip(streams_of(opt2)[stream], streams_of(opt)[stream]):
            assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the compiled step keeps working: no fallback warning
        run_steps(m2, opt2, 2)
        run_steps(m, opt, 2)
    assert opt2._inner_step.compiled.enabled
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
