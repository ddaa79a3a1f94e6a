"""Notebooks as the runner sees them: found by name, their parameters cell and declared controls read without
running them, every override validated before any kernel starts (`plan`), and one notebook executed under
papermill into its executed copy, run record and offline page (`run_one`). `lab.cli` is the command line over it;
`lab.core.results` runs sweeps through that command line.
"""

from __future__ import annotations

import ast
import json
import os
import tempfile
import time
from pathlib import Path

from lab.core import zygote
from lab.core.params import ParamError, check_limits, check_type, validate

CONTRACT = ("scale", "device", "seed", "model", "control")


class UsageError(Exception):
    """A bad command line: printed as one sentence, exit code 2."""


def notebooks(folder: Path) -> dict[str, Path]:
    """`{stem: path}` for every notebook in `folder`, sorted."""
    return {p.stem: p for p in sorted(folder.glob("*.ipynb"))}


def resolve(names: list[str], folder: Path) -> list[Path]:
    """Notebook stems (`09_gather_aggregate`), slugs (`gather_aggregate`) or `all` -> paths."""
    found = notebooks(folder)
    if names == ["all"]:
        return list(found.values())
    out = []
    for name in names:
        match = [p for stem, p in found.items() if name in (stem, stem.split("_", 1)[-1])]
        if not match:
            raise UsageError(f"no notebook named {name!r} in {folder}; known: {', '.join(found) or 'none'}.")
        out += [p for p in match if p not in out]
    return out


def parse_value(text: str):
    """`-p` values as papermill reads them: int, float, bool, None, else the string."""
    try:
        value = ast.literal_eval(text)
        return value if isinstance(value, (int, float, bool, type(None))) else text
    except (ValueError, SyntaxError):
        return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def defaults(nb_path: Path) -> dict:
    """The notebook's parameters cell as `{name: default}` (papermill's own parser)."""
    import papermill as pm

    params = pm.inspect_notebook(str(nb_path))
    if not all(k in params for k in CONTRACT):
        raise UsageError(f"{nb_path.name} has no parameters cell with {', '.join(CONTRACT)}.")
    return {k: ast.literal_eval(v["default"]) for k, v in params.items()}


CHECKPOINT_ONLY = ("checkpoint only", "checkpoint:", "checkpoint path:")  # how a knob's comment says it


def unused_on_tiny(nb_path: Path, overrides: dict, params: dict) -> list[str]:
    """The overridden knobs whose parameters-cell comment says they serve the checkpoint path only, when the run is
    the tiny one (`model="tiny"`): the runner names them, as a note, rather than let them pass unnoticed."""
    import papermill as pm

    if params.get("model") != "tiny":
        return []
    helps = {k: v["help"].lower() for k, v in pm.inspect_notebook(str(nb_path)).items()}
    return [k for k in overrides if helps.get(k, "").startswith(CHECKPOINT_ONLY)]


