import json

import nbformat
import pytest

from lab.core import MIMETYPE, ClaimFailed, check, read_records, record, sanity, verdict
from lab.core.records import RECORD_FILE_ENV, start


def test_check_records_every_claim_and_verdict_lists_every_failure(tmp_path, monkeypatch):
    f = tmp_path / "run.jsonl"
    monkeypatch.setenv(RECORD_FILE_ENV, str(f))
    start()
    rec = check("acc", 0.95, ">=", 0.9)
    assert rec["passed"] and rec["value"] == 0.95
    assert not check("acc2", 0.5, ">=", 0.9)["passed"]  # recorded, not raised
    assert not check("nan never passes", float("nan"), "<=", 1.0)["passed"]
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert [x["passed"] for x in lines] == [True, False, False]
    assert lines[1] == {"kind": "claim", "name": "acc2", "value": 0.5, "op": ">=", "threshold": 0.9, "passed": False}
    with pytest.raises(ClaimFailed) as e:
        verdict()
    msg = str(e.value)
    assert msg.startswith("1/3 claims hold") and "acc2: measured 0.5, required >= 0.9" in msg
    assert "nan never passes" in msg and "FAILED acc:" not in msg


def test_verdict_passes_when_all_hold_and_sanity_is_apart():
    start()
    check("a", 1.0, ">=", 0.5)
    assert sanity("kernel = reference", 1e-9, "<", 1e-6)["kind"] == "sanity"
    assert verdict()["failed"] == []
    sanity("kernel = reference", 1e-2, "<", 1e-6)  # a broken invariant fails the run, not as a claim
    with pytest.raises(ClaimFailed, match=r"1/1 claims hold[\s\S]*SANITY BROKEN kernel = reference"):
        verdict()


def test_verdict_without_claims_reports_measurements_only(capsys):
    start()  # a checkpoint run records measurements and checks no toy threshold
    assert verdict() == {"failed": [], "sanity_failed": []}
    assert "no claim was checked" in capsys.readouterr().out


def test_a_control_run_always_raises_and_says_what_it_broke():
    start("uniform", ("H1", "H2"))
    check("H1", 0.1, ">=", 1.0)
    check("H2", 2.0, ">=", 1.0)
    check("H3", 0.0, ">=", 1.0)
    with pytest.raises(ClaimFailed, match=r"control run 'uniform': 1/2 .* did NOT break: H2"):
        verdict()
    start("uniform", ("H1",))
    check("H1", 0.1, ">=", 1.0)
    with pytest.raises(ClaimFailed, match=r"1/1 of the claims it must break failed \(as they must\)"):
        verdict()
    start("uniform", ("H1", "H at k = 0.8"))  # a claim named after a knob the run set otherwise: not measured
    check("H1", 0.1, ">=", 1.0)
    check("H at k = 0.7", 0.1, ">=", 1.0)
    with pytest.raises(ClaimFailed) as e:
        verdict()
    assert "did NOT break" not in str(e.value) and "never measured in this run" in str(e.value)
    assert str(e.value).splitlines()[0].endswith(": H at k = 0.8.")
    start()


@pytest.mark.parametrize("op, ok", [("<", 0.1), ("<=", 0.2), (">", 0.3)])
def test_operators(op, ok):
    assert check("x", ok, op, 0.2)["passed"]


def test_unknown_operator():
    with pytest.raises(ValueError, match="not a comparison"):
        check("x", 1.0, "==", 1.0)


def test_record_converts_tensors(tmp_path, monkeypatch):
    import torch

    f = tmp_path / "run.jsonl"
    monkeypatch.setenv(RECORD_FILE_ENV, str(f))
    t = torch.tensor([[1.0, 2.0]])
    assert record("m", t) is t
    assert json.loads(f.read_text())["value"] == [[1.0, 2.0]]


def test_read_records_from_executed_notebook():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x")])
    rec = {"kind": "claim", "name": "c", "value": 1.0, "op": ">=", "threshold": 0.5, "passed": True}
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", data={MIMETYPE: rec, "text/plain": "c"})]
    assert read_records(nb) == {"c": rec}
