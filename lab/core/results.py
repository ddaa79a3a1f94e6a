"""Results from data: seed sweeps recorded in `notebooks/results/<stem>.json`, and the tables drawn from them.

`python -m lab sweep <notebook> --seeds 0-9` runs the notebook once per seed and once per declared
control (seed 0 by default), each in its own `python -m lab run` subprocess, and writes one file:

    {"notebook", "date", "commit", "machine" (CPU, torch's CPU capability, versions), "params" (overrides), "seeds",
     "claims": {name: {"op", "threshold"}},                      # as the notebook states them now
     "runs": [{"seed", "status", "seconds", "values": {name: value}, "passed": {name: bool}, "metrics": {...}}],
     "controls": {name: {"seed", "status", "must_break", "broken", "survived", "values", "metrics"}}}

`metrics` keeps every `record(...)` of the run (floats to 6 significant digits), so a number the notebook's text
states about its measurements can be checked against the sweep (`lab.core.statements`), not only its claims.

The numbers are the machine's: the same commit on another CPU can move them (`machine`), so a file says where it ran.

The notebook's Results section shows `seed_table(stem)`, never a table typed by hand; `problems`
is what the hygiene test asserts on (a missing or stale file, a threshold not met on a recorded seed).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from lab.core.records import OPS, fmt

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "notebooks" / "results"


def parse_seeds(text: str) -> list[int]:
    """`0-9`, `0,3,5` or `0-4,7` -> a sorted list of seeds."""
    seeds: set[int] = set()
    try:
        for part in str(text).split(","):
            lo, _, hi = part.strip().partition("-")
            seeds.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"seeds {text!r} are not a list like 0-9 or 0,3,5.") from None
    if not seeds or min(seeds) < 0:
        raise ValueError(f"seeds {text!r} name no non-negative seed.")
    return sorted(seeds)


def path_of(stem: str, folder: Path | None = None) -> Path:
    return (Path(folder) / "results" if folder else RESULTS) / f"{stem}.json"


def _git(*a: str) -> str:
    return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout


def _commit() -> str:
    sha = _git("rev-parse", "--short", "HEAD").strip() or "unknown"
    return sha + ("-dirty" if _dirty() else "")


def _dirty() -> list[str]:
    """Tracked files that differ from the commit the sweep names (what "-dirty" hides), other than results files
    (sweeps write them; no run reads them but to draw its table)."""
    return sorted(f for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()
                  if not (f := line[3:]).startswith("notebooks/results/"))


def machine() -> dict:
    """What a sweep ran on. One machine gives the same numbers every time (DESIGN.md, Determinism); another CPU need
    not: its float kernels (torch picks them by the vector instructions it finds, `cpu_capability`) round
    differently, and tiny models trained from scratch carry the difference into every later number."""
    import os
    import platform

    import numpy
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {"cpu": cpu, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "numpy": numpy.__version__}


def _rounded(value, digits: int = 6):
    """Recorded metrics as stored in a results file: floats to `digits` significant digits, structure kept."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


