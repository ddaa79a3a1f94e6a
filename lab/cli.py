"""`python -m lab run|list|report|sweep|audit|bench` — the runner users, tests and CI share.

    python -m lab run 00_tour                    # one notebook (stem, or slug: `tour`)
    python -m lab run all -p seed 3 --out /tmp/r  # every notebook, a parameter override, another folder
    python -m lab list                           # notebooks, their papers, last recorded status
    python -m lab report                         # re-render HTML + index from executed notebooks
    python -m lab sweep hps --seeds 0-9          # seeds and declared controls -> notebooks/results/11_hps.json
    python -m lab audit all                      # claims on seeds 10-14, controls on seeds 1-2 -> reports/audit
    python -m lab bench NAME [options]           # a paper's benchmark (registered in lab.core.bench)

`run` validates every parameter before any kernel starts (a bad value is one sentence on stderr,
exit 2, nothing written), then for each notebook: papermill (kernel `python3`, cwd = the notebook's
folder, a per-cell timeout) into `DIR/<stem>.ipynb`, the run record `DIR/<stem>.json` (params,
seconds, status, claims, metrics), the offline page `DIR/<stem>.html`, and finally `DIR/index.html`.
Exit 0 only if every notebook ran and every claim passed. A failed notebook keeps its executed copy
(papermill marks the failing cell) and its record says `failed` (a claim did not hold) or `error`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from lab.core import zygote
from lab.core.params import ParamError, validate

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
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
    """(notebook, overrides, effective params) for each notebook, all validated before any run."""
    out = []
    for path in paths:
        base = defaults(path)
        unknown = [k for k in overrides if k not in base]
        if unknown:
            raise UsageError(f"{path.stem} has no parameter {unknown[0]!r}; its parameters are {', '.join(base)}.")
        params = {**base, **overrides}
        validate(*(params[k] for k in CONTRACT), controls=declared_controls(path), resolve=False)
        out.append((path, overrides, params))
    return out


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


def cmd_run(args) -> int:
    from lab import report

    overrides = {k: parse_value(v) for k, v in args.param}
    todo = plan(resolve(args.names, args.notebooks), overrides)  # raises before anything is written
    out = Path(args.out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    ok = True
    with zygote.warm():  # kernels forked ready from one process that imported torch and transformers once
        for path, ov, params in todo:
            ok &= _run_reported(path, ov, params, out, args, created, len(todo))
    if not args.no_page:
        print(f"index: {report.build_index(out)}")
    return 0 if ok else 1


def _run_reported(path: Path, ov: dict, params: dict, out: Path, args, created: bool, n_todo: int) -> bool:
    """`run_one`, then its line of the run's summary; False unless it passed (or measured)."""
    timeout = args.cell_timeout or (300 if params["scale"] == "smoke" else 7200)
    try:
        rec = run_one(path, ov, params, out, cell_timeout=timeout, page=not args.no_page)
    except ParamError as e:
        if n_todo == 1:
            if created and not any(out.iterdir()):
                out.rmdir()
            raise  # one sentence, exit 2
        print(f"{path.stem:<28} refused  {e}", flush=True)  # `run all` goes on with the other notebooks
        return False
    n_pass = sum(c["passed"] for c in rec["claims"])
    print(f"{rec['notebook']:<28} {rec['status']:<7} {rec['seconds']:7.1f} s  "
          f"claims {n_pass}/{len(rec['claims'])}  {out / (rec['notebook'] + '.html')}", flush=True)
    if rec.get("control"):
        c = rec["control"]
        print(f"  control {c['name']!r} (a control run: its claims should fail): {len(c['broken'])}/"
              f"{len(c['must_break'])} named claims broken" +
              (f"; NOT broken: {', '.join(c['survived'])}" if c["survived"] else ""), flush=True)
    elif rec.get("error"):
        print(f"  {rec['error'].splitlines()[0] if rec['error'] else ''}", flush=True)
    return rec["status"] in ("passed", "measured")


def cmd_sweep(args) -> int:
    from lab.core import results

    [path] = resolve([args.name], args.notebooks) if args.name != "all" else [None]
    if path is None:
        raise UsageError("sweep takes one notebook; run it once per notebook.")
    seeds, control_seeds = results.parse_seeds(args.seeds), results.parse_seeds(args.control_seeds)
    overrides = {k: parse_value(v) for k, v in args.param}
    if {"seed", "control"} & set(overrides):
        raise UsageError("sweep sets seed and control itself; give --seeds, --control-seeds or --no-controls.")
    controls = {} if args.no_controls else declared_controls(path)
    plan([path], overrides)  # bad parameters: one sentence before any run
    target = Path(args.out) if args.out else results.path_of(path.stem, path.parent)
    with zygote.warm():  # its `lab run` processes inherit it
        data = _sweep(path, seeds, control_seeds, controls, overrides, target, args)
    print(results.summary(data))
    return 0 if results.holds(data) else 1


def _sweep(path: Path, seeds: list[int], control_seeds: list[int], controls: dict, overrides: dict, target: Path,
           args) -> dict:
    from lab.core import results

    jobs = [(s, "") for s in seeds] + [(s, c) for c in controls for s in control_seeds]
    runs = results.sweep(path, jobs, overrides, n_jobs=args.jobs, cell_timeout=args.cell_timeout,
                         keep_runs=args.keep_runs)
    keep = getattr(args, "no_controls", False)
    return results.write(target, path.stem, runs, overrides, controls, keep_controls=keep)


