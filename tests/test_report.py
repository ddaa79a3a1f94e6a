"""Offline HTML reports (lab.report): page content, static folder, atomic writes, index page."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

from lab import report

PLOTLY_MIME = "application/vnd.plotly.v1+json"
# Every tag attribute that makes the browser fetch something.
FETCHING_ATTR = re.compile(r"<(?:script|link|img|iframe|source|video|audio)\b[^>]*?\b(?:src|href)=[\"']([^\"']*)",
                           re.IGNORECASE)


def demo_notebook() -> nbformat.NotebookNode:
    """A small notebook with what a report must render: LaTeX, a widget explorer, a plotly figure.

    The explorer has the tour's structure: a VBox ``lab-explorer`` holding a slider and an HTML
    ``lab-readout`` that a Python callback updates. The slider's description is ``$\\tau$``, which
    the offline page must typeset (ipywidgets calls MathJax 2's API for it; see the template).
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
            "slider = w.FloatSlider(value=0.5, min=0.0, max=2.0, step=0.1, description='$\\\\tau$')\n"
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

    monkeypatch.setattr(HTMLExporter, "from_notebook_node", crash_while_writing)
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


# ---------------------------------------------------------------------------------------------- index

CONTRACT = {"scale": "smoke", "device": "auto", "seed": 0, "model": "tiny", "control": ""}


def _record(notebook, status, claims, params=None, **extra):
    return {"notebook": notebook, "title": f"Title of {notebook}", "paper": f"Paper line of {notebook}",
            "params": {**CONTRACT, **(params or {})}, "seconds": 10.0, "status": status,
            "claims": claims, "metrics": {}, **extra}


def _notebook(folder: Path, stem: str, params_source: str) -> None:
    v4 = nbformat.v4
    nb = v4.new_notebook(cells=[v4.new_code_cell(params_source, metadata={"tags": ["parameters"]})])
    nbformat.write(nb, folder / f"{stem}.ipynb")


def _row(html: str, stem: str) -> str:
    rows = re.findall(rf'<tr class="[^"]*" id="{stem}">.*?</tr>', html, re.DOTALL)
    assert len(rows) == 1, (stem, rows)
    return rows[0]


def _claim(name, passed, value=1.0, op=">=", threshold=0.5):
    return {"name": name, "value": value, "op": op, "threshold": threshold, "passed": passed}


@pytest.fixture
def index_html(tmp_path) -> str:
    """An index built from hand-written records, beside a notebooks folder with four notebooks."""
    nbs, out = tmp_path / "notebooks", tmp_path / "reports"
    nbs.mkdir()
    out.mkdir()
    contract = ('scale: str = "smoke"  # ...\ndevice: str = "auto"\nseed: int = 0\nmodel: str = "tiny"\n'
                'control: str = ""')
    for stem in ("00_tour", "01_expo", "03_tlm"):
        _notebook(nbs, stem, contract)
    _notebook(nbs, "11_hps", contract + "\nlr: float = 1e-3  # step size\nbeta: float = 0.1")

    ok = {"name": "accuracy", "value": 0.987654321, "op": ">=", "threshold": 0.9, "passed": True}
    bad = {"name": "speedup", "value": 1.23456, "op": ">", "threshold": 2, "passed": False}
    records = {
        "00_tour": _record("00_tour", "passed", [ok], sanity=[_claim("probabilities sum to one", True),
                                                             _claim("loss is finite", True)]),
        "01_expo": _record("01_expo", "failed", [ok, bad], sanity=[_claim("grad check", False)],
                           error="ClaimFailed: speedup <too> small"),
        "11_hps": _record("11_hps", "failed", [_claim("hard beats soft", False), _claim("margin", False),
                                               _claim("kept", True)],
                          params={"control": "uniform", "seed": 3, "lr": 0.01, "beta": 0.1},
                          control={"name": "uniform", "must_break": ["hard beats soft", "margin"],
                                   "broken": ["hard beats soft", "margin"], "survived": ["kept"]}),
        "19_cdpo": _record("19_cdpo", "passed", [_claim("gap", True), _claim("acc", True)],
                           params={"control": "shuffled"},
                           control={"name": "shuffled", "must_break": ["gap", "acc"], "broken": [],
                                    "survived": ["gap", "acc"]}),
        "77_extra": _record("77_extra", "error", [], error="Boom <here>"),
    }
    for stem, rec in records.items():
        (out / f"{stem}.json").write_text(json.dumps(rec))
    for stem in ("00_tour", "11_hps"):
        (out / f"{stem}.html").write_text("report")
    (out / "metrics_cache.json").write_text(json.dumps({"something": "else"}))
    (out / "broken.json").write_text("{")

    path = report.build_index(out, notebooks=nbs)
    assert path == out / "index.html" and not list(out.glob("*.tmp"))
    return path.read_text(encoding="utf-8")


def test_papers_registry_matches_notebooks():
    from lab.papers import ALL, BY_STEM, PAPERS, TOUR

    assert [p.number for p in PAPERS] == list(range(1, 20))
    assert ALL[0] is TOUR and TOUR.stem == "00_tour" and not TOUR.is_paper
    assert len(BY_STEM) == 20 and BY_STEM["11_hps"].short == "HPS" and BY_STEM["09_gather_aggregate"].arxiv
    assert all(p.title and p.authors and p.arxiv for p in PAPERS)
    unknown = [p.stem for p in sorted(Path(report.NOTEBOOKS).glob("*.ipynb")) if p.stem not in BY_STEM]
    assert not unknown, f"notebooks missing from lab.papers: {unknown}"


def test_index_has_one_row_per_paper_plus_tour_and_other_runs(index_html):
    from lab.papers import PAPERS

    body = index_html.split("<tbody>")[1]
    assert body.count("<tr ") == 21  # tour + 19 papers + the unknown 77_extra
    assert "<script" not in index_html and "http" not in index_html
    for paper in PAPERS:
        row = _row(index_html, paper.stem)
        assert f"<b>{paper.short.replace('&', '&amp;')}</b>" in row
        assert index_html.count(html_escape(paper.title)) == 1  # the title once, never repeated
    assert "Title of 00_tour" not in index_html and "Paper line of 11_hps" not in index_html
    assert "arXiv 2502.14400" in _row(index_html, "11_hps")
    extra = _row(index_html, "77_extra")  # a record the registry does not know is still shown
    assert "77_extra" in extra and "Boom &lt;here&gt;" in extra and 'class="error"' in extra
    assert "something" not in index_html


def test_index_status_of_papers_without_runs(index_html):
    assert '<td class="not-run">not run</td>' in _row(index_html, "03_tlm")  # notebook, no record
    assert '<td class="coming">coming</td>' in _row(index_html, "02_popper")  # no notebook yet
    assert "<details>" not in _row(index_html, "03_tlm") and "href" not in _row(index_html, "03_tlm")


def test_index_claims_and_sanity_one_click_away(index_html):
    tour = _row(index_html, "00_tour")
    assert '<a href="00_tour.html"><b>Tour</b></a>' in tour
    assert '<td class="passed">passed</td>' in tour  # default parameters: nothing more to say
    assert "<summary>1/1 " in tour and "sanity 2/2" in tour  # sanity checks are not counted as claims
    assert "<h4>Sanity checks (not claims)</h4>" in tour and "probabilities sum to one: 1 &gt;= 0.5 ✓" in tour
    assert '<td class="num">10.0</td>' in tour

    expo = _row(index_html, "01_expo")
    assert 'href="01_expo.html"' not in expo  # no report page, no link
    assert 'class="failed">failed' in expo and "ClaimFailed: speedup &lt;too&gt; small" in expo
    details = expo.split("<details>")[1]
    assert details.startswith("<summary>1/2 ") and '<small class="bad">· sanity 0/1</small>' in details
    assert '<li class="ok">accuracy: 0.9877 &gt;= 0.9 ✓</li>' in details
    assert '<li class="bad">speedup: 1.235 &gt; 2 ✗</li>' in details
    assert "scale=smoke, device=auto, seed=0, model=tiny" in details


def test_index_control_runs_and_parameters(index_html):
    hps = _row(index_html, "11_hps")
    status = re.search(r'<td class="(\w+)">(control.*?)</td>', hps).groups()
    assert status[0] == "ok"
    assert "control <code>uniform</code>: 2/2 named claims broken ✓" in status[1]
    assert '<small class="params">seed=3, lr=0.01</small>' in status[1]  # only what differs from the defaults
    assert "beta" not in status[1] and "scale" not in status[1]
    assert "hard beats soft: 1 &gt;= 0.5 ✗ <em>(must break)</em>" in hps and "<summary>1/3" in hps
    assert '<a href="11_hps.html"><b>HPS</b></a>' in hps

    cdpo = _row(index_html, "19_cdpo")
    assert '<td class="bad">control <code>shuffled</code> did NOT break: gap, acc ✗' in cdpo
    assert "passed</td>" not in cdpo

    summary = re.search(r'<p class="summary">(.*?)</p>', index_html).group(1)
    assert summary.startswith("5 notebooks run, 1 passed, 2 control runs (1 broke every claim named), "
                              "50.0 s in total; 3 of 19 papers have a notebook, 16 coming; generated ")


def test_index_control_without_verdict_is_not_a_pass(tmp_path):
    rec = _record("11_hps", "failed", [_claim("a", False)], params={"control": "noise"})
    (tmp_path / "11_hps.json").write_text(json.dumps(rec))
    html = report.build_index(tmp_path, notebooks=tmp_path).read_text(encoding="utf-8")
    assert '<td class="bad">control <code>noise</code> did NOT break: no claims are named to break ✗' in html


def html_escape(text: str) -> str:
    import html

    return html.escape(text)