def sweep(nb: Path, jobs: list[tuple[int, str]], overrides: dict, *, n_jobs: int = 2,
          cell_timeout: int | None = None, keep_runs: bool = False) -> list[dict]:
    """Run `(seed, control)` jobs of one notebook, `n_jobs` at a time; returns their run records. Each run's folder
    (executed notebook, record of every metric) is removed afterwards unless `keep_runs` (then its path is printed)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"lab-sweep-{nb.stem}-"))

    def one(job: tuple[int, str]) -> dict:
        seed, control = job
        out = tmp / f"{control or 'method'}-{seed}"
        args = [sys.executable, "-m", "lab", "--notebooks", str(nb.parent), "run", nb.stem, "--out", str(out),
                "--no-page", "-p", "seed", str(seed)] + (["-p", "control", control] if control else [])
        for k, v in overrides.items():
            args += ["-p", k, str(v)]
        if cell_timeout:
            args += ["--cell-timeout", str(cell_timeout)]
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        rec_path = out / f"{nb.stem}.json"
        if not rec_path.exists():
            return {"params": {"seed": seed, "control": control}, "status": "error", "claims": [],
                    "seconds": 0.0, "error": proc.stderr.strip()[-500:]}
        rec = json.loads(rec_path.read_text())
        mark = "control" if control else "seed"
        print(f"{nb.stem} {mark} {control or seed}: {rec['status']} in {rec['seconds']:.0f} s", flush=True)
        return rec

    try:
        with ThreadPoolExecutor(max(1, n_jobs)) as pool:
            return list(pool.map(one, jobs))
    finally:
        if keep_runs:
            print(f"{nb.stem}: each run's notebook and record kept in {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def write(target: Path, stem: str, runs: list[dict], overrides: dict, controls: dict[str, list[str]], *,
          keep_controls: bool = False) -> dict:
    """Write the results file from sweep run records (and return its data)."""
    method = [r for r in runs if not r["params"].get("control")]
    claims: dict[str, dict] = {}
    for r in method:
        for c in r["claims"]:
            claims.setdefault(c["name"], {"op": c["op"], "threshold": c["threshold"]})
    data = {"notebook": stem, "date": datetime.now().astimezone().isoformat(timespec="seconds"),
            "commit": _commit(), **({"dirty": d} if (d := _dirty()) else {}), "machine": machine(), "params": overrides,
            "seeds": sorted(r["params"]["seed"] for r in method),
            "claims": claims, "runs": [], "controls": {}}
    for r in sorted(method, key=lambda r: r["params"]["seed"]):
        data["runs"].append({"seed": r["params"]["seed"], "status": r["status"], "seconds": r["seconds"],
                             "values": {c["name"]: c["value"] for c in r["claims"]},
                             "passed": {c["name"]: c["passed"] for c in r["claims"]},
                             "metrics": _rounded(r.get("metrics", {})),
                             **({"error": r["error"]} if r.get("error") else {})})
    for r in sorted((r for r in runs if r["params"].get("control")), key=lambda r: r["params"]["seed"]):
        name = r["params"]["control"]
        c = r.get("control") or {"must_break": controls.get(name, []), "broken": [],
                                 "survived": controls.get(name, [])}
        one = {"seed": r["params"]["seed"], "status": r["status"], "must_break": c["must_break"],
               "broken": c["broken"], "survived": c["survived"], "values": {x["name"]: x["value"] for x in r["claims"]},
               "metrics": _rounded(r.get("metrics", {}))}
        rec = data["controls"].setdefault(name, one)
        if rec is not one:  # several control seeds: a claim is broken only if it is broken on every seed
            keep = ("status", "survived", "values", "metrics")
            by_seed = rec.setdefault("by_seed", {str(rec["seed"]): {k: rec[k] for k in keep}})
            by_seed[str(one["seed"])] = {k: one[k] for k in keep}
            held = {x for v in by_seed.values() for x in v["survived"]}
            rec["survived"] = [x for x in rec["must_break"] if x in held]
            rec["broken"] = [x for x in rec["must_break"] if x not in held]
    if keep_controls and target.exists():
        data["controls"] = json.loads(target.read_text()).get("controls", {})
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=1) + "\n")
    return data


def load(stem: str, folder: Path | None = None) -> dict | None:
    p = path_of(stem, folder)
    return json.loads(p.read_text()) if p.exists() else None


def holds(data: dict) -> bool:
    """Every seed ran and passed every claim, and every control broke every claim it names."""
    return (all(r["status"] == "passed" for r in data["runs"])
            and all(not c["survived"] for c in data["controls"].values()))


def problems(stem: str, claims: list[dict], controls: dict[str, list[str]], *, folder: Path | None = None,
             seeds: range = range(10)) -> list[str]:
    """Why the recorded sweep no longer supports the notebook's claims (empty when it does).

    `claims` are the claim records of a fresh run (name, op, threshold); `controls` the declared ones.
    """
    data = load(stem, folder)
    if data is None:
        return [f"no results file {path_of(stem, folder)}; run `python -m lab sweep {stem}`"]
    out = []
    now = {c["name"]: c for c in claims}
    if set(now) != set(data["claims"]):
        out.append(f"claims changed since the sweep: new {sorted(set(now) - set(data['claims']))}, "
                   f"gone {sorted(set(data['claims']) - set(now))}")
    missing = sorted(set(seeds) - set(data["seeds"]))
    if missing:
        out.append(f"seeds {missing} not recorded")
    for r in data["runs"]:
        if r["status"] != "passed" and not set(r["values"]) >= set(now):
            out.append(f"seed {r['seed']}: {r['status']} {r.get('error', '')}".strip())
        for name, c in now.items():
            v = r["values"].get(name)
            if v is not None and not (isinstance(v, (int, float)) and OPS[c["op"]](v, c["threshold"])):
                out.append(f"seed {r['seed']}: {name} = {fmt(v)} does not meet {c['op']} {c['threshold']}")
    for name, must in controls.items():
        rec = data["controls"].get(name)
        if rec is None:
            out.append(f"control {name!r} not recorded")
            continue
        runs = rec.get("by_seed") or {str(rec["seed"]): rec}
        for claim in must:
            c = now.get(claim)
            if c is None:
                out.append(f"control {name!r} names {claim!r}, which the notebook does not check")
                continue
            for seed, run in runs.items():
                v = run["values"].get(claim)
                if v is not None and isinstance(v, (int, float)) and OPS[c["op"]](v, c["threshold"]):
                    at = f" on seed {seed}" if len(runs) > 1 else ""
                    out.append(f"control {name!r} does not break {claim!r}{at} (recorded {fmt(v)})")
    return out


def seed_table(stem: str, folder: Path | None = None):
    """The notebook's claims over the recorded seeds and controls, as a pandas DataFrame.

    One row per claim: the requirement, min / max over seeds, how many seeds meet it, and for each
    control the value it recorded (on its lowest seed) with ✗ where it broke the claim on every control seed
    (— where the control does not name it).
    """
    import pandas as pd

    data = load(stem, folder)
    if data is None:
        return pd.DataFrame({"note": [f"no sweep recorded: run `python -m lab sweep {stem}`"]})
    rows = {}
    for name, c in data["claims"].items():
        vals = [r["values"][name] for r in data["runs"] if isinstance(r["values"].get(name), (int, float))]
        ok = sum(OPS[c["op"]](v, c["threshold"]) for v in vals)
        row = {"required": f"{c['op']} {c['threshold']}", "min": fmt(min(vals)) if vals else "",
               "max": fmt(max(vals)) if vals else "", "seeds": f"{ok}/{len(data['runs'])}"}
        for cname, rec in data["controls"].items():
            v = rec["values"].get(name)
            cell = "—" if v is None else fmt(v)
            if name in rec["must_break"]:
                held = [k for k, v in rec.get("by_seed", {}).items() if name in v["survived"]]
                cell += " ✗" if name in rec["broken"] else f" (held on seed {', '.join(held)}!)" if held else " (held!)"
            row[f"control {cname}"] = cell
        rows[name] = row
    df = pd.DataFrame.from_dict(rows, orient="index")
    df.index.name = f"seeds {fmt(data['seeds'])} · {data['date'][:10]} · {data['commit']}"
    return df


def summary(data: dict) -> str:
    """A few lines for the terminal after a sweep."""
    lines = [f"{data['notebook']}: seeds {data['seeds']} -> {sum(r['status'] == 'passed' for r in data['runs'])}"
             f"/{len(data['runs'])} passed"]
    for r in data["runs"]:
        bad = [n for n, ok in r["passed"].items() if not ok]
        if bad or r["status"] != "passed":
            lines.append(f"  seed {r['seed']} {r['status']}: " + "; ".join(
                f"{n} = {fmt(r['values'][n])}" for n in bad) + (f" {r.get('error', '')}" if not bad else ""))
    for name, c in data["controls"].items():
        seeds = f" on seeds {', '.join(c['by_seed'])}" if "by_seed" in c else ""
        lines.append(f"  control {name}: broke {len(c['broken'])}/{len(c['must_break'])}{seeds}" +
                     (f"; held: {c['survived']}" if c["survived"] else ""))
    return "\n".join(lines)


def audit(datas: list[dict], folder: Path) -> str:
    """Markdown: for each notebook swept into `folder` (`lab audit`), the seeds and control seeds that ran, what did
    not hold (`problems` against the notebook's own claims) and its tightest claim: the smallest margin
    |value − threshold| / max(|threshold|, 1e-9) over those seeds."""
    lines = ["| notebook | seeds | runs passed | control seeds | controls broke every claim | tightest claim |",
             "|---|---|---|---|---|---|"]
    found = []
    for d in datas:
        claims = [{"name": n, **c} for n, c in d["claims"].items()]
        must = {n: c["must_break"] for n, c in d["controls"].items()}
        found += [f"- {d['notebook']}: {b}" for b in problems(d["notebook"], claims, must, folder=folder,
                                                               seeds=d["seeds"])]
        margins = [(abs(v - c["threshold"]) / max(abs(c["threshold"]), 1e-9), n, v, c) for r in d["runs"]
                   for n, v in r["values"].items() if (c := d["claims"].get(n)) and isinstance(v, (int, float))
                   and isinstance(c["threshold"], (int, float))]
        tight = "—"
        if margins:
            _, n, v, c = min(margins, key=lambda m: m[0])
            tight = f"{n} = {fmt(v)} ({c['op']} {fmt(c['threshold'])})"
        cseeds = sorted({s for c in d["controls"].values() for s in c.get("by_seed", {str(c["seed"]): None})},
                        key=int)
        passed = sum(r["status"] == "passed" for r in d["runs"])
        broke = sum(not c["survived"] for c in d["controls"].values())
        lines.append(f"| {d['notebook']} | {fmt(d['seeds'])} | {passed}/{len(d['runs'])} | {', '.join(cseeds) or '—'}"
                     f" | {broke}/{len(d['controls'])} | {tight} |")
    return "\n".join(lines + ["", "Did not hold:" if found else "Everything held.", *found]) + "\n"
