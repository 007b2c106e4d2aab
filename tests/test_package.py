"""The package's rooms: which module may import which (no circles), and every public name
reachable where the README documents it."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nxd_smp"

README = PACKAGE.parent / "README.md"


def readme_table() -> dict[str, set[str]]:
    """The README's "Where things are" table: each room and what it imports from nxd_smp
    when it is imported (the last column: room names, or "nothing")."""
    text = README.read_text()
    section = text[text.index("## Where things are"):]
    end = section.find("\n## ", 4)
    section = section if end < 0 else section[:end]
    rooms = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        room = cells[0].strip("`").removesuffix(".py").removesuffix("/")
        imports = cells[-1]
        rooms[room] = set() if imports.startswith("nothing") else {
            name.strip().strip("`").removesuffix(".py") for name in imports.split(",") if name.strip()
        }
    return rooms


def room_of(path: Path) -> str:
    """A module's room: its own name, or its subpackage's (``backend/eager.py``: backend)."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def import_time_imports(path: Path) -> set[str]:
    """The rooms of nxd_smp a module imports when it is imported: module-level statements
    only (an import inside a function runs later, on use; an ``if __name__ == "__main__"``
    block runs only as a script)."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]  # ("nxd_smp", ...)
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            continue  # runs as a script only
        nodes = [node] + ([n for n in ast.walk(node)] if isinstance(node, (ast.If, ast.Try)) else [])
        for n in nodes:
            if not isinstance(n, ast.ImportFrom):
                continue
            if n.level:
                base = package[: len(package) - (n.level - 1)]
                names = [n.module] if n.module else [alias.name for alias in n.names]
                targets = [(*base, *name.split(".")) for name in names]
            elif n.module and n.module.startswith("nxd_smp."):
                targets = [tuple(n.module.split("."))]
            else:
                continue
            found.update(t[1] for t in targets if len(t) > 1)
    return found - {room_of(path)}


def graph() -> dict[str, set[str]]:
    rooms: dict[str, set[str]] = {}
    for p in PACKAGE.rglob("*.py"):
        if p.parent == PACKAGE and p.stem in ("__init__", "__main__"):
            continue
        rooms.setdefault(room_of(p), set()).update(import_time_imports(p))
    return rooms


def test_every_room_is_in_the_readme_table():
    assert set(graph()) == set(readme_table())


@pytest.mark.parametrize("module", sorted(graph()))
def test_each_room_imports_exactly_what_the_readme_table_says(module):
    documented = readme_table().get(module)
    assert graph()[module] == documented, (
        f"{module} imports {sorted(graph()[module])}; the README's table says {sorted(documented or [])}")


def test_no_import_circles():
    edges = graph()
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in edges.get(node, ()):
            assert state.get(nxt) != "open", "import circle: " + " -> ".join(path + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in edges:
        if node not in state:
            visit(node, [node])


def test_the_package_and_its_tools_import_in_a_fresh_process():
    code = (
        "import sys, nxd_smp\n"
        "import nxd_smp.cli, nxd_smp.xla_state_dict\n"
        "assert 'transformers' not in sys.modules, 'import nxd_smp pulled in transformers'\n"
        "print(sorted(m for m in sys.modules if m.startswith('nxd_smp')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert "nxd_smp.trainer" in out.stdout and "nxd_smp.runtime_env" in out.stdout


# Names the README documents, where it documents them: in ``nxd_smp`` and in the room that
# holds them.
DOCUMENTED = {
    "nxd_smp": [
        "MixedPrecisionConfig", "OptimizerConfig", "Zero1Config", "ConfigError", "neuronx_distributed_config",
        "initialize_parallel_optimizer", "Zero1Optimizer", "NeuronZero1Optimizer", "ClippedOptimizer",
        "save_checkpoint", "load_checkpoint", "finalize_checkpoint", "CheckpointError", "DynamicLossScaler",
        "precision_ops",
    ],
    "nxd_smp.mixed_precision_config": ["MixedPrecisionConfig", "OptimizerConfig", "Zero1Config", "ConfigError"],
    "nxd_smp.zero1_optimizer": ["Zero1Optimizer", "NeuronZero1Optimizer"],
    "nxd_smp.backend": ["select_backend", "Backend", "EagerBackend", "XlaBackend"],
    "nxd_smp.precision_ops": ["stochastic_round", "NaiveAMPModel", "cast_model"],
    "nxd_smp.checkpoint": ["save_checkpoint", "load_checkpoint", "inspect_checkpoint", "consolidate"],
    "nxd_smp.trainer": ["neuronx_distributed_config", "initialize_parallel_optimizer", "ClippedOptimizer",
                        "configs_from_nxd_dict"],
    "nxd_smp.runtime_env": ["check_master_weights_storage", "xla_bf16_variable", "set_stochastic_rounding"],
    "nxd_smp.xla_state_dict": ["export_xla", "import_xla"],
    "nxd_smp.hf_trainer": ["Zero1TrainerCallback"],
}


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_documented_names_are_importable_where_documented(module):
    mod = importlib.import_module(module)
    for name in DOCUMENTED[module]:
        assert getattr(mod, name) is not None, f"{module}.{name}"
    with pytest.raises(AttributeError):
        getattr(mod, "no_such_name")
