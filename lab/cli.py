"""`python -m lab run|list|params|report|sweep|audit|statements|bench` — the runner users, tests and CI share.

    python -m lab run 00_tour                    # one notebook (stem, or slug: `tour`)
    python -m lab run all -p seed 3 --out /tmp/r  # every notebook, a parameter override, another folder
    python -m lab list                           # notebooks, their papers, last recorded status
    python -m lab params olica                   # a notebook's parameters (default, limits, meaning), controls
    python -m lab report                         # re-render HTML + index from executed notebooks
    python -m lab sweep hps --seeds 0-9          # seeds and declared controls -> notebooks/results/11_hps.json
    python -m lab audit all                      # claims on seeds 10-14, controls on seeds 1-2 -> reports/audit
    python -m lab statements all                 # numbers the notebooks' text states, against their sweeps
    python -m lab bench NAME [options]           # a paper's benchmark (registered in lab.core.bench)

`run` validates every parameter before any kernel starts (the contract's and the paper's knobs, against their types
and `lab.papers.LIMITS`; a bad value is one sentence on stderr, exit 2, nothing written), then for each notebook:
papermill (kernel `python3`, cwd = the notebook's folder, a per-cell timeout) into `DIR/<stem>.ipynb`, the run
record `DIR/<stem>.json` (params, seconds, status, claims, metrics), the offline page `DIR/<stem>.html`, and finally
`DIR/index.html`. Exit 0 only if every notebook ran and every claim passed. A failed notebook keeps its executed
copy (papermill marks the failing cell) and its record says `failed` (a claim did not hold) or `error`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lab.core import zygote
from lab.core.params import ParamError
from lab.core.runner import (
    UsageError,
    declared_controls,
    notebooks,
    parse_value,
    plan,
    resolve,
    run_one,
    title_of,
    unused_on_tiny,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def cmd_run(args) -> int:
    from lab import report

    overrides = {k: parse_value(v) for k, v in args.param}
    todo = plan(resolve(args.names, args.notebooks), overrides)  # raises before anything is written
    for path, ov, params in todo:
        if unused := unused_on_tiny(path, ov, params):
            print(f"note: {path.stem}: {', '.join(unused)} serve(s) the checkpoint path only; model='tiny' ignores "
                  "them.", file=sys.stderr)
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
    before = json.loads(target.read_text()).get("machine") if target.exists() else None
    with zygote.warm():  # its `lab run` processes inherit it
        data = _sweep(path, seeds, control_seeds, controls, overrides, target, args)
    print(results.summary(data))
    _stated(path, data, before)
    return 0 if results.holds(data) else 1


def _machine(m: dict | None) -> str:
    return f"{m['cpu']} ({m['cpu_capability']}, torch {m['torch']})" if m else "a machine it does not name"


def _stated(path: Path, data: dict, before: dict | None = None) -> None:
    """After a sweep: the numbers the notebook's text states that this sweep no longer supports (and, when the
    results file it replaced ran elsewhere, that another CPU moves numbers by itself)."""
    from lab.core import statements

    try:
        found = statements.check(path.stem, path, data=data)
    except statements.StatementError as e:
        print(f"  stated numbers: {e}")
        return
    bad = [f for f in found if f["problem"]]
    print(f"  stated numbers: {len(found) - len(bad)}/{len(found)} match this sweep" + (
        "; update the text (`python -m lab statements " + path.stem + "`):" if bad else ""))
    for f in bad:
        print(f"    {f['statement']}: {f['problem']}")
    if bad and before != data.get("machine"):
        print(f"  the results file this sweep replaced ran on {_machine(before)}, this one on "
              f"{_machine(data.get('machine'))}: another CPU alone can move these numbers")


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


def cmd_statements(args) -> int:
    """`statements NAMES`: every number a notebook's text states with a `<!-- seeds: ... -->` note, beside what its
    results file recorded (`lab.core.statements`); exit 1 when one is wrong or cannot be checked."""
    from lab.core import statements

    bad = 0
    for path in resolve(args.names, args.notebooks):
        try:
            found = statements.check(path.stem, path, args.results)
        except statements.StatementError as e:
            found, bad = [], bad + 1
            print(f"{path.stem}: {e}")
        print(f"{path.stem}: {len(found)} stated number(s)")
        for f in found:
            bad += bool(f["problem"])
            mark = "ok   " if not f["problem"] else "WRONG"
            print(f"  {mark} {f['statement']}  recorded {f['recorded'] or '-'}"
                  + (f"\n        {f['problem']}" if f["problem"] else ""))
    return 1 if bad else 0


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


def cmd_params(args) -> int:
    """`params NAME`: what `-p` takes for one notebook — each parameter's default, the limits that read it
    (`lab.papers.LIMITS`) and its comment from the parameters cell — and the controls with the claims each breaks."""
    import papermill as pm

    from lab.core.params import limit_names
    from lab.core.runner import limits_of

    [path] = resolve([args.name], args.notebooks) if args.name != "all" else [None]
    if path is None:
        raise UsageError("params takes one notebook.")
    limits = limits_of(path.stem)
    print(f"{path.stem}: python -m lab run {path.stem} -p NAME VALUE ...")
    for name, p in pm.inspect_notebook(str(path)).items():
        within = "; ".join(lim for lim in limits if name in limit_names(lim))
        print(f"  {name} = {p['default']}" + (f"  [{within}]" if within else "") + f"\n      {p['help']}")
    for control, claims in declared_controls(path).items():
        print(f"  control {control!r} must break: " + "; ".join(claims))
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
    stm = sub.add_parser("statements", help="numbers the notebooks' text states, checked against their sweeps")
    stm.add_argument("names", nargs="+", help="notebook stems or slugs, or 'all'")
    stm.add_argument("--results", type=Path, default=None,
                     help="a folder whose results/<stem>.json to check against (default the committed ones)")
    lst = sub.add_parser("list", help="notebooks, papers and last status")
    lst.add_argument("--out", default="reports")
    prm = sub.add_parser("params", help="a notebook's parameters: defaults, limits, meaning; its controls")
    prm.add_argument("name", help="one notebook stem or slug")
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
        return {"run": cmd_run, "list": cmd_list, "params": cmd_params, "report": cmd_report, "bench": cmd_bench,
                "sweep": cmd_sweep, "audit": cmd_audit, "statements": cmd_statements}[args.cmd](args)
    except (UsageError, ParamError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
