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
import multiprocessing
print(json.dumps({"argv": sys.argv, "path": sys.path[:3], "cwd": os.getcwd(), "name": __name__,
                  "env": os.environ.get("PROBE_VALUE"), "main": type(sys.modules["__main__"]).__name__,
                  "process": multiprocessing.current_process().name, "parent": multiprocessing.parent_process()}))
print("to stderr", file=sys.stderr)
if "--fail" in sys.argv:
    raise KeyError("failed as asked")
if "--interrupt" in sys.argv:
    raise KeyboardInterrupt
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
@pytest.mark.parametrize("ending", ["exit 0", "exit 3", "exception", "interrupt"])
def test_a_forked_program_sees_and_ends_as_under_python(probe_files, how, ending):
    args = {"-c": ["-c", PROBE], "-m": ["-m", "pkg.probe"], "script": [str(probe_files / "probe.py")]}[how]
    args = [*args, "an argument"] + {"exception": ["--fail"], "interrupt": ["--interrupt"]}.get(ending, [])
    fresh, forked = both(args, probe_files, PROBE_EXIT="3" if ending == "exit 3" else "0")
    assert forked.returncode == fresh.returncode == {"exit 0": 0, "exit 3": 3, "exception": 1, "interrupt": -2}[ending]
    assert forked.stdout == fresh.stdout, (forked.stdout, fresh.stdout)
    assert forked.stdout.splitlines()[1:] == ["thread done", "atexit ran after the thread"]
    if ending in ("exception", "interrupt"):  # the traceback from the program's own frames on, as python's
        assert forked.stderr.replace(str(probe_files), "") == fresh.stderr.replace(str(probe_files), "")
        assert "Traceback" in forked.stderr and "tests/distributed.py" not in forked.stderr
    else:
        assert forked.stderr == fresh.stderr == "to stderr\n"


def test_a_forked_program_past_its_time_is_killed_and_reported_as_subprocess_does():
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; print('started', flush=True); time.sleep(60)"], timeout=2)


#: A rank writes what it was given and a random draw (whole, by a rename), then rank 1 fails once
#: rank 0's file is there, while rank 0 waits: the launcher stops rank 0 only after it has written.
RANK_PROGRAM = ("import json, os, random, sys, time\n"
                "mine = os.path.join(sys.argv[1], os.environ['RANK'] + '.json')\n"
                "with open(mine + '.part', 'w') as f:\n"
                "    json.dump({'env': dict(os.environ), 'draw': random.random()}, f)\n"
                "os.replace(mine + '.part', mine)\n"
                "if os.environ['RANK'] == '1':\n"
                "    deadline = time.monotonic() + 60\n"
                "    while not os.path.exists(os.path.join(sys.argv[1], '0.json')) and time.monotonic() < deadline:\n"
                "        time.sleep(0.01)\n"
                "    sys.exit(5)\n"
                "time.sleep(120)\n")
#: Values that name one launch (its port and run id, the rank's error file) and who hosts the
#: rendezvous store (torchrun's agent, or here rank 0 at 127.0.0.1): they differ by design.
PER_LAUNCH = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE",
              "MASTER_ADDR"}


def test_launched_ranks_see_what_torchrun_gives_its_workers_and_a_failed_rank_stops_the_launch(tmp_path):
    """Every variable a rank gets, a random draw of its own, and the end of a launch in which rank
    1 fails: torchrun stops rank 0 and exits 1; the report names the rank and its exit code."""
    (tmp_path / "rank.py").write_text(RANK_PROGRAM)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    (tmp_path / "torchrun").mkdir()
    (tmp_path / "forked").mkdir()
    real = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "rank.py", "torchrun"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    forked = run_launched(2, ["rank.py", "forked"], cwd=tmp_path, env=env, timeout=100)
    assert forked.returncode == real.returncode == 1, (forked.returncode, real.returncode, real.stderr[-3000:])
    assert "rank 1 failed first, exit code 5" in forked.stderr, forked.stderr

    def by_rank(folder: str) -> dict[str, dict]:
        return {f.stem: json.loads(f.read_text()) for f in (tmp_path / folder).glob("*.json")}

    ours, theirs = by_rank("forked"), by_rank("torchrun")
    assert sorted(ours) == sorted(theirs) == ["0", "1"], (ours.keys(), theirs.keys())
    for rank in theirs:
        mine, given = ({k: v for k, v in r[rank]["env"].items() if k not in PER_LAUNCH} for r in (ours, theirs))
        differ = {k: (mine.get(k), v) for k, v in given.items() if mine.get(k) != v}
        differ.update({k: (v, None) for k, v in mine.items() if k not in given})
        assert not differ, (rank, differ)  # name: (ours, torchrun's)
    assert ours["0"]["draw"] != ours["1"]["draw"] and theirs["0"]["draw"] != theirs["1"]["draw"]  # seeds of their own


def test_a_call_that_differs_in_what_the_server_read_is_refused():
    """transformers decided on torch_xla, and torch read its settings, when the server imported them."""
    for name, value in (("USE_TORCH_XLA", "1"), ("TORCHINDUCTOR_FREEZING", "1"), ("TORCH_LOGS", "+dynamo")):
        with pytest.raises(ValueError, match=name):
            run_python(["-c", "pass"], env={**os.environ, name: value})
        with pytest.raises(ValueError, match=name):
            run_launched(2, ["-c", "pass"], env={**os.environ, name: value})
