"""The house: its parts in layers, each importing only from the layers below it (deferred imports
count), no circle between parts or modules, the README's rooms table the tree's, the sizes the
issue set, each single job in its one place, and a deliberate public surface."""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "nxd_smp"
README = PACKAGE.parent / "README.md"
DESIGN = PACKAGE.parent / "docs" / "design.md"

#: The layers, bottom up: a part may import the parts of lower layers only, and, within a layer,
#: only along the arrows ``SIDEWAYS`` lists.
LAYERS = [
    ["core"],
    ["mixed_precision_config"],  # config
    ["backend"],
    ["optim"],
    ["precision_ops", "grad_accum"],  # the optimizer parts' entry modules
    ["zero1_optimizer"],
    ["checkpointing"],
    ["checkpoint"],
    ["interop.torch_xla", "interop.native_torch", "interop.nxd", "interop.loop_checkpoints", "interop.accelerate",
     "interop.ddp", "interop.hf_trainer", "interop.lightning", "interop.torchtitan", "interop"],
    ["cli"],
    ["package"],
]
SIDEWAYS = {
    ("interop.nxd", "interop.torch_xla"),  # NxD's ZeRO-1 files are torch_xla's per-rank dicts
    ("interop.accelerate", "interop.loop_checkpoints"),
    ("interop.hf_trainer", "interop.loop_checkpoints"),
    ("interop.hf_trainer", "interop.ddp"),  # (DDP's all-reduce skipped, as Lightning's callback does)
    ("interop.lightning", "interop.ddp"),
    ("interop", "interop.nxd"),  # (importing interop registers NxD's folders...)
    ("interop", "interop.loop_checkpoints"),  # (...and the loops' advice)
}
LAYER_OF = {part: i for i, parts in enumerate(LAYERS) for part in parts}
#: The five entry modules of the design card, and the top of the package.
ENTRY = {"zero1_optimizer", "mixed_precision_config", "grad_accum", "checkpoint", "precision_ops"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str:
    """A module's part: its subpackage (``interop``'s are one part each), or itself at the top."""
    names = module.split(".")[1:]
    if not names or names == ["__main__"]:
        return "package"
    if names[0] == "interop" and len(names) > 1:
        return f"interop.{names[1]}"
    return names[0]


@functools.cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, source: str | None = None) -> set[str]:
    """Every nxd_smp module ``path`` imports (its text, or ``source`` in its place), wherever the
    import statement stands (inside a function, under ``if TYPE_CHECKING``: a deferred import is
    still an arrow)."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                stem = [*base, *node.module.split(".")] if node.module else base
            elif node.module and node.module.split(".")[0] == "nxd_smp":
                stem = node.module.split(".")
            else:
                continue
            for alias in node.names:  # ``from . import x`` names a module; ``from .m import f`` a name in m
                candidate = ".".join([*stem, alias.name])
                found.add(candidate if candidate in known else ".".join(stem))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "nxd_smp")
    return {m for m in found if m in known and m != module}


@functools.cache
def module_graph() -> dict[str, set[str]]:
    return {name: imports_of(path) for name, path in modules().items()}


def part_graph() -> dict[str, set[str]]:
    parts: dict[str, set[str]] = {}
    for module, targets in module_graph().items():
        parts.setdefault(part_of(module), set()).update(part_of(t) for t in targets)
    return {part: targets - {part} for part, targets in parts.items()}


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return path + [nxt]
            if nxt not in state and (circle := visit(nxt, path + [nxt])):
                return circle
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state and (circle := visit(node, [node])):
            return circle
    return None


def test_every_part_has_a_layer():
    assert set(part_graph()) == set(LAYER_OF), "parts without a layer, or layers without a part"


@pytest.mark.parametrize("part", sorted(LAYER_OF))
def test_each_part_imports_only_from_the_layers_below_it(part):
    wrong = sorted(t for t in part_graph().get(part, ()) if LAYER_OF[t] > LAYER_OF[part]
                   or LAYER_OF[t] == LAYER_OF[part] and (part, t) not in SIDEWAYS)
    assert not wrong, f"{part} (layer {LAYER_OF[part]}) imports {wrong}, which are not below it"


def test_the_layer_rule_sees_deferred_imports():
    """The reader counts an import inside a function (and under ``if TYPE_CHECKING``), so a core
    module reaching up that way would fail the rule above."""
    source = "def f():\n    from ..checkpoint import save_checkpoint\nif False:\n    from .. import interop\n"
    assert imports_of(PACKAGE / "core" / "layout.py", source) == {"nxd_smp.checkpoint", "nxd_smp.interop"}


def test_no_circle_between_parts_or_modules():
    assert find_circle(part_graph()) is None, find_circle(part_graph())
    assert find_circle(module_graph()) is None, find_circle(module_graph())


def readme_rooms() -> dict[str, str]:
    """The README's "Where things are" table: each part (its first column) and its layer."""
    text = README.read_text()
    section = text[text.index("## Where things are"):]
    section = section[: section.find("\n## ", 4)] if section.find("\n## ", 4) > 0 else section
    rooms = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rooms[cells[0].strip("`").removesuffix(".py").removesuffix("/").replace("/", ".")] = cells[1]
    return rooms


