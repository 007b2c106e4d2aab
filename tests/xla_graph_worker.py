"""Child process of tests/integration/test_xla_graphs.py: trains a bf16 MLP with nxd_smp on the XLA CPU device
at DP 1 in each loop shape in turn, with XLA's optimized HLO dumped to a folder, and saves what the
parent checks: how many graphs XLA had dumped when each shape ended, the bucket sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import torch


def main(out: str, dump: str) -> None:
    import torch_xla

    import nxd_smp

    device = torch_xla.device()
    dumped, shard_numels = {}, None
    for shape in ("nxd_loop", "one_graph"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Tanh())
                                      for _ in range(4))).to(torch.bfloat16).to(device)
        opt = nxd_smp.Zero1Optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3, max_norm=1.0,
                                     bucket_cap_mb=0.5)
        batches = [torch.randn(8, 256).bfloat16().to(device) for _ in range(2)]
        for _ in range(4):
            for x in batches:
                model(x).float().pow(2).mean().backward()
                if shape == "nxd_loop":
                    torch_xla.sync()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
        dumped[shape] = sorted(str(p) for p in Path(dump).glob("module_*.cpu_after_optimizations.txt"))
        shard_numels = [layout.shard_numel for layout in opt.bucket_layouts]
    torch.save({"dumped": dumped, "shard_numels": shard_numels}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
