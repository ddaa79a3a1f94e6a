"""Claim checks and metric records.

Every record is shown twice: as a display output with its own mimetype (so tests and the runner
can read it back from the executed notebook with `read_records`), and, when the runner set
`LAB_RECORD_FILE`, appended as one JSON line to that file (the run's JSON is built from it).
Claims (`check`) and implementation invariants (`sanity`) are recorded and returned, never raised
one at a time: the notebook's last cell calls `verdict()`, which raises one `ClaimFailed` listing every
failed claim, so papermill fails the run and the reader sees the whole picture.
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


_session: dict[str, dict] = {}  # this kernel's claims and sanity records by name (a re-run cell replaces its own)
_control: dict = {"name": "", "must_break": ()}  # set by `lab.core.setup` for a control run


def start(control: str = "", must_break: tuple[str, ...] = ()) -> None:
    """Forget earlier records of this kernel and note the control this run makes (called by `setup`)."""
    _session.clear()
    _control.update(name=control, must_break=tuple(must_break))


def _compare(kind: str, name: str, value: Any, op: str, threshold: float) -> dict:
    if op not in OPS:
        raise ValueError(f"op={op!r} is not a comparison; use one of {', '.join(OPS)}.")
    value = float(value)
    passed = bool(math.isfinite(value) and OPS[op](value, threshold))
    rec = {"kind": kind, "name": name, "value": value, "op": op, "threshold": threshold, "passed": passed}
    _session[name] = rec
    return rec


def _show(rec: dict, marks: tuple[str, str], ok_color: str, css: str) -> dict:
    mark = marks[0] if rec["passed"] else marks[1]
    label = mark if rec["kind"] == "claim" else f"sanity {mark}"
    text = f"[{label}] {rec['name']}: {fmt(rec['value'])} {rec['op']} {rec['threshold']}"
    color = ok_color if rec["passed"] else "#cf222e"
    _emit(rec, text, f"<div class='{css}' style='color:{color}'><b>{label}</b> {html.escape(rec['name'])}: "
                     f"measured <b>{fmt(rec['value'])}</b>, required {html.escape(rec['op'])} {rec['threshold']}</div>")
    return rec


def check(name: str, value: Any, op: str, threshold: float) -> dict:
    """Record the paper claim `value op threshold` and return the record (name, value, op, threshold, passed).

    It does not raise: `verdict()` in the notebook's last cell judges every claim at once. `value` is what
    this run measured; `threshold` is fixed in the notebook from a seed sweep (`python -m lab sweep`).
    """
    return _show(_compare("claim", name, value, op, threshold), ("PASS", "FAIL"), "#1a7f37", "lab-claim")


def sanity(name: str, value: Any, op: str, threshold: float) -> dict:
    """Record an implementation invariant (kernel = reference, gathered = dense): not a paper claim.

    Shown apart from the claims and never counted as one; `verdict()` still fails the run when it does
    not hold, because then the measurements above it cannot be trusted.
    """
    return _show(_compare("sanity", name, value, op, threshold), ("ok", "BROKEN"), "#57606a", "lab-sanity")


def judge(claims: dict[str, dict], control: str = "", must_break: tuple[str, ...] = ()) -> dict:
    """What a run's records say: failed claims and sanity records, and for a control run which of the
    claims it must break did fail (`broken`) and which held or were never measured (`survived`)."""
    failed = [n for n, r in claims.items() if r["kind"] == "claim" and not r["passed"]]
    broken_sanity = [n for n, r in claims.items() if r["kind"] == "sanity" and not r["passed"]]
    out = {"failed": failed, "sanity_failed": broken_sanity}
    if control:
        out["control"] = {"name": control, "must_break": list(must_break),
                          "broken": [n for n in must_break if n in failed],
                          "survived": [n for n in must_break if n not in failed]}
    return out


def verdict() -> dict:
    """The last cell of every notebook: raise one `ClaimFailed` listing every failed claim (and sanity record).

    A control run (`control=...`) always raises: its claims are meant to fail. The message says whether
    every claim the control must break did fail. Returns the summary when every claim held.
    """
    claims = {n: r for n, r in _session.items() if r["kind"] == "claim"}
    result = judge(_session, _control["name"], _control["must_break"])
    n_pass = len(claims) - len(result["failed"])
    lines = [f"{n_pass}/{len(claims)} claims hold"]
    lines += [f"  FAILED {n}: measured {fmt(_session[n]['value'])}, required {_session[n]['op']} "
              f"{_session[n]['threshold']}" for n in result["failed"]]
    lines += [f"  SANITY BROKEN {n}: {fmt(_session[n]['value'])} {_session[n]['op']} {_session[n]['threshold']}"
              for n in result["sanity_failed"]]
    if "control" in result:
        c = result["control"]
        held = [n for n in c["survived"] if n in claims]
        unmeasured = [n for n in c["survived"] if n not in claims]  # e.g. a claim named after a knob set otherwise
        head = (f"control run '{c['name']}': {len(c['broken'])}/{len(c['must_break'])} of the claims it must "
                f"break failed" + (" (as they must)." if not c["survived"] else
                                   (f"; it did NOT break: {', '.join(held)}." if held else "") +
                                   (f"; never measured in this run (its parameters differ from those the control "
                                    f"names them at?): {', '.join(unmeasured)}." if unmeasured else "")))
        lines.insert(0, head)
        rec = {"kind": "control", "name": "control", "value": c}
        _emit(rec, "\n".join(lines), f"<pre class='lab-verdict'>{html.escape(chr(10).join(lines))}</pre>")
        raise ClaimFailed("\n".join(lines))
    if not claims and not result["sanity_failed"]:  # e.g. a checkpoint run: measurements recorded, no toy threshold
        print("no claim was checked in this run: its measurements are recorded, not asserted.")
        return result
    if result["failed"] or result["sanity_failed"]:
        raise ClaimFailed("\n".join(lines))
    print(lines[0] + ".")
    return result


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
