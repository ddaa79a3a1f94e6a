"""Claim checks and metric records.

Every record is shown twice: as a display output with its own mimetype (so tests and the runner
can read it back from the executed notebook with `read_records`), and, when the runner set
`LAB_RECORD_FILE`, appended as one JSON line to that file (the run's JSON is built from it).
A failed claim is recorded first and then raises `ClaimFailed`, so papermill fails the run and the
record of what was measured survives.
"""

from __future__ import annotations

import html
import json
import math
import operator
import os
from typing import Any

MIMETYPE = "application/x-lab-record+json"
RECORD_FILE_ENV = "LAB_RECORD_FILE"
OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


class ClaimFailed(AssertionError):
    """A measured value does not support the paper's claim."""


def _plain(value: Any) -> Any:
    """Tensors, numpy scalars and arrays -> JSON-able Python values."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def fmt(value: Any) -> str:
    """Short text for a recorded value: floats to 4 significant digits, lists element-wise."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in value) + "]"
    return str(value)


def _emit(rec: dict, text: str, html_text: str) -> None:
    path = os.environ.get(RECORD_FILE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:  # plain Python without IPython: the file above is the record
        return
    if get_ipython() is not None:
        display({MIMETYPE: rec, "text/plain": text, "text/html": html_text}, raw=True)


def record(name: str, value: Any) -> Any:
    """Record a metric (a number, list or dict) under `name`; returns the value."""
    rec = {"kind": "metric", "name": name, "value": _plain(value)}
    text = f"{name} = {fmt(rec['value'])}"
    _emit(rec, text, f"<code class='lab-metric'>{html.escape(text)}</code>")
    return value


def check(name: str, value: Any, op: str, threshold: float) -> dict:
    """Record the claim `value op threshold` and raise `ClaimFailed` if it does not hold.

    `value` is what the notebook measured on this run; `threshold` is fixed in the notebook from
    runs over several seeds, with margin. Returns the record (name, value, op, threshold, passed).
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a comparison; use one of {', '.join(OPS)}.")
    value = float(value)
    passed = bool(math.isfinite(value) and OPS[op](value, threshold))
    rec = {"kind": "claim", "name": name, "value": value, "op": op, "threshold": threshold, "passed": passed}
    mark = "PASS" if passed else "FAIL"
    text = f"[{mark}] {name}: {fmt(value)} {op} {threshold}"
    color = "#1a7f37" if passed else "#cf222e"
    _emit(rec, text, f"<div class='lab-claim' style='color:{color}'><b>{mark}</b> {html.escape(name)}: "
                     f"measured <b>{fmt(value)}</b>, required {html.escape(op)} {threshold}</div>")
    if not passed:
        raise ClaimFailed(f"claim '{name}' failed: measured {fmt(value)}, required {op} {threshold}")
    return rec


def read_records(nb: Any) -> dict[str, dict]:
    """All records in an executed notebook (a path or a loaded nbformat node), keyed by name."""
    if not hasattr(nb, "cells"):
        import nbformat

        nb = nbformat.read(str(nb), as_version=4)
    out = {}
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            rec = output.get("data", {}).get(MIMETYPE)
            if rec is not None:
                out[rec["name"]] = dict(rec)
    return out
