"""The README's training-loop snippets run as they stand, each in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def snippets() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## In your training loop"):text.index("## Checkpoints")]
    found = []
    for heading, body in re.findall(r"### (.+?)\n(.*?)(?=\n### |\Z)", section, re.S):
        for code in re.findall(r"```python\n(.*?)```", body, re.S):
            found.append((heading.strip().strip("`"), code))
    return found


def test_every_framework_has_a_snippet():
    headings = [h for h, _ in snippets()]
    assert len(headings) == 5 and len(set(headings)) == 5, headings


@pytest.mark.parametrize("heading, code", snippets(), ids=[h for h, _ in snippets()])
def test_snippet_runs(tmp_path, heading, code):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "USE_TORCH_XLA": "0"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the snippet prints what it shows"
    if heading.startswith("Hugging Face"):
        assert float(out.stdout.split()[-1]) > 0, "the Trainer logged grad_norm 0"
