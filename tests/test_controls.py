"""Falsifiability as a fact: every declared control of every notebook breaks the claims it names, and
every claim a notebook makes is named by at least one control (DESIGN.md, Claims and controls)."""

from __future__ import annotations

import json

import pytest

from lab.core import results
from lab.core.runner import declared_controls

from .conftest import NOTEBOOKS, run_lab

CASES = [(p.stem, c) for p in NOTEBOOKS for c in declared_controls(p)]


@pytest.mark.notebook
@pytest.mark.timeout(400)
@pytest.mark.parametrize("stem, control", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_control_breaks_the_claims_it_names(stem, control, tmp_path):
    proc = run_lab("run", stem, "-p", "control", control, "--out", str(tmp_path), "--no-page")
    rec = json.loads((tmp_path / f"{stem}.json").read_text())
    assert proc.returncode == 1 and rec["status"] == "failed", proc.stdout + proc.stderr[-3000:]
    assert rec["control"]["name"] == control and rec["control"]["must_break"]
    assert rec["control"]["survived"] == [], f"{stem} control {control!r} did not break {rec['control']['survived']}"
    measured = {c["name"] for c in rec["claims"]}
    assert set(rec["control"]["must_break"]) <= measured, "a named claim was never measured"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_claim_is_named_by_a_control(path):
    data = results.load(path.stem)
    assert data is not None, f"no results file for {path.stem}: run `python -m lab sweep {path.stem}`"
    named = {c for claims in declared_controls(path).values() for c in claims}
    claims = set(data["claims"])
    assert claims - named == set(), f"claims no control can break: {claims - named}"
    assert named - claims == set(), f"controls name claims the notebook does not make: {named - claims}"
