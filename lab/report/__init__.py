"""Offline HTML reports: one page per executed notebook, and an index of all runs.

A report page is nbconvert's JupyterLab look (template ``offline_lab``) with every script served
from a shared folder beside it (``_static/``), so it works without a network:

- ``widgets-embed.js``: the ipywidgets HTML manager (npm ``@jupyter-widgets/html-manager``), which
  renders the widget state saved in the executed notebook;
- ``mathjax/tex-svg.js``: MathJax 3 (npm ``mathjax``), for ``$...$`` / ``$$...$$`` in markdown;
- ``plotly.min.js``: written from the installed plotly package; plotly outputs
  (``application/vnd.plotly.v1+json``) are converted to HTML divs when the page is rendered.

The npm packages are pinned in ``package.json`` at the repository root (``npm ci`` installs them).
"""

from __future__ import annotations

import html
import json
import logging
import os
import shutil
import tempfile
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

import nbformat
from nbconvert import HTMLExporter
from nbconvert.preprocessors import Preprocessor
from traitlets.config import Config

from lab.core.records import fmt

log = logging.getLogger(__name__)

TEMPLATES = Path(__file__).resolve().parent / "templates"
NODE_MODULES = Path(__file__).resolve().parents[2] / "node_modules"
WIDGETS_DIST = NODE_MODULES / "@jupyter-widgets" / "html-manager" / "dist"
MATHJAX_DIR = NODE_MODULES / "mathjax"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
FONT_SUFFIXES = {".woff", ".woff2", ".ttf", ".eot", ".svg"}
STAMP = ".stamp.json"