def test_the_readmes_rooms_table_is_the_tree():
    rooms = readme_rooms()
    tree = {part for part in LAYER_OF if part != "package"}
    assert set(rooms) == tree, f"missing from the table {sorted(tree - set(rooms))}, not in the tree " \
                               f"{sorted(set(rooms) - tree)}"


def test_the_design_page_opens_with_the_layers():
    opening = DESIGN.read_text()[:6000]
    assert "## The layers" in opening and all(f"`{part.split('.')[-1]}" in opening for part in
                                              ("core", "backend", "optim", "checkpointing", "interop"))


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_top_holds_the_entry_modules_and_the_cli_only():
    """nxd_smp has had no release: no re-export of an earlier import path sits at the top (DESIGN §3)."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == ENTRY | {"__init__", "__main__", "cli"}, sorted(top - ENTRY)


def test_the_error_classes_are_defined_once_in_the_core():
    """Every exception class a part raises is defined in ``core/errors.py`` (a private signal that never
    leaves the strict reader, ``_Refused``, aside)."""
    from nxd_smp.core import errors as errors_module
    exceptions = {name for name, value in vars(errors_module).items()
                  if isinstance(value, type) and issubclass(value, BaseException)}
    defined = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and any(
                    getattr(base, "id", getattr(base, "attr", "")).endswith(("Error", "Exception", "Warning"))
                    for base in node.bases):
                defined.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert defined == {name: ["core/errors.py"] for name in exceptions}, defined
    import nxd_smp
    from nxd_smp.checkpoint import CheckpointError
    from nxd_smp.core import errors
    from nxd_smp.mixed_precision_config import ConfigError
    assert nxd_smp.ConfigError is ConfigError is errors.ConfigError
    assert nxd_smp.CheckpointError is CheckpointError is errors.CheckpointError


@functools.cache
def code_lines(pattern: str) -> dict[str, list[int]]:
    """Where ``pattern`` matches outside comments and docstrings, by module."""
    found: dict[str, list[int]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docs = {n.body[0].lineno for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        doc_lines = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) and n.lineno in docs:
                doc_lines.update(range(n.lineno, n.end_lineno + 1))
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if number not in doc_lines and re.search(pattern, line.split("#")[0]):
                found.setdefault(str(path.relative_to(PACKAGE)), []).append(number)
    return found


@pytest.mark.parametrize("job, pattern, place", [
    ("the device's fp32 read for a precision decision", r"(backend|_backend|data)\.fp32\b", ["optim/precision.py"]),
    ("the NxD parallel state's groups read", r"nxd_parallel_groups\(\)", ["interop/nxd/parallel_state.py"]),
    ("the cross-rank agreement", r"def agree\b", ["backend/agreement.py"]),
    ("rank 0 decides for all", r"def decide\b", ["backend/agreement.py"]),
    ("the ranks' write-and-publish", r"def write_and_publish\b", ["checkpointing/save.py"]),
    ("a DCP index unpickled", r"kind=\"dcp_metadata\"\)", ["checkpointing/dcp_index.py"]),
    ("a typed-JSON value decoded", r"\bdecode\(loads\(", ["checkpointing/smp_format.py"]),
    ("a staged state checked", r"\bcheck\(staged, targets\)", ["optim/loading/run.py"]),
    ("a checked state installed into the optimizer", r"\.rank_state\.install\(", ["optim/loading/install.py"]),
    ("a load's stages run (read, check, agree, install)", r"\bagree\(.*world_coordinator", ["optim/loading/run.py"]),
    ("a state's keys probed from its optimizer class", r"def state_kinds\b", ["optim/state_fit.py"]),
    ("a gradient reduced at step time, outside the backend's collectives", r"\.reduce_scatter\(", ["grad_accum.py"]),
])
def test_each_job_has_one_place(job, pattern, place):
    found = {module: numbers for module, numbers in code_lines(pattern).items() if not module.startswith("backend/")
             or place[0].startswith("backend/")}
    assert sorted(found) == place, f"{job}: {found}"


#: A file or folder opened, made, moved, linked or removed by path: the filesystem room's job alone.
BY_PATH = (r"\bos\.(open|rename|replace|unlink|remove|rmdir|mkdir|makedirs|symlink|link|readlink|scandir|listdir|"
           r"lstat|stat|walk)\(|(?<![.\w])open\(|\bshutil\.|\btempfile\.|\.(iterdir|is_symlink|resolve|"
           r"read_text|write_text|read_bytes|write_bytes|symlink_to|glob|rglob|stat|lstat|exists|is_dir|is_file|unlink|"
           r"rmdir)\(\)|\.(mkdir|unlink)\((parents|exist_ok|missing_ok)")


def test_every_checkpoint_file_operation_goes_through_the_one_filesystem_room():
    """Checkpointing and the interop formats touch files only through ``checkpointing/files.py``'s
    descriptors (a path looked up anew at each call can be redirected by a swapped folder or a planted
    link); writers that take only a path get a staging folder of ours through its descriptor."""
    found = {module: numbers for module, numbers in code_lines(BY_PATH).items()
             if module.startswith(("checkpointing/", "checkpoint.py", "interop/nxd/folders", "interop/nxd/state_dicts",
                                   "interop/nxd/checkpoint_format", "interop/torch_xla", "interop/native_torch",
                                   "interop/loop_checkpoints"))}
    assert sorted(found) == ["checkpointing/files.py"], found


#: What unpickles a file or parses a zip: the strict reader's tools, used nowhere else.
READER_ONLY = {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
               ("pickle", "_Unpickler")}


def unpickling_in(path: Path) -> list[str]:
    """Where ``path``'s code (not its docstrings: ``ast`` sees no text) loads a pickle or touches
    ``zipfile``: ``torch.load``, ``pickle.load(s)``, an unpickler, ``import zipfile``, by line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (node.value.id, node.attr) in READER_ONLY:
            found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module == "zipfile" or any(
                (node.module, alias.name) in READER_ONLY for alias in node.names)):
            found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import) and any(alias.name == "zipfile" for alias in node.names):
            found.append(f"{node.lineno}: import zipfile")
    return found


