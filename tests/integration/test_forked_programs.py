"""The tests' forked programs against what they stand for (tests/distributed.py): ``run_python``
against ``python`` itself, ``run_launched`` against ``torchrun --standalone``. A program sees the
same ``sys.argv``, ``sys.path``, ``__name__``, working directory and environment, ends with the
same exit code and output (non-daemon threads joined, then ``atexit``), and a rank sees the same
torchrun variables (of the installed torch: its agent's, less the values that name one launch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import run_launched, run_python

ROOT = Path(__file__).resolve().parents[2]

# What a program reports of the interpreter it runs in, then how it ends.
PROBE = '''
import atexit, json, os, sys, threading, time
def later():
    time.sleep(0.2)
    print("thread done", flush=True)
threading.Thread(target=later).start()
atexit.register(lambda: print("atexit ran after the thread"))
print(json.dumps({"argv": sys.argv, "path": sys.path[:3], "cwd": os.getcwd(), "name": __name__,
                  "env": os.environ.get("PROBE_VALUE"), "main": type(sys.modules["__main__"]).__name__}))
print("to stderr", file=sys.stderr)
if "--fail" in sys.argv:
    raise KeyError("failed as asked")
sys.exit(int(os.environ.get("PROBE_EXIT", "0")))
'''


def both(args: list[str], tmp_path: Path, **extra_env: str) -> tuple[subprocess.CompletedProcess, ...]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / 'extra'}", "PROBE_VALUE": "seen", **extra_env}
    fresh = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    forked = run_python(args, cwd=tmp_path, env=env, timeout=120)
    return fresh, forked


@pytest.fixture
def probe_files(tmp_path: Path) -> Path:
    (tmp_path / "probe.py").write_text(PROBE)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(PROBE)
    return tmp_path


@pytest.mark.parametrize("how", ["-c", "-m", "script"])
@pytest.mark.parametrize("ending", ["exit 0", "exit 3", "exception"])
def test_a_forked_program_sees_and_ends_as_under_python(probe_files, how, ending):
    args = {"-c": ["-c", PROBE], "-m": ["-m", "pkg.probe"], "script": [str(probe_files / "probe.py")]}[how]
    args = [*args, "an argument"] + (["--fail"] if ending == "exception" else [])
    fresh, forked = both(args, probe_files, PROBE_EXIT="3" if ending == "exit 3" else "0")
    assert forked.returncode == fresh.returncode == {"exit 0": 0, "exit 3": 3, "exception": 1}[ending]
    assert forked.stdout == fresh.stdout, (forked.stdout, fresh.stdout)
    assert forked.stdout.splitlines()[1:] == ["thread done", "atexit ran after the thread"]
    if ending == "exception":  # the traceback from the program's own frames on
        assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1] == "KeyError: 'failed as asked'"
        assert "tests/distributed.py" not in forked.stderr
    else:
        assert forked.stderr == fresh.stderr == "to stderr\n"


def test_a_forked_program_past_its_time_is_killed_and_reported_as_subprocess_does():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=2)


def test_a_call_with_another_torch_xla_setting_is_refused():
    """transformers decided on torch_xla when the server imported it: such a program needs its own interpreter."""
    with pytest.raises(ValueError, match="USE_TORCH_XLA"):
        run_python(["-c", "pass"], env={**os.environ, "USE_TORCH_XLA": "1"})


ENV_OF_A_RANK = "import json, os, sys; print(json.dumps({'rank': os.environ['RANK'], 'env': dict(os.environ)}))"
#: Values that name one launch (its port, run id, error file) or the store's host, which differ by design.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
              "MASTER_ADDR"}


def test_launched_ranks_see_what_torchrun_gives_its_workers(tmp_path):
    (tmp_path / "env.py").write_text(ENV_OF_A_RANK)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "env.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert real.returncode == 0, real.stderr[-3000:]
    forked = run_launched(2, ["env.py"], cwd=tmp_path, env=env, timeout=300)
    assert forked.returncode == 0, forked.stderr[-3000:]

    def by_rank(out: str) -> dict[str, dict]:
        ranks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return {r["rank"]: {k: v for k, v in r["env"].items() if k not in PER_LAUNCH} for r in ranks}

    ours, theirs = by_rank(forked.stdout), by_rank(real.stdout)
    for rank in theirs:
        differ = {k: (ours[rank].get(k), v) for k, v in theirs[rank].items() if ours[rank].get(k) != v}
        differ.update({k: (v, None) for k, v in ours[rank].items() if k not in theirs[rank]})
        assert not differ, (rank, differ)  # name: (ours, torchrun's)
    assert sorted(by_rank(forked.stdout)) == ["0", "1"]


def test_a_failed_rank_stops_the_launch_with_its_exit_code():
    code = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(5)\ntime.sleep(120)"
    proc = run_launched(2, ["-c", code], timeout=100)
    assert proc.returncode == 5
