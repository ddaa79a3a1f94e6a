"""Notebooks are stored clean and follow the contract anatomy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from .conftest import NOTEBOOKS, ROOT

CONTRACT = ("scale", "device", "seed", "model", "control")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_clean_and_follows_the_contract(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "stored with outputs"
    assert "widgets" not in nb.metadata and "papermill" not in nb.metadata
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    first = code[0]
    assert "parameters" in first.metadata.get("tags", []), "the first code cell must be tagged 'parameters'"
    import papermill as pm

    params = pm.inspect_notebook(str(path))
    import ast

    assigned = [t.target.id for t in ast.parse(first.source).body if isinstance(t, ast.AnnAssign)]
    assert list(params) == assigned, "papermill must parse every parameter (no ' = ' inside a comment)"
    assert list(params)[:5] == list(CONTRACT)
    assert [params[k]["default"] for k in CONTRACT] == ['"smoke"', '"auto"', "0", '"tiny"', '""']
    assert "lab.core.setup(scale, device, seed, model, control" in code[1].source, "the setup cell comes second"
    assert code[-1].source.strip() == "lab.core.verdict()", "the last code cell judges every claim at once"
    from lab.cli import declared_controls

    assert declared_controls(path), "every notebook declares the controls that break its claims"
    assert f'seed_table("{path.stem}")' in "".join(c.source for c in code), "the results table comes from the sweep"
    assert path.stem[:2].isdigit() and nb.metadata.get("lab", {}).get("paper")


def test_nbstripout_agrees():
    exe = Path(sys.executable).with_name("nbstripout")
    proc = subprocess.run([str(exe), "--verify", *map(str, NOTEBOOKS)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_notebook_logic_hidden_in_reports_folder():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    assert not [f for f in tracked if f.startswith("reports/") or f.startswith("node_modules/")]


def test_ruff_is_clean():
    exe = Path(sys.executable).with_name("ruff")
    proc = subprocess.run([str(exe), "check", "lab", "kernels", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
