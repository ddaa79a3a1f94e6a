"""The ICML 2025 paper lab: a thin library behind one executable notebook per paper.

Shared pieces: `lab.core` (parameters, seeding, progress, claim checks), `lab.models` (tiny model
zoo, cached trainer, pretrained loading), `lab.data` (procedural tasks), `lab.widgets` (explorers),
`lab.report` (offline HTML). `python -m lab run|list|report` is the runner (`lab.cli`).
"""

__version__ = "0.1.0"
