"""The index: a dashboard of the papers (`build_index`), one row per paper of `lab.papers` with its run record."""

from __future__ import annotations

import html
import json
import logging
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

import nbformat

from lab.core.records import fmt
from lab.report import atomic_write

log = logging.getLogger(__name__)

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
# The runner's contract parameters and their defaults; a notebook's own parameters cell wins.
CONTRACT_DEFAULTS = {"scale": "smoke", "device": "auto", "seed": 0, "model": "tiny", "control": ""}

INDEX_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ccc; padding: .4em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.paper small { display: block; color: #555; }
tr.coming td, tr.not-run td { color: #888; }
.passed, .ok { color: #1a7f37; font-weight: 600; }
.failed, .bad { color: #cf222e; font-weight: 600; }
.error { color: #bc4c00; font-weight: 600; }
.measured { color: #0969da; font-weight: 600; }
small.params, small.note { display: block; font-weight: normal; color: #444; }
details summary { cursor: pointer; }
details li { font-weight: normal; }
ul { margin: .2em 0; padding-left: 1.1em; }
h4 { margin: .5em 0 .1em; font-size: 90%; }
code { font-size: 90%; }
"""


def _is_record(data) -> bool:
    """True for a run record written by the runner (see DESIGN.md, Runner)."""
    return (isinstance(data, dict) and isinstance(data.get("notebook"), str)
            and isinstance(data.get("status"), str) and isinstance(data.get("claims", []), list))


def _read_records(out_dir: Path) -> dict[str, dict]:
    """`{stem: record}` for every run record `out_dir/*.json` (other JSON files are skipped)."""
    records = {}
    for path in sorted(out_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.debug("skipping unreadable %s", path)
            continue
        if _is_record(data):
            records[data["notebook"]] = data
    return records


def _notebook_defaults(nb_path: Path) -> dict:
    """The defaults of a notebook's `parameters` cell (`name: type = value` lines), or {} without one."""
    import ast

    try:
        nb = nbformat.read(nb_path, as_version=4)
    except (OSError, ValueError):
        return {}
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            out = {}
            try:
                tree = ast.parse(cell.source)
            except SyntaxError:
                return {}
            for node in tree.body:
                target = node.target if isinstance(node, ast.AnnAssign) else (
                    node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
                if isinstance(target, ast.Name) and getattr(node, "value", None) is not None:
                    try:
                        out[target.id] = ast.literal_eval(node.value)
                    except ValueError:
                        pass
            return out
    return {}


def _changed_params(rec: dict, defaults: dict) -> dict:
    """The record's parameters that differ from the notebook's defaults (`control` is shown apart)."""
    params = rec.get("params") if isinstance(rec.get("params"), dict) else {}
    return {k: v for k, v in params.items()
            if k != "control" and (k not in defaults or v != defaults[k])}


def _control(rec: dict) -> dict | None:
    """A control run's verdict: name, named claims (must_break), which broke, which did not."""
    info = rec.get("control") if isinstance(rec.get("control"), dict) else {}
    name = (rec.get("params") or {}).get("control") or info.get("name")
    if not name:
        return None
    must = [str(n) for n in info.get("must_break") or []]
    claims = {c.get("name"): c for c in rec.get("claims", []) if isinstance(c, dict)}
    if isinstance(info.get("broken"), list):
        broken = {str(n) for n in info["broken"]}
    else:  # older records: read the claims themselves
        broken = {n for n in must if n in claims and not claims[n].get("passed")}
    not_broken = [n for n in must if n not in broken]
    return {"name": str(name), "must_break": must, "not_broken": not_broken,
            "ok": bool(must) and not not_broken}


def _check_items(checks: list, must_break: list[str] = ()) -> str:
    """`<li>` per claim or sanity check: name: value op threshold ✓/✗."""
    e = html.escape
    items = []
    for c in checks:
        if not isinstance(c, dict):
            continue
        ok = bool(c.get("passed"))
        note = " <em>(must break)</em>" if c.get("name") in must_break else ""
        items.append(f'<li class="{"ok" if ok else "bad"}">{e(str(c.get("name")))}: {e(fmt(c.get("value")))} '
                     f'{e(str(c.get("op", "")))} {e(fmt(c.get("threshold")))} {"✓" if ok else "✗"}{note}</li>')
    return "".join(items)


def _paper_cell(paper, stem: str, rec: dict | None, page: bool) -> str:
    e = html.escape
    if paper is not None:
        name, lines = paper.short, [paper.title]
        if paper.authors or paper.arxiv:
            lines.append(" · ".join(filter(None, [paper.authors, paper.arxiv and f"arXiv {paper.arxiv}"])))
    else:  # a run of a notebook the registry does not know: its own paper line and title, once each
        name = stem
        lines = list(dict.fromkeys(str(rec[k]) for k in ("paper", "title") if rec and rec.get(k)))
    link = f'<a href="{quote(stem)}.html"><b>{e(name)}</b></a>' if page else f"<b>{e(name)}</b>"
    return link + "".join(f"<small>{e(line)}</small>" for line in lines)


def _status_cell(rec: dict | None, built: bool, defaults: dict) -> tuple[str, str]:
    """(css class, HTML) of the status column."""
    e = html.escape
    if rec is None:
        return ("not-run", "not run") if built else ("coming", "coming")
    status = rec["status"]
    control = _control(rec)
    if control is None or status == "error":
        cls, text = status, e(status)
        if control is not None:
            text += f'<small class="note">control <code>{e(control["name"])}</code> run</small>'
    elif control["ok"]:
        n = len(control["must_break"])
        cls = "ok"
        text = f'control <code>{e(control["name"])}</code>: {n}/{n} named claims broken ✓'
    else:
        cls = "bad"
        missed = ", ".join(control["not_broken"]) or "no claims are named to break"
        text = f'control <code>{e(control["name"])}</code> did NOT break: {e(missed)} ✗'
    changed = _changed_params(rec, defaults)
    if changed:
        text += '<small class="params">' + e(", ".join(f"{k}={fmt(v)}" for k, v in changed.items())) + "</small>"
    if rec.get("error"):
        text += f'<small class="note">{e(str(rec["error"]))}</small>'
    return cls, text


def _claims_cell(stem: str, rec: dict | None, page: bool) -> str:
    e = html.escape
    if rec is None:
        return ""
    claims = [c for c in rec.get("claims", []) if isinstance(c, dict)]
    sanity = [c for c in rec.get("sanity") or [] if isinstance(c, dict)]
    control = _control(rec)
    must = control["must_break"] if control else []
    n_ok = sum(bool(c.get("passed")) for c in claims)
    summary = f"{n_ok}/{len(claims)}"
    if sanity:
        s_ok = sum(bool(c.get("passed")) for c in sanity)
        summary += f' <small class="{"ok" if s_ok == len(sanity) else "bad"}">· sanity {s_ok}/{len(sanity)}</small>'
    body = ""
    if claims:
        body += f"<h4>Claims</h4><ul>{_check_items(claims, must)}</ul>"
    if sanity:
        body += f"<h4>Sanity checks (not claims)</h4><ul>{_check_items(sanity)}</ul>"
    params = rec.get("params") if isinstance(rec.get("params"), dict) else {}
    params = {k: v for k, v in params.items() if not (k == "control" and not v)}
    if params:
        body += "<h4>Parameters</h4><code>" + e(", ".join(f"{k}={fmt(v)}" for k, v in params.items())) + "</code>"
    if page:
        body += f'<p><a href="{quote(stem)}.html">report page</a></p>'
    return f"<details><summary>{summary}</summary>{body}</details>"


def _index_row(out_dir: Path, notebooks: Path, stem: str, paper, rec: dict | None) -> str:
    e = html.escape
    nb_path = notebooks / f"{stem}.ipynb"
    page = rec is not None and (out_dir / f"{stem}.html").exists()
    defaults = {**CONTRACT_DEFAULTS, **(_notebook_defaults(nb_path) if rec is not None else {})}
    cls, status = _status_cell(rec, nb_path.exists(), defaults)
    number = f"{paper.number:02d}" if paper is not None else stem.split("_", 1)[0] if stem[:2].isdigit() else ""
    seconds = rec.get("seconds") if rec else None
    seconds = f"{seconds:.1f}" if isinstance(seconds, (int, float)) else ""
    row_cls = cls if cls in ("coming", "not-run") else "run"
    return (f'<tr class="{row_cls}" id="{e(stem)}"><td class="num">{e(number)}</td>'
            f'<td class="paper">{_paper_cell(paper, stem, rec, page)}</td>'
            f'<td class="{e(cls)}">{status}</td><td>{_claims_cell(stem, rec, page)}</td>'
            f'<td class="num">{seconds}</td></tr>')


def build_index(out_dir: Path, notebooks: Path | None = None) -> Path:
    """Write ``out_dir/index.html``, the lab's dashboard, and return its path.

    One row for the tour and one per paper of ``lab.papers`` (in order), then one per other run
    record. A row shows the run record ``out_dir/<stem>.json`` when there is one (status or control
    verdict, non-default parameters, claims passed/total with the claim and sanity details one click
    away); else ``not run`` when ``notebooks/<stem>.ipynb`` exists and ``coming`` when it does not.
    """
    from lab.papers import ALL, PAPERS

    out_dir = Path(out_dir)
    notebooks = Path(notebooks) if notebooks is not None else NOTEBOOKS
    records = _read_records(out_dir)
    known = {p.stem for p in ALL}
    rows = [_index_row(out_dir, notebooks, p.stem, p, records.get(p.stem)) for p in ALL]
    rows += [_index_row(out_dir, notebooks, stem, None, rec) for stem, rec in records.items() if stem not in known]

    controls = [c for c in map(_control, records.values()) if c is not None]
    passed = sum(r["status"] == "passed" and _control(r) is None for r in records.values())
    total = sum(r["seconds"] for r in records.values() if isinstance(r.get("seconds"), (int, float)))
    built = sum((notebooks / f"{p.stem}.ipynb").exists() for p in PAPERS)
    when = datetime.now().astimezone().isoformat(timespec="seconds")
    measured = sum(r["status"] == "measured" for r in records.values())
    summary = f"{len(records)} notebooks run, {passed} passed" + (f", {measured} measured (no claims)" * bool(measured))
    if controls:
        summary += (f", {len(controls)} control run{'s' * (len(controls) != 1)} "
                    f"({sum(c['ok'] for c in controls)} broke every claim named)")
    summary += f", {total:.1f} s in total"
    summary += f"; {built} of {len(PAPERS)} papers have a notebook, {len(PAPERS) - built} coming; generated {when}."
    newline = "\n"
    page = f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>ICML 2025 paper lab</title><style>{INDEX_CSS}</style></head>
<body>
<h1>ICML 2025 paper lab</h1>
<p class="summary">{html.escape(summary)}</p>
<table>
<thead><tr><th>#</th><th>Paper</th><th>Status</th><th>Claims passed</th><th>Seconds</th></tr></thead>
<tbody>
{newline.join(rows)}
</tbody>
</table>
</body>
</html>
"""
    return atomic_write(out_dir / "index.html", page)
