"""What XLA makes of the step graph (its HLO after XLA's passes, dumped by a child process):
each state tensor updated in its own buffer, with no copy, in both loop shapes."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import run_python

pytestmark = pytest.mark.requires_xla
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def step_graphs(tmp_path_factory) -> dict:
    """Per loop shape, the last graph XLA compiled in four steps of it (the steady step); and the
    buckets' shard sizes. One child process runs both shapes, one after the other."""
    tmp = tmp_path_factory.mktemp("xla_graphs")
    dump, out = tmp / "dump", tmp / "out.pt"
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": str(ROOT),
           "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$"}
    for name in ("XLA_USE_BF16", "XLA_DOWNCAST_BF16"):
        env.pop(name, None)
    proc = run_python(["-m", "tests.xla_graph_worker", str(out), str(dump)], cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    saved = torch.load(out)
    graphs = {shape: Path(files[-1]).read_text() for shape, files in saved["dumped"].items()}
    assert saved["dumped"]["one_graph"][-1] != saved["dumped"]["nxd_loop"][-1], "the one-graph loop compiled nothing"
    return {"graphs": graphs, "shard_numels": saved["shard_numels"]}


@pytest.mark.parametrize("shape", ["nxd_loop", "one_graph"])
def test_every_state_tensor_is_updated_in_its_own_buffer(step_graphs, shape):
    """XLA pairs donated buffers with outputs of the same size in order; paired crosswise, two
    state tensors of a bucket each cost a copy of the whole shard (and its temporary memory)."""
    hlo, shard_numels = step_graphs["graphs"][shape], step_graphs["shard_numels"]
    entry = hlo[hlo.index("\nENTRY"):]
    shard_shapes = {f"f32[{n}]" for n in shard_numels}
    copies = [line for line in entry.splitlines()
              if " copy(" in line and any(f"= {s}" in line for s in shard_shapes)]
    assert not copies, f"{len(copies)} shard-sized copies in the step graph:\n" + "\n".join(copies[:4])
    # and the buffers are still donated: each bucket's master and two Adam moments alias an input
    header = hlo.splitlines()[0]
    outputs = re.findall(r"[a-z0-9]+\[[0-9,]*\]", header[header.index(")->(") + 3:])
    donated = [int(i) for i in re.findall(r"\{(\d+)\}: \(\d+, \{\}, may-alias\)", header)]
    assert sum(outputs[i] in shard_shapes for i in donated) == 3 * len(shard_numels)

