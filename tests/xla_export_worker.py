"""Run on the XLA CPU device by test_xla.py: our checkpoint exported to torch_xla's ZeRO-1
layout, loaded by torch_xla's own ZeroRedundancyOptimizer, takes the same next step as
ours; and torch_xla's state dict imports back into a Zero1Optimizer."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1)
MAX_NORM = 0.5


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 6)).to(torch.bfloat16)


def fixed_grads(model: nn.Module, steps: int):
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(p.shape, generator=g) * 0.3).bfloat16() for p in model.parameters()] for _ in range(steps)]


def backward(model: nn.Module, grads) -> None:
    params = list(model.parameters())
    sum((p * d.to(p.device)).sum() for p, d in zip(params, grads)).backward()


def main(out_path: str, nxd_root: str | None = None) -> None:
    import torch_xla
    from torch_xla.distributed.zero_redundancy_optimizer import ZeroRedundancyOptimizer

    from nxd_smp import MixedPrecisionConfig, Zero1Optimizer, load_checkpoint, save_checkpoint
    from nxd_smp.interop.torch_xla import export_xla, import_xla

    device = torch_xla.device()
    tmp = Path(tempfile.mkdtemp())
    ours = make_model()
    grads = fixed_grads(ours, 3)
    mp = MixedPrecisionConfig(use_master_weights_in_ckpt=True)
    opt = Zero1Optimizer(ours.parameters(), torch.optim.AdamW, mixed_precision=mp, max_norm=MAX_NORM, **HYPER)
    for step in range(2):
        backward(ours, grads[step])
        opt.step()
        opt.zero_grad()
    save_checkpoint(tmp / "c", model=ours, optimizer=opt)
    (file,) = export_xla(tmp / "c", tmp / "xla", dp_size=1)
    backward(ours, grads[2])
    opt.step()
    opt.zero_grad()

    theirs_cpu = make_model()
    load_checkpoint(tmp / "c", model=theirs_cpu)  # the model weights at the save
    theirs = theirs_cpu.to(device)
    zero = ZeroRedundancyOptimizer(
        theirs.parameters(), torch.optim.AdamW, optimizer_dtype=torch.float32, grad_clipping=True,
        max_norm=MAX_NORM, pin_layout=False, use_grad_acc_hook=True, save_master_weights=True,
        higher_cc_precision=True, **HYPER,
    )
    zero.load_state_dict(torch.load(file, weights_only=False))
    torch_xla.sync()
    backward(theirs, grads[2])
    zero.step()
    torch_xla.sync()
    their_state = zero.state_dict()
    torch.save(their_state, tmp / "theirs.pt")

    imported_model = make_model()
    with torch.no_grad():
        for p, q in zip(imported_model.parameters(), theirs.parameters()):
            p.copy_(q.cpu())
    imported = Zero1Optimizer(imported_model.parameters(), torch.optim.AdamW, mixed_precision=mp,
                              max_norm=MAX_NORM, **HYPER)
    import_xla([tmp / "theirs.pt"], model=imported_model, optimizer=imported)

    torch.save({
        "ours": [p.detach().clone() for p in ours.parameters()],
        "theirs": [p.detach().cpu() for p in theirs.parameters()],
        "ours_state": [{k: v.clone() for k, v in opt.inner_optimizer.state[m].items()} for m in opt.master_shards],
        "imported_state": [{k: v.clone() for k, v in imported.inner_optimizer.state[m].items()}
                           for m in imported.master_shards],
        "ours_masters": [m.clone() for m in opt.master_shards],
        "imported_masters": [m.clone() for m in imported.master_shards],
    }, out_path)
    if nxd_root is not None:  # NxD's checkpoint folders, written by torch_xla's own ZeRO-1 at DP 1
        from tests.nxd_layout import write_fixtures

        write_fixtures(0, 1, nxd_root)


if __name__ == "__main__":
    main(*sys.argv[1:])