def cmd_audit(args) -> int:
    """Each notebook's claims on seeds its results file was not fitted on, and each control on other seeds, swept
    into OUT/results/<stem>.json (the committed results files untouched); OUT/audit.md says what did not hold."""
    from lab.core import results

    paths = resolve(args.names, args.notebooks)
    seeds, control_seeds = results.parse_seeds(args.seeds), results.parse_seeds(args.control_seeds)
    plan(paths, {})
    out, datas = Path(args.out), []
    with zygote.warm():
        for path in paths:
            data = _sweep(path, seeds, control_seeds, declared_controls(path), {},
                          results.path_of(path.stem, out), args)
            print(results.summary(data), flush=True)
            datas.append(data)
    text = results.audit(datas, out)
    (out / "audit.md").write_text(f"# Audit: held-out seeds {args.seeds}, control seeds {args.control_seeds}\n\n"
                                  + text)
    print(text + f"written: {out / 'audit.md'}")
    return 0 if all(results.holds(d) for d in datas) else 1


def cmd_list(args) -> int:
    import nbformat

    for stem, path in notebooks(args.notebooks).items():
        nb = nbformat.read(str(path), as_version=4)
        rec_path = Path(args.out) / f"{stem}.json"
        last = "never run"
        if rec_path.exists():
            rec = json.loads(rec_path.read_text())
            last = f"{rec['status']} ({rec['seconds']:.0f} s)"
        print(f"{stem:<28} {last:<16} {nb.metadata.get('lab', {}).get('paper') or title_of(nb)}")
    return 0


def cmd_report(args) -> int:
    from lab import report

    out = Path(args.out)
    for executed in sorted(out.glob("*.ipynb")):
        report.ensure_static(out)
        report.export_html(executed, out / f"{executed.stem}.html")
    print(f"index: {report.build_index(out)}")
    return 0


def cmd_bench(args) -> int:
    """`bench NAME [--device D] [--seed S] [options]`: the benchmark a paper registers under NAME (its bench module
    is listed in `lab.papers`), run at smoke scale after set-up; the options after NAME are the bench's own."""
    import importlib

    from lab.core import bench
    from lab.core.session import setup
    from lab.papers import ALL

    if args.name is None:
        if args.help:
            print(args.usage)
            return 0
        raise UsageError("bench takes the NAME of a paper's bench: python -m lab bench NAME [options].")
    P = setup("smoke", args.device, args.seed, "tiny", quiet=True)
    for paper in ALL:
        if paper.bench:
            importlib.import_module(paper.bench)
    return bench.get(args.name)(P, args.options + (["--help"] if args.help else []))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab", description="Run the lab's notebooks and report them.")
    ap.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help=argparse.SUPPRESS)
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="execute notebooks into reports")
    run.add_argument("names", nargs="+", help="notebook stems or slugs, or 'all'")
    run.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    run.add_argument("--out", default="reports", help="output folder (default: reports)")
    run.add_argument("--cell-timeout", type=int, default=None,
                     help="seconds per cell (default 300 at smoke scale, 7200 at full)")
    run.add_argument("--no-page", action="store_true", help="skip the HTML pages and the index (sweeps)")
    swp = sub.add_parser("sweep", help="run a notebook over seeds and its controls -> notebooks/results/<stem>.json")
    swp.add_argument("name", help="one notebook stem or slug")
    swp.add_argument("--seeds", default="0-9", help="e.g. 0-9 or 0,3,5 (default 0-9)")
    swp.add_argument("--control-seeds", default="0",
                     help="seeds for each declared control (default 0); a claim is broken only if broken on each")
    swp.add_argument("--no-controls", action="store_true", help="seeds only (keeps the recorded controls)")
    swp.add_argument("-p", "--param", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    swp.add_argument("--jobs", type=int, default=2, help="runs at once (default 2: one per core)")
    swp.add_argument("--cell-timeout", type=int, default=None, help="seconds per cell, passed to each run")
    swp.add_argument("--out", default=None, help="results file (default notebooks/results/<stem>.json)")
    swp.add_argument("--keep-runs", action="store_true", help="keep each run's notebook and record (path printed)")
    aud = sub.add_parser("audit", help="claims on held-out seeds, controls on other seeds -> reports/audit")
    aud.add_argument("names", nargs="+", help="notebook stems or slugs, or 'all'")
    aud.add_argument("--seeds", default="10-14", help="seeds the claims were not fitted on (default 10-14)")
    aud.add_argument("--control-seeds", default="1,2", help="seeds for each control (default 1,2; recorded: 0)")
    aud.add_argument("--jobs", type=int, default=2, help="runs at once (default 2: one per core)")
    aud.add_argument("--cell-timeout", type=int, default=None, help="seconds per cell, passed to each run")
    aud.add_argument("--out", default="reports/audit", help="folder (default reports/audit)")
    aud.add_argument("--keep-runs", action="store_true", help="keep each run's notebook and record (path printed)")
    lst = sub.add_parser("list", help="notebooks, papers and last status")
    lst.add_argument("--out", default="reports")
    rep = sub.add_parser("report", help="re-render HTML and the index from executed notebooks")
    rep.add_argument("--out", default="reports")
    bench = sub.add_parser("bench", help="a paper's benchmark, printed as ratios from one run", add_help=False,
                           epilog="Options after NAME other than these are the bench's own: `bench NAME --help`.")
    bench.add_argument("name", nargs="?", help="the bench a paper registers (lab.core.bench)")
    bench.add_argument("-h", "--help", action="store_true", help="this help; after NAME, the bench's own options")
    bench.add_argument("--device", default="auto", help="auto | cpu | cuda")
    bench.add_argument("--seed", type=int, default=0)
    bench.set_defaults(usage=bench.format_help())
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "bench":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    args.options = rest
    try:
        return {"run": cmd_run, "list": cmd_list, "report": cmd_report, "bench": cmd_bench,
                "sweep": cmd_sweep, "audit": cmd_audit}[args.cmd](args)
    except (UsageError, ParamError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
