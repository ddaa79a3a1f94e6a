import json

import nbformat
import pytest

from lab.core import MIMETYPE, ClaimFailed, check, read_records, record
from lab.core.records import RECORD_FILE_ENV


def test_check_passes_and_fails_with_value_and_threshold(tmp_path, monkeypatch):
    f = tmp_path / "run.jsonl"
    monkeypatch.setenv(RECORD_FILE_ENV, str(f))
    rec = check("acc", 0.95, ">=", 0.9)
    assert rec["passed"] and rec["value"] == 0.95
    with pytest.raises(ClaimFailed, match=r"measured 0.5, required >= 0.9"):
        check("acc2", 0.5, ">=", 0.9)
    with pytest.raises(ClaimFailed):
        check("nan never passes", float("nan"), "<=", 1.0)
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert [x["passed"] for x in lines] == [True, False, False]  # failures are recorded before raising
    assert lines[1] == {"kind": "claim", "name": "acc2", "value": 0.5, "op": ">=", "threshold": 0.9, "passed": False}


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
