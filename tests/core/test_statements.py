"""Numbers the notebooks' text states, checked against their sweeps (`lab.core.statements`)."""

from __future__ import annotations

import json

import nbformat
import pytest

from lab.core import results
from lab.core.statements import StatementError, check, evaluate, find

from ..conftest import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def sweep_data() -> dict:
    """Three seeds and one control, as `results.write` stores them."""
    def run(seed, acc, curve):
        return {"seed": seed, "status": "passed", "values": {"acc gain": acc},
                "metrics": {"loss": {"method": 1.0 + seed, "base": 2.0}, "curve": curve}}

    runs = [run(0, 0.121, [3.0, 2.0]), run(1, 0.254, [3.0, 1.5]), run(2, 0.2, [3.0, 1.0])]
    ctrl = {"seed": 0, "status": "failed", "values": {"acc gain": -0.04}, "metrics": {"loss": {"method": 2.5}}}
    return {"notebook": "99_x", "seeds": [0, 1, 2], "claims": {}, "runs": runs, "controls": {"off": ctrl}}


def notebook(tmp_path, *texts: str):
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[v4.new_markdown_cell(t) for t in texts] + [v4.new_code_cell("x = 1")])
    path = tmp_path / "99_x.ipynb"
    nbformat.write(nb, path)
    (tmp_path / "results").mkdir(exist_ok=True)
    (tmp_path / "results" / "99_x.json").write_text(json.dumps(sweep_data()))
    return path


def problems_of(tmp_path, text: str) -> list:
    return [f["problem"] for f in check("99_x", notebook(tmp_path, text), tmp_path)]


@pytest.mark.parametrize("text", [
    "gains 0.12–0.25 <!-- seeds: {acc gain} --> on every seed",
    "gains 0.1–0.3 <!-- seeds: {acc gain} -->",             # written to one digit: 0.121 -> 0.1, 0.254 -> 0.3
    "gains **0.12–0.26** <!-- seeds: {acc gain} -->",       # the top end rounded outwards by one unit
    "gains 12–25 % <!-- seeds: 100 * {acc gain} -->",
    "loss falls 0.0–1.0 nats <!-- seeds: {loss|base} - {curve|-1} -->",
    "loss 1–2 <!-- seeds 0-1: {loss|method} -->",
    "base 2.0 <!-- seeds: {loss|base} -->",
    "base 2.0 <!-- seeds: {loss|\nbase} --> (a note reads `<!-- seeds: {path} -->`)",
    "trains 2,000 <!-- seeds: 1000 * {loss|base} --> weights",
    "ahead on 2 <!-- count seeds: {acc gain} > 0.15 --> of 3 seeds",
    "ahead on 1 <!-- count seeds 0-1: {acc gain} > 0.15 --> of 2 seeds",
    "the control gains −0.04 <!-- control off: {acc gain} -->",
    "gains −0.08 to +0.05 <!-- seeds: {acc gain} - 0.2 --> over 0.2",
    "ratio 0.17–0.33 <!-- seeds: min({loss|method}, {loss|base}) / max(3, {curve|0} * {loss|base}) -->",
])
def test_a_statement_that_says_what_the_sweep_recorded_holds(tmp_path, text):
    assert problems_of(tmp_path, text) == [None]


@pytest.mark.parametrize("text, words", [
    ("gains 0.12–0.24 <!-- seeds: {acc gain} -->", "recorded 0.121–0.254"),   # seed 1 left out
    ("gains 0.13–0.25 <!-- seeds: {acc gain} -->", "recorded 0.121–0.254"),   # the low end rounded inwards
    ("gains 0.10–0.25 <!-- seeds: {acc gain} -->", "recorded 0.121–0.254"),   # looser than its precision
    ("gains 0–2 <!-- seeds: {acc gain} -->", "recorded"),                     # looser than 0–1
    ("loss 1.0 <!-- seeds: {loss|method} -->", "recorded 1–3"),               # one number, three values
    ("loss 1.0 <!-- seeds: {loss|nope} -->", "not recorded (no 'nope')"),
    ("loss 1.0 <!-- seeds: {curve} -->", "not a number"),
    ("loss 1.0 <!-- seeds: {curve|5} -->", "not recorded"),
    ("loss 1.0 <!-- seeds 0-4: {loss|base} -->", "seeds [3, 4] are not recorded"),
    ("loss 1.0 <!-- control on: {acc gain} -->", "control 'on' is not recorded"),
    ("loss 1.0 <!-- seeds: __import__('os').getcwd() -->", "not arithmetic"),
    ("ahead on 3 <!-- count seeds: {acc gain} > 0.15 --> of 3", "the sweep has 2 of 3 runs"),
    ("ahead on 2 <!-- count seeds: {acc gain} - 0.15 --> of 3", "one whole number of runs"),
    ("ahead on 2.0 <!-- count seeds: {acc gain} > 0.15 --> of 3", "one whole number of runs"),
])
def test_a_wrong_or_unreadable_statement_is_named(tmp_path, text, words):
    [problem] = problems_of(tmp_path, text)
    assert problem and words in problem, problem


def test_a_note_with_no_number_before_it_is_refused(tmp_path):
    with pytest.raises(StatementError, match="no number right before"):
        find(notebook(tmp_path, "as the sweep shows <!-- seeds: {acc gain} -->"))


def test_statements_are_read_in_order_with_their_precision(tmp_path):
    path = notebook(tmp_path, "a 1.5–2.25× <!-- seeds: {x} --> b 4<!--seeds 0-1:{y}-->",
                    "c −0.3 <!-- control off: {z} -->")
    assert [(s.cell, s.lo, s.hi, s.digits, s.scope, s.expr, s.single) for s in find(path)] == [
        (0, 1.5, 2.25, (1, 2), "seeds", "{x}", False), (0, 4.0, 4.0, (0, 0), "seeds 0-1", "{y}", True),
        (1, -0.3, -0.3, (1, 1), "control off", "{z}", True)]


def test_evaluate_reads_claims_before_metrics():
    run = {"values": {"loss": 1.0, "mean |r|": 3.0},
           "metrics": {"loss": 5.0, "d": {"a b": [1, 2.5]}, "r": {"x | y": {"z": 4.0}}}}
    assert evaluate("{loss} + {d|a b|1} × 2 - {mean |r|} + {r|x | y|z}", run) == 7.0


def test_the_sweep_keeps_every_metric_rounded():
    assert results._rounded({"a": [1 / 3, 2], "b": "x"}) == {"a": [0.333333, 2], "b": "x"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_number_a_notebook_states_is_what_its_sweep_recorded(path):
    found = check(path.stem, path)
    assert found, "a notebook states its results with notes the sweep can check"
    bad = [f"{f['statement']}: {f['problem']}" for f in found if f["problem"]]
    assert not bad, "\n".join(bad)
