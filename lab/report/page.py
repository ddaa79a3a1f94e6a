"""Notebook → HTML with the ``offline_lab`` template (nbconvert), plotly outputs drawn by the page's own plotly.js.
Kept apart from `lab.report` so that a run without pages (sweeps, control runs) never imports nbconvert."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbconvert import HTMLExporter
from nbconvert.preprocessors import Preprocessor
from traitlets.config import Config

from lab.report import PLOTLY_MIME, TEMPLATES


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


def render(executed: Path, *, static: str = "_static") -> str:
    """The page of an executed notebook (``static``: the URL of the static folder relative to the page; cells
    tagged ``hide-input`` show their outputs only)."""
    config = Config()
    config.TagRemovePreprocessor.enabled = True
    config.TagRemovePreprocessor.remove_input_tags = {"hide-input"}
    exporter = HTMLExporter(config=config, template_name="offline_lab",
                            extra_template_basedirs=[str(TEMPLATES)])
    exporter.register_preprocessor(PlotlyToHTML(), enabled=True)
    nb = nbformat.read(executed, as_version=4)
    body, _ = exporter.from_notebook_node(nb, resources={"lab_static": static})
    return body