def atomic_write(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same folder, then rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600 files; reports are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _npm_version(package_dir: Path) -> str | None:
    """Version of an installed npm package, or None when it is not installed."""
    try:
        return json.loads((package_dir / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


def ensure_static(out_dir: Path) -> Path:
    """Create (or refresh) ``out_dir/_static`` with the scripts the reports load; return its path.

    Fast when nothing changed: a stamp file records the versions that were copied. Without
    ``node_modules`` only plotly.js is written and one warning is logged.
    """
    import plotly
    from plotly.offline import get_plotlyjs

    static = Path(out_dir) / "_static"
    wanted = {
        "plotly": plotly.__version__,
        "html-manager": _npm_version(WIDGETS_DIST.parent),
        "mathjax": _npm_version(MATHJAX_DIR),
    }
    if wanted["html-manager"] is None or wanted["mathjax"] is None:
        log.warning(
            "%s lacks @jupyter-widgets/html-manager or mathjax: widgets and equations will not render "
            "in offline reports. Run `npm ci` in the repository root to fix it.", NODE_MODULES)
    try:
        if json.loads((static / STAMP).read_text()) == wanted:
            return static
    except (OSError, ValueError):
        pass

    static.mkdir(parents=True, exist_ok=True)
    atomic_write(static / "plotly.min.js", get_plotlyjs())
    if wanted["html-manager"]:
        embed = (WIDGETS_DIST / "embed.js").read_text(encoding="utf-8")
        for asset in WIDGETS_DIST.iterdir():  # fonts (FontAwesome) loaded relative to the script
            if asset.suffix in FONT_SUFFIXES and asset.name in embed:
                shutil.copy2(asset, static / asset.name)
        shutil.copy2(WIDGETS_DIST / "embed.js", static / "widgets-embed.js")
    if wanted["mathjax"]:
        shutil.copytree(MATHJAX_DIR / "es5", static / "mathjax", dirs_exist_ok=True)
    atomic_write(static / STAMP, json.dumps(wanted))
    return static


class PlotlyToHTML(Preprocessor):
    """Replace each plotly JSON output by an HTML div that draws it with the page's plotly.js."""

    def preprocess_cell(self, cell, resources, index):
        import plotly.io as pio

        for output in cell.get("outputs", []):
            fig = output.get("data", {}).pop(PLOTLY_MIME, None)
            if fig is not None:
                output["data"]["text/html"] = pio.to_html(
                    fig, config=fig.get("config"), include_plotlyjs=False, include_mathjax=False,
                    full_html=False, default_height=525, validate=False)
        return cell, resources


def export_html(executed: Path, out_html: Path, *, static: str = "_static") -> Path:
    """Render an executed notebook to ``out_html`` (atomically) with the ``offline_lab`` template.

    ``static`` is the URL of the static folder relative to the page. Cells tagged ``hide-input``
    show their outputs only.
    """
    config = Config()
    config.TagRemovePreprocessor.enabled = True
    config.TagRemovePreprocessor.remove_input_tags = {"hide-input"}
    exporter = HTMLExporter(config=config, template_name="offline_lab",
                            extra_template_basedirs=[str(TEMPLATES)])
    exporter.register_preprocessor(PlotlyToHTML(), enabled=True)
    nb = nbformat.read(executed, as_version=4)
    body, _ = exporter.from_notebook_node(nb, resources={"lab_static": static})
    return atomic_write(Path(out_html), body)


# ---------------------------------------------------------------------------------------------- index

INDEX_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; width: 100%; }
th, td { border: 1px solid #ccc; padding: .4em .6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.passed, .ok { color: #1a7f37; font-weight: 600; }
.failed, .bad { color: #cf222e; font-weight: 600; }
.error { color: #bc4c00; font-weight: 600; }
ul { margin: 0; padding-left: 1.1em; }
code { font-size: 90%; }
"""


def _is_record(data) -> bool:
    """True for a run record written by the runner (see DESIGN.md, Runner)."""
    return (isinstance(data, dict) and isinstance(data.get("notebook"), str)
            and isinstance(data.get("status"), str) and isinstance(data.get("claims", []), list))


def _read_records(out_dir: Path) -> list[dict]:
    records = []
    for path in sorted(out_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.debug("skipping unreadable %s", path)
            continue
        if _is_record(data):
            records.append(data)
    return sorted(records, key=lambda r: r["notebook"])


def _row(out_dir: Path, rec: dict) -> str:
    e = html.escape
    name = rec["notebook"]
    cell = e(name)
    if (out_dir / f"{name}.html").exists():
        cell = f'<a href="{quote(name)}.html">{cell}</a>'
    paper = " — ".join(e(str(rec[k])) for k in ("paper", "title") if rec.get(k))
    params = ", ".join(f"{e(str(k))}={e(fmt(v))}" for k, v in (rec.get("params") or {}).items())
    status = e(rec["status"])
    if rec.get("error"):
        status += f'<br><small>{e(str(rec["error"]))}</small>'
    claims = "".join(
        f'<li class="{"ok" if c.get("passed") else "bad"}">{e(str(c.get("name")))}: '
        f'{e(fmt(c.get("value")))} {e(str(c.get("op", "")))} {e(fmt(c.get("threshold")))} '
        f'{"✓" if c.get("passed") else "✗"}</li>'
        for c in rec.get("claims", []) if isinstance(c, dict))
    seconds = rec.get("seconds")
    seconds = f"{seconds:.1f}" if isinstance(seconds, (int, float)) else ""
    return (f"<tr><td>{cell}</td><td>{paper}</td><td><code>{params}</code></td>"
            f'<td class="{e(rec["status"])}">{status}</td><td class="num">{seconds}</td>'
            f"<td><ul>{claims}</ul></td></tr>")


def build_index(out_dir: Path) -> Path:
    """Write ``out_dir/index.html``: one table row per run record ``out_dir/*.json``; return its path."""
    out_dir = Path(out_dir)
    records = _read_records(out_dir)
    passed = sum(r["status"] == "passed" for r in records)
    total = sum(r["seconds"] for r in records if isinstance(r.get("seconds"), (int, float)))
    when = datetime.now().astimezone().isoformat(timespec="seconds")
    rows = "\n".join(_row(out_dir, r) for r in records)
    page = f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>ICML 2025 paper lab: runs</title><style>{INDEX_CSS}</style></head>
<body>
<h1>ICML 2025 paper lab: runs</h1>
<p class="summary">{len(records)} notebooks, {passed} passed, {total:.1f} s in total; generated {when}.</p>
<table>
<thead><tr><th>Notebook</th><th>Paper</th><th>Parameters</th><th>Status</th><th>Seconds</th>
<th>Claims</th></tr></thead>
<tbody>
{rows}
</tbody>
</table>
</body>
</html>
"""
    return atomic_write(out_dir / "index.html", page)
