"""The ICML 2025 paper lab: a thin library behind one executable notebook per paper.

Shared pieces: `lab.core` (parameters, seeding, progress, claim checks), `lab.models` (tiny model
zoo, cached trainer, pretrained loading), `lab.data` (procedural tasks), `lab.widgets` (explorers),
`lab.report` (offline HTML). `python -m lab run|list|report` is the runner (`lab.cli`).
"""

import sys

__version__ = "0.1.0"

# jsonschema, which nbformat imports (and papermill and plotly import nbformat), compiles an RFC 3987 grammar with
# lark at import time whenever the optional `rfc3987_syntax` is installed (Jupyter's `jsonschema[format-nongpl]`
# installs it): ~2 s in every runner process and every notebook kernel, about 120 of them in one CI run. Nothing the
# lab does validates IRIs, so the lab's processes leave that checker out (an import of it raises ImportError, which
# jsonschema expects for an optional checker). Other processes (JupyterLab's server) are untouched.
sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[assignment]
