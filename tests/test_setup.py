"""environment.yml, pyproject.toml, the Makefile and package.json must tell the same story."""

from __future__ import annotations

import json
import re
import tomllib

import yaml
from packaging.requirements import Requirement

from .conftest import ROOT


def load():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return env, py


def test_environment_yml_delegates_to_pyproject():
    env, py = load()
    deps = env["dependencies"]
    assert "python=3.11" in deps and "pip" in deps
    pip = next(d["pip"] for d in deps if isinstance(d, dict))
    torch_pin = next(r for r in pip if r.startswith("torch"))
    assert torch_pin == "torch==2.13.0"  # the CPU wheel on this platform; never a CUDA download
    assert pip.index("-c constraints.txt") < pip.index(next(r for r in pip if r.startswith("-e")))
    editable = next(r for r in pip if r.startswith("-e"))
    extras = re.search(r"\[(.*)\]", editable).group(1).split(",")
    assert set(extras) <= set(py["project"]["optional-dependencies"]), "env asks for an extra pyproject lacks"
    # torch in pyproject is a range the pin satisfies, so installing the package adds no other torch
    torch_req = next(Requirement(r) for r in py["project"]["dependencies"] if r.startswith("torch"))
    assert torch_req.specifier.contains("2.13.0")
    from packaging.specifiers import SpecifierSet

    assert "python=3.11" in deps and SpecifierSet(py["project"]["requires-python"]).contains("3.11.7")


def test_dependencies_the_platform_needs():
    _, py = load()
    names = {Requirement(r).name for r in py["project"]["dependencies"]}
    assert {"jupyterlab", "ipywidgets", "torch", "transformers", "peft", "matplotlib", "plotly", "papermill"} <= names
    dev = {Requirement(r).name for r in py["project"]["optional-dependencies"]["dev"]}
    assert {"pytest", "pytest-timeout", "triton", "playwright", "nbstripout"} <= dev
    assert set(py["tool"]["setuptools"]["packages"]["find"]["include"]) >= {"lab*"}


def test_no_top_level_package_shadows_a_dependency():
    """transformers >= 5.25 imports Hugging Face's `kernels` package at start-up; a top-level package of ours with an
    installed distribution's name (the lab's Triton kernels were once `kernels/`) shadows it from the repository root,
    and every import of transformers fails. Our only top-level package is `lab`; run from the root, nothing we ship
    stands in for a dependency."""
    import importlib.metadata as md
    import subprocess
    import sys

    ours = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} - {"tests"}
    assert ours == {"lab"}, ours
    dists = {(d.metadata["Name"] or "").lower().replace("-", "_") for d in md.distributions()}
    assert "lab" not in dists - {"icml25_lab"}
    code = "import transformers.integrations.hub_kernels, transformers; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def pins():
    lines = [ln.strip() for ln in (ROOT / "constraints.txt").read_text().splitlines()]
    reqs = [Requirement(ln) for ln in lines if ln and not ln.startswith("#")]
    return {r.name.lower().replace("_", "-"): r for r in reqs}


def test_constraints_pin_every_dependency_exactly():
    """constraints.txt (`make lock`) pins the whole installed set, so a fresh clone gets the versions the tests passed
    with (transformers 5.25, released between two sessions, once broke a fresh clone). Every entry is one exact
    version without a local label, every declared dependency is pinned within its pyproject range, torch at the
    Makefile's pin, and our own package is not in it."""
    _, py = load()
    pinned = pins()
    for req in pinned.values():
        (spec,) = req.specifier
        assert spec.operator == "==" and "+" not in spec.version and not req.extras and not req.marker, str(req)
    assert "icml25-lab" not in pinned
    declared = [Requirement(r) for r in py["project"]["dependencies"] + py["project"]["optional-dependencies"]["dev"]]
    for req in declared:
        name = req.name.lower().replace("_", "-")
        assert name in pinned, f"{name} is a dependency but constraints.txt does not pin it (run make lock)"
        version = next(iter(pinned[name].specifier)).version
        assert req.specifier.contains(version, prereleases=True), f"{name}=={version} is outside pyproject's {req}"
    assert str(pinned["torch"].specifier) == "==2.13.0"


def test_setup_installs_under_the_constraints():
    make = (ROOT / "Makefile").read_text()
    setup = make.split("$(STAMP):", 1)[1].split("\n\n", 1)[0]
    assert "LOCK := constraints.txt" in make, make
    assert "$(LOCK)" in setup.splitlines()[0], "setup must rerun when constraints.txt changes"
    lines = setup.splitlines()
    installs = [ln for ln in lines if "$(PIP)" in ln and "hqq" not in ln and ln.strip() != "$(PIP) $(TORCH)"]
    assert installs and all("-c $(LOCK)" in ln for ln in installs), installs


def test_installed_versions_are_the_pinned_ones():
    """What this environment holds is what constraints.txt says (setup installs under it; a stale .venv fails here)."""
    import importlib.metadata as md

    pinned = pins()
    _, py = load()
    declared = [
        Requirement(r).name for r in py["project"]["dependencies"] + py["project"]["optional-dependencies"]["dev"]
    ]
    wrong = {}
    for name in declared:
        have = md.version(name).split("+")[0]
        want = next(iter(pinned[name.lower().replace("_", "-")].specifier)).version
        if have != want:
            wrong[name] = (have, want)
    assert not wrong, f"installed vs pinned: {wrong}"


def test_makefile_and_npm_pins_agree():
    env, _ = load()
    make = (ROOT / "Makefile").read_text()
    assert "TORCH := torch==2.13.0" in make
    pkg = json.loads((ROOT / "package.json").read_text())["dependencies"]
    assert all(re.fullmatch(r"\d+\.\d+\.\d+", v) for v in pkg.values()), "npm versions must be pinned exactly"
    lock = json.loads((ROOT / "package-lock.json").read_text())
    for name, version in pkg.items():
        assert lock["packages"][f"node_modules/{name}"]["version"] == version


def test_readme_commands_exist_in_makefile_and_ci():
    readme = (ROOT / "README.md").read_text()
    make = (ROOT / "Makefile").read_text()
    assert "make run" in readme and "make test" in readme
    assert re.search(r"^run:", make, re.M) and re.search(r"^test:", make, re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()
