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
    from lab.core.runner import declared_controls

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
    proc = subprocess.run([str(exe), "check", "lab", "scripts", "tests"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_numeric_knob_has_limits_that_its_defaults_meet(path: Path):
    """`lab.papers.LIMITS` declares the range of every int or float knob of the notebook (the runner rejects an
    override outside it before any kernel starts) or `FREE` names it; each limit reads declared parameters, and the
    defaults meet it."""
    from lab.core.params import check_limits, limit_names
    from lab.core.runner import CONTRACT, defaults, limits_of
    from lab.papers import FREE

    base, limits = defaults(path), limits_of(path.stem)
    named = {n for limit in limits for n in limit_names(limit)}
    assert named <= set(base), f"limits name parameters {named - set(base)} the notebook does not declare"
    free = set(FREE.get(path.stem, ()))
    numeric = {k for k, v in base.items() if k not in CONTRACT and type(v) in (int, float)}
    assert free <= numeric - named, f"FREE lists {sorted(free - (numeric - named))}: not free numeric knobs"
    assert numeric - free <= named, f"knobs {sorted(numeric - free - named)} have no limits in lab/papers.py"
    check_limits(limits, base)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_no_cell_rebinds_a_parameter(path: Path):
    """A parameter means one thing in the whole notebook: no later cell assigns its name (a loop over λ that left
    `lam` at its last value; InfAlign's table loop left `K = 'exact'`, which a re-run setup cell then refused).
    Comprehension variables do not leak and are allowed."""
    import ast

    nb, names = nbformat.read(str(path), as_version=4), None
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        tree = ast.parse(_code(cell.source))
        if "parameters" in cell.metadata.get("tags", []):
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            continue
        scoped = {id(n) for c in ast.walk(tree) if isinstance(c, ast.comprehension) for n in ast.walk(c.target)}
        bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
                 and id(n) not in scoped}
        assert not bound & (names or set()), f"code cell {i} rebinds the parameter(s) {sorted(bound & names)}"


# ------------------------------------------------------------------ notebooks are thin drivers

MAX_CELL_LINES = 15


def _code(source: str) -> str:
    """A cell's Python, IPython magics and shell escapes blanked."""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_a_thin_driver(path: Path):
    """No function or class defined in a notebook (they live in `lab`, with tests), short code cells,
    and sizes from the paper module's `Config.for_scale` rather than `pick(...)` literals in cells."""
    import ast

    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        tree = ast.parse(_code(cell.source))
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        defined = [n.name for n in ast.walk(tree) if isinstance(n, kinds)]
        assert not defined, f"code cell {i} defines {defined}: move it into lab/ with a test"
        lines = [line for line in cell.source.splitlines() if line.strip()]
        assert len(lines) <= MAX_CELL_LINES, f"code cell {i} has {len(lines)} lines (at most {MAX_CELL_LINES})"
        picks = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr == "pick"]
        assert not picks, f"code cell {i} picks sizes inline: take them from the paper module's Config.for_scale"


# --------------------------------------------------------------- generic code knows no paper

def _paper_modules() -> set[str]:
    from lab.papers import PAPERS

    slugs = {p.slug for p in PAPERS}
    return {".".join(f.relative_to(ROOT).with_suffix("").parts) for f in (ROOT / "lab").glob("*/*.py")
            if f.stem in slugs or any(f.stem.startswith(f"{s}_") for s in slugs)} | {"lab.tour"}


GENERIC = ["lab/cli.py", "lab/papers.py", "lab/core", "lab/models", "lab/data", "lab/report", "lab/widgets/figures.py",
           "lab/widgets/next_token.py", "lab/moe/blocks.py", "lab/moe/offload.py", "lab/moe/links.py",
           "lab/align/train.py", "lab/align/losses.py", "lab/align/exact.py", "lab/compress/quant.py",
           "lab/compress/pruned_llama.py", "lab/compress/rotate.py",
           "lab/interp/hidden_attention.py", "lab/interp/ablation.py", "lab/align/tokens.py",
           "lab/adapt/loop.py"]


def test_generic_modules_import_no_paper_module():
    """The runner, the engine, the shared figures and the shared trainers import no paper module (a paper
    module may import them, never the reverse), so a new paper is added without touching them."""
    import ast

    papers = _paper_modules()
    assert {"lab.align.expo", "lab.moe.floe", "lab.moe.floe_bench", "lab.interp.gather_aggregate"} <= papers
    files = [f for g in GENERIC for f in ((ROOT / g).rglob("*.py") if (ROOT / g).is_dir() else [ROOT / g])
             if f.exists()]
    offenders = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{f.relative_to(ROOT)} imports {n}" for n in names if n in papers]
    assert not offenders, offenders


def test_code_cites_the_paper_and_the_lab_only():
    """A user has the paper, the official code and this lab: no references to the lab's issue tracker or
    internal notes in code, docstrings or notebooks."""
    import re

    pattern = re.compile(r"\bissues?\s*#?\d+|\bthe notes\b|\bthe issue\b", re.IGNORECASE)
    files = [*(ROOT / "lab").rglob("*.py"), *(ROOT / "scripts").rglob("*.py"), *NOTEBOOKS]
    hits = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files for m in pattern.finditer(f.read_text())]
    assert not hits, hits
