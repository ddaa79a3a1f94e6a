"""Offline HTML reports (lab.report): page content, static folder, atomic writes, index page."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from lab import report

PLOTLY_MIME = "application/vnd.plotly.v1+json"
# Every tag attribute that makes the browser fetch something.
FETCHING_ATTR = re.compile(r"<(?:script|link|img|iframe|source|video|audio)\b[^>]*?\b(?:src|href)=[\"']([^\"']*)",
                           re.IGNORECASE)


def demo_notebook() -> nbformat.NotebookNode:
    """A small notebook with what a report must render: LaTeX, a widget explorer, a plotly figure.

    The explorer has the tour's structure: a VBox ``lab-explorer`` holding a slider and an HTML
    ``lab-readout`` that a Python callback updates.
    """
    v4 = nbformat.v4
    nb = v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                  "language": "python"}})
    nb.cells = [
        v4.new_markdown_cell("# Demo report\n\nInline $E=mc^2$ and display $$\\int_0^1 x\\,dx = \\tfrac{1}{2}$$"),
        v4.new_code_cell("import ipywidgets as w\nimport plotly.graph_objects as go\nimport plotly.io as pio\n"
                         "pio.renderers.default = 'plotly_mimetype'\nSECRET_SETUP = 1",
                         metadata={"tags": ["hide-input"]}),
        v4.new_code_cell(
            "slider = w.FloatSlider(value=0.5, min=0.0, max=2.0, step=0.1, description='temperature')\n"
            "readout = w.HTML(f'T = {slider.value:.1f}')\n"
            "readout.add_class('lab-readout')\n"
            "slider.observe(lambda change: setattr(readout, 'value', f\"T = {change['new']:.1f}\"), 'value')\n"
            "explorer = w.VBox([slider, readout])\n"
            "explorer.add_class('lab-explorer')\n"
            "explorer"),
        v4.new_code_cell("go.Figure(go.Scatter(y=[1, 3, 2], name='demo'), layout_title_text='Demo figure')"),
    ]
    return nb


def execute_demo(folder: Path) -> Path:
    """Execute ``demo_notebook()`` with nbclient (kernel python3) into ``folder/demo.ipynb``."""
    folder.mkdir(parents=True, exist_ok=True)
    nb = demo_notebook()
    NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(folder)}}).execute()
    path = folder / "demo.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.fixture(scope="module")
def executed_demo(tmp_path_factory) -> Path:
    return execute_demo(tmp_path_factory.mktemp("demo"))


def test_executed_demo_has_widget_state_and_plotly_json(executed_demo):
    nb = nbformat.read(executed_demo, as_version=4)
    assert "application/vnd.jupyter.widget-state+json" in nb.metadata.widgets
    assert any(PLOTLY_MIME in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)


def test_export_html_is_offline_and_complete(executed_demo, tmp_path):
    static = report.ensure_static(tmp_path)
    page = report.export_html(executed_demo, tmp_path / "demo.html")
    html = page.read_text(encoding="utf-8")

    assert 'class="plotly-graph-div"' in html and "Plotly.newPlot" in html
    assert PLOTLY_MIME not in html
    assert "$E=mc^2$" in html  # left for MathJax 3 to typeset in the browser
    assert "application/vnd.jupyter.widget-state+json" in html
    assert "require.js" not in html and "mermaid.esm" not in html
    assert "SECRET_SETUP" not in html and "FloatSlider" in html  # hide-input hides only tagged cells

    fetched = FETCHING_ATTR.findall(html)
    assert not [u for u in fetched if re.match(r"(https?:)?//", u)], fetched
    for needed in ("_static/widgets-embed.js", "_static/mathjax/tex-svg.js", "_static/plotly.min.js"):
        assert needed in fetched
        assert (static.parent / needed).is_file()


def test_export_html_custom_static_url(executed_demo, tmp_path):
    html = report.export_html(executed_demo, tmp_path / "demo.html", static="../_static").read_text()
    assert 'src="../_static/widgets-embed.js"' in html


def test_ensure_static_files_and_idempotence(tmp_path):
    static = report.ensure_static(tmp_path)
    assert static == tmp_path / "_static"
    embed = (static / "widgets-embed.js").read_text(encoding="utf-8")
    fonts = [p for p in static.iterdir() if p.suffix in {".woff", ".woff2", ".ttf", ".eot", ".svg"}]
    assert fonts and all(p.name in embed for p in fonts)
    assert (static / "mathjax" / "tex-svg.js").is_file()
    assert (static / "mathjax" / "input" / "tex" / "extensions").is_dir()  # loaded on demand
    assert (static / "plotly.min.js").stat().st_size > 1_000_000

    before = (static / "plotly.min.js").stat().st_mtime_ns
    start = time.perf_counter()
    assert report.ensure_static(tmp_path) == static
    assert time.perf_counter() - start < 0.5
    assert (static / "plotly.min.js").stat().st_mtime_ns == before


def test_ensure_static_without_node_modules_warns_once(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(report, "WIDGETS_DIST", tmp_path / "missing" / "dist")
    monkeypatch.setattr(report, "MATHJAX_DIR", tmp_path / "missing" / "mathjax")
    with caplog.at_level("WARNING", logger="lab.report"):
        static = report.ensure_static(tmp_path / "out")
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "npm ci" in warnings[0].getMessage()
    assert (static / "plotly.min.js").is_file() and not (static / "widgets-embed.js").exists()


def test_export_html_is_atomic(executed_demo, tmp_path, monkeypatch):
    out = tmp_path / "demo.html"
    out.write_text("previous report")

    def crash_while_writing(self, nb, resources=None, **kw):
        return b"not text: writing this fails half-way", {}  # f.write(bytes) raises TypeError

    monkeypatch.setattr(report.HTMLExporter, "from_notebook_node", crash_while_writing)
    with pytest.raises(TypeError):
        report.export_html(executed_demo, out)
    assert out.read_text() == "previous report"
    with pytest.raises(TypeError):
        report.export_html(executed_demo, tmp_path / "new.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.html"]  # no partial or temp file


def test_export_html_bad_notebook_leaves_no_file(tmp_path):
    bad = tmp_path / "bad.ipynb"
    bad.write_text("{not json")
    with pytest.raises(ValueError):  # nbformat.reader.NotJSONError
        report.export_html(bad, tmp_path / "bad.html")
    assert not (tmp_path / "bad.html").exists()


def _record(notebook, status, claims, **extra):
    return {"notebook": notebook, "title": f"Title of {notebook}", "paper": "Some paper",
            "params": {"scale": "smoke", "seed": 0}, "seconds": 12.3456, "status": status,
            "claims": claims, "metrics": {}, **extra}


def test_build_index(tmp_path):
    ok = {"name": "accuracy", "value": 0.987654321, "op": ">=", "threshold": 0.9, "passed": True}
    bad = {"name": "speedup", "value": 1.23456, "op": ">", "threshold": 2, "passed": False}
    (tmp_path / "00_tour.json").write_text(json.dumps(_record("00_tour", "passed", [ok])))
    (tmp_path / "01_expo.json").write_text(json.dumps(_record("01_expo", "failed", [ok, bad])))
    (tmp_path / "02_err.json").write_text(json.dumps(_record("02_err", "error", [], error="Boom <here>")))
    (tmp_path / "00_tour.html").write_text("report")
    (tmp_path / "metrics_cache.json").write_text(json.dumps({"something": "else"}))
    (tmp_path / "broken.json").write_text("{")

    html = report.build_index(tmp_path).read_text(encoding="utf-8")
    body = html.split("<tbody>")[1]
    assert body.count("<tr>") == 3
    assert "<script" not in html and "http" not in html
    assert '<a href="00_tour.html">00_tour</a>' in html
    assert 'href="01_expo.html"' not in html  # no report page, no link
    assert "accuracy: 0.9877 &gt;= 0.9 ✓" in html
    assert '<li class="bad">speedup: 1.235 &gt; 2 ✗</li>' in html
    assert 'class="failed">failed' in html and 'class="passed">passed' in html
    assert "Boom &lt;here&gt;" in html
    assert "scale=smoke" in html and "Title of 00_tour" in html and "Some paper" in html
    assert "3 notebooks, 1 passed, 37.0 s" in html
    assert "something" not in html
    assert not list(tmp_path.glob("*.tmp"))
