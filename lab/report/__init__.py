"""Offline HTML reports: one page per executed notebook, and the index: a dashboard of the papers (`index`).

A report page is nbconvert's JupyterLab look (template ``offline_lab``) with every script served
from a shared folder beside it (``_static/``), so it works without a network:

- ``widgets-embed.js``: the ipywidgets HTML manager (npm ``@jupyter-widgets/html-manager``), which
  renders the widget state saved in the executed notebook (the template maps the MathJax 2 calls
  its controls make for ``$...$`` in widget labels onto MathJax 3, see ``offline_lab/index.html.j2``);
- ``mathjax/tex-svg.js``: MathJax 3 (npm ``mathjax``), for ``$...$`` / ``$$...$$`` in markdown;
- ``plotly.min.js``: written from the installed plotly package; plotly outputs
  (``application/vnd.plotly.v1+json``) are converted to HTML divs when the page is rendered.

The npm packages are pinned in ``package.json`` at the repository root (``npm ci`` installs them).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

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


def export_html(executed: Path, out_html: Path, *, static: str = "_static") -> Path:
    """Render an executed notebook to ``out_html`` (atomically) with the ``offline_lab`` template
    (`lab.report.page`, imported here so that runs without pages never load nbconvert).

    ``static`` is the URL of the static folder relative to the page. Cells tagged ``hide-input``
    show their outputs only.
    """
    from lab.report.page import render

    return atomic_write(Path(out_html), render(executed, static=static))


from lab.report.index import NOTEBOOKS, build_index  # noqa: E402  (the index writes through atomic_write above)

__all__ = ["atomic_write", "ensure_static", "export_html", "build_index", "NOTEBOOKS"]
