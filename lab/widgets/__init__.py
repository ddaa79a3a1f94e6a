"""Explorers (ipywidgets panels built by functions that take data) and the plotly figures they draw."""

from lab.widgets.figures import curve, heatmap, lines
from lab.widgets.next_token import next_token_explorer, next_token_figure

__all__ = ["curve", "heatmap", "lines", "next_token_explorer", "next_token_figure"]