#: The strict reader: its zip parse and entry points, and its allow-listed unpickler.
STRICT_READER = (PACKAGE / "checkpointing" / "reader.py", PACKAGE / "checkpointing" / "unpickler.py")


def test_only_the_strict_reader_unpickles_or_parses_a_zip():
    """Every pickled file goes through ``checkpointing/reader.py``'s one zip parse and
    ``checkpointing/unpickler.py``'s allow-listed unpickler; a second reader elsewhere would be a
    second set of rules to attack."""
    found = {str(p.relative_to(PACKAGE)): where for p in PACKAGE.rglob("*.py")
             if (where := unpickling_in(p)) and p not in STRICT_READER}
    assert not found, found
    assert all(unpickling_in(p) for p in STRICT_READER)  # (the rule sees the reader's own zip and pickle)


def test_the_public_surface_is_what_the_readme_documents():
    """``__all__`` stands only in the modules a user imports from, and holds what they document."""
    with_all = set()
    for path in PACKAGE.rglob("*.py"):
        if any(isinstance(n, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in n.targets)
               for n in ast.parse(path.read_text()).body):
            with_all.add(module_name(path))
    assert with_all == set(DOCUMENTED), sorted(with_all)


def test_the_package_and_its_tools_import_in_a_fresh_process():
    code = (
        "import sys, warnings, nxd_smp\n"
        "import nxd_smp.cli, nxd_smp.interop.torch_xla, nxd_smp.interop.native_torch\n"
        "import nxd_smp.interop.torchtitan\n"
        "assert not {'transformers', 'pytorch_lightning', 'torchtitan'} & set(sys.modules), 'import nxd_smp pulled in a framework'\n"
        "print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr
    assert "imported" in out.stdout


# Names the README documents, where it documents them.
DOCUMENTED = {
    "nxd_smp": [
        "MixedPrecisionConfig", "OptimizerConfig", "Zero1Config", "ConfigError", "neuronx_distributed_config",
        "initialize_parallel_optimizer", "Zero1Optimizer", "NeuronZero1Optimizer", "ClippedOptimizer", "NxDOptimizer",
        "save_checkpoint", "load_checkpoint", "finalize_checkpoint", "has_checkpoint", "CheckpointError",
        "DynamicLossScaler", "patch_neuronx_distributed", "precision_ops",
    ],
    "nxd_smp.mixed_precision_config": ["MixedPrecisionConfig", "OptimizerConfig", "Zero1Config", "ConfigError"],
    "nxd_smp.zero1_optimizer": ["Zero1Optimizer", "STATE_LOADED"],
    "nxd_smp.optim.topology": ["Coordinate", "Topology"],
    "nxd_smp.grad_accum": ["GradientSource", "AutogradGrads", "MainGradBuffers", "ShardedMainGrads", "ReplicatedGrads"],
    "nxd_smp.backend": ["select_backend", "Backend", "EagerBackend", "XlaBackend"],
    "nxd_smp.precision_ops": ["softmax", "log_softmax", "cross_entropy", "layer_norm", "rms_norm", "residual_add",
                              "set_fp32_attr_to_module", "is_fp32_module", "cast_model", "NaiveAMPModel",
                              "parse_dtype", "apply_dtype", "stochastic_round", "split_master", "join_master",
                              "round_ties_away"],
    "nxd_smp.checkpoint": ["save_checkpoint", "load_checkpoint", "inspect_checkpoint", "consolidate",
                           "read_checkpoint", "has_checkpoint", "remove_checkpoint", "finalize_checkpoint",
                           "load_full_optimizer_state", "CheckpointError"],
    "nxd_smp.interop.nxd": ["neuronx_distributed_config", "initialize_parallel_optimizer", "ClippedOptimizer",
                            "NxDOptimizer", "NeuronZero1Optimizer", "configs_from_nxd_dict", "patch_neuronx_distributed"],
    "nxd_smp.interop.torch_xla": ["export_xla", "import_xla"],
    "nxd_smp.interop.native_torch": ["export_torch", "import_torch", "export_safetensors", "master_state_dict",
                                     "model_state_dict_of"],
    "nxd_smp.interop.loop_checkpoints": ["save_beside", "load_beside", "read_reference", "refer_to_checkpoint",
                                         "checkpoint_reference"],
    "nxd_smp.interop.accelerate": ["register_accelerate_hooks"],
    "nxd_smp.interop.hf_trainer": ["Zero1TrainerCallback", "skip_ddp_allreduce"],
    "nxd_smp.interop.torchtitan": ["build_zero1_optimizers"],
    "nxd_smp.interop.lightning": ["Zero1LightningCallback"],
}
#: Documented modules that import a framework an environment may lack (both suites' environments install it).
NEEDS = {"nxd_smp.interop.lightning": "pytorch_lightning"}


@pytest.mark.parametrize("module", sorted(DOCUMENTED))
def test_documented_names_are_importable_where_documented(module):
    if module in NEEDS:
        pytest.importorskip(NEEDS[module])
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(DOCUMENTED[module])
    for name in DOCUMENTED[module]:
        assert getattr(mod, name) is not None, f"{module}.{name}"
    with pytest.raises(AttributeError):
        getattr(mod, "no_such_name")