def declared_controls(nb_path: Path) -> dict[str, list[str]]:
    """The `controls={...}` literal of the notebook's `lab.core.setup(...)` call: `{name: [claims it breaks]}`."""
    import nbformat

    nb = nbformat.read(str(nb_path), as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code" or "setup(" not in cell.source:
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:  # IPython magics: drop them and try again
            tree = ast.parse("\n".join(line for line in cell.source.splitlines() if not line.startswith("%")))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "setup":
                for kw in node.keywords:
                    if kw.arg == "controls":
                        return ast.literal_eval(kw.value)
                return {}
    return {}


def plan(paths: list[Path], overrides: dict) -> list[tuple[Path, dict, dict]]:
    """(notebook, overrides, effective params) for each notebook, all validated before any run: the contract
    parameters (`validate`), and the paper's knobs: each override in its default's type (`check_type`), all of them
    within the paper's limits (`lab.papers.LIMITS`)."""
    out = []
    for path in paths:
        base = defaults(path)
        unknown = [k for k in overrides if k not in base]
        if unknown:
            raise UsageError(f"{path.stem} has no parameter {unknown[0]!r}; its parameters are {', '.join(base)}.")
        try:  # the paper's own knobs: each override in its default's type (this notebook's), then its limits
            ov = {k: v if k in CONTRACT else check_type(k, v, base[k]) for k, v in overrides.items()}
            check_limits(limits_of(path.stem), {**base, **ov})
        except ParamError as e:
            raise ParamError(f"{path.stem}: {e}") from None
        params = {**base, **ov}
        validate(*(params[k] for k in CONTRACT), controls=declared_controls(path), resolve=False)
        out.append((path, ov, params))
    return out


def limits_of(stem: str) -> tuple[str, ...]:
    """The limits `lab.papers.LIMITS` declares for the notebook's knobs (none for a notebook it does not list)."""
    from lab.papers import LIMITS

    return LIMITS.get(stem, ())


def check_knobs(path: Path, values: dict) -> None:
    """The notebook's own knobs as they stand in `values` (a kernel's namespace) against their defaults' types and
    the paper's limits: what `plan` checks for `-p` overrides, for a notebook edited in JupyterLab (`setup` calls
    it there). One `ParamError` sentence."""
    base = defaults(path)
    now = {k: values.get(k, v) for k, v in base.items()}
    for k, v in now.items():
        if k not in CONTRACT:
            check_type(k, v, base[k])
    check_limits(limits_of(path.stem), now)


def title_of(nb) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return ""


def read_jsonl(path: Path) -> dict:
    """The run's records by kind: `claim` and `sanity` lists (the last record of a name wins), `metrics`,
    and the verdict's `control` summary for a control run."""
    by_kind: dict[str, dict] = {"claim": {}, "sanity": {}, "metric": {}, "control": {}}
    if path.exists():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_kind.setdefault(rec.pop("kind"), {})[rec["name"]] = rec
    return {"claims": list(by_kind["claim"].values()), "sanity": list(by_kind["sanity"].values()),
            "metrics": {k: r["value"] for k, r in by_kind["metric"].items()},
            "control": by_kind["control"].get("control", {}).get("value")}


# exceptions a notebook raises for bad input (lab.core.params, lab.data.text, lab.models.pretrained): one sentence
BAD_INPUT = ("ParamError", "DataNotAvailable", "ModelNotAvailable")


def run_one(path: Path, overrides: dict, params: dict, out: Path, *, cell_timeout: int, page: bool = True) -> dict:
    """Execute one notebook, write its executed copy, record and page; returns the record."""
    import nbformat
    import papermill as pm

    from lab import report

    stem = path.stem
    for suffix in (".json", ".html"):  # a stale success must not survive a failed re-run
        (out / f"{stem}{suffix}").unlink(missing_ok=True)
    fd, jsonl = tempfile.mkstemp(suffix=".jsonl")
    os.close(fd)
    os.environ["LAB_RECORD_FILE"] = jsonl
    served = os.environ.get(zygote.ENV)
    if params["scale"] != "smoke":  # the zygote's imports ran with smoke scale's HF_HUB_OFFLINE=1: a plain kernel
        os.environ[zygote.ENV] = "off"
    status, error, t0 = "passed", None, time.perf_counter()
    # The kernel is stopped at once after the last cell: a graceful shutdown (nbclient's default) idles ~3 s per run
    # before the kernel exits, ~100 runs in one CI run. Nothing is left to flush by then: records are appended and
    # closed per call, stage results and artefacts are written atomically inside the cells that make them.
    try:
        pm.execute_notebook(str(path), str(out / f"{stem}.ipynb"), parameters=overrides, kernel_name="python3",
                            cwd=str(path.parent), execution_timeout=cell_timeout, start_timeout=120,
                            progress_bar=False, log_output=False, shutdown_kernel="immediate",
                            kernel_manager_class=zygote.kernel_manager())
    except pm.PapermillExecutionError as e:
        if e.ename in BAD_INPUT:  # the notebook refused its input (a wrong model family, missing data): no report
            os.environ.pop("LAB_RECORD_FILE", None)
            for leftover in (Path(jsonl), out / f"{stem}.ipynb"):
                leftover.unlink(missing_ok=True)
            raise ParamError(f"{stem}: {e.evalue}") from None
        status = "failed" if e.ename == "ClaimFailed" else "error"
        error = f"{e.ename}: {e.evalue}"
    except Exception as e:  # kernel death, timeout, ...
        status, error = "error", f"{type(e).__name__}: {e}"
    finally:
        os.environ.pop("LAB_RECORD_FILE", None)
        if served is not None:
            os.environ[zygote.ENV] = served
        elif params["scale"] != "smoke":
            os.environ.pop(zygote.ENV, None)
    seconds = time.perf_counter() - t0
    records = read_jsonl(Path(jsonl))
    claims, metrics = records["claims"], records["metrics"]
    Path(jsonl).unlink(missing_ok=True)
    if status == "passed" and not all(c["passed"] for c in claims + records["sanity"]):
        status = "failed"
    if status == "passed" and not claims and not params.get("control"):
        status = "measured"  # it ran and recorded, but asserted no claim (e.g. a checkpoint run): not a pass
    if params.get("control") and not records["control"]:  # the run stopped before its verdict
        from lab.core.records import judge

        must = declared_controls(path).get(params["control"], [])
        records["control"] = judge({c["name"]: {**c, "kind": "claim"} for c in claims}, params["control"],
                                   tuple(must))["control"]
    executed = out / f"{stem}.ipynb"
    nb = nbformat.read(str(executed if executed.exists() else path), as_version=4)
    rec = {"notebook": stem, "title": title_of(nb), "paper": nb.metadata.get("lab", {}).get("paper", ""),
           "params": params, "seconds": round(seconds, 2), "status": status, "claims": claims,
           "sanity": records["sanity"], "metrics": metrics}
    if records["control"]:
        rec["control"] = records["control"]
    if error:
        rec["error"] = error
    if page and executed.exists():
        report.ensure_static(out)
        report.export_html(executed, out / f"{stem}.html")
    report.atomic_write(out / f"{stem}.json", json.dumps(rec, indent=1, default=str))
    return rec
