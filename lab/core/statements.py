"""Numbers a notebook's text states about its own measurements, checked against its recorded sweep.

A markdown cell states a range and says, in an HTML comment right after it (invisible once rendered), what it is:

    HQQ INT3 comes to 0.57–0.75× <!-- seeds: {quant|INT3|err} / {floe_quality|FloE|err} --> FloE's error

`seeds:` means every method seed of `notebooks/results/<stem>.json`; `seeds 0-2:` some of them; `control NAME:` the
seeds that control was recorded on. `{a|b|c}` is a path into one run's claim values (`{claim name}`) or its
recorded metrics (`lab.core.record`); around the paths, arithmetic (+ − * / **, abs, min, max, numbers). The number
or range just before the comment (a unit such as ×, % or "nats" may follow it) must be what the sweep recorded, at
the precision it is written in: a range's ends may be rounded or rounded outwards by one unit of their last digit,
never inwards and never looser; a single number must be every run's value, rounded. `count seeds: {a} > {b}` states
how many of the runs meet a comparison ("ahead on 9 <!-- count seeds: {a} > {b} --> of 10 seeds"), exactly.
`python -m lab statements NAME` lists them; `tests/core/test_statements.py` fails when one is wrong, names a path
the sweep did not record, or has no number before it.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from dataclasses import dataclass
from pathlib import Path

from lab.core import results
from lab.core.records import fmt

NUM = r"[−+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 98,624 reads as 98624
COMMENT = re.compile(r"<!--\s*((?:count\s+)?(?:seeds(?:\s+[\d,\s-]+?)?|control\s+[\w-]+))\s*:\s*(.+?)\s*-->", re.S)
STATED = re.compile(rf"(?P<lo>{NUM})(?:\s*(?:–|—|-|to)\s*(?P<hi>{NUM}))?(?P<unit>[^\d<>|]{{0,8}})$")
PATH = re.compile(r"\{([^{}]+)\}")
CODE = re.compile(r"`[^`\n]*`")
_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow}
_FUN = {"abs": abs, "min": min, "max": max}
_CMP = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge}


class StatementError(ValueError):
    """A statement that cannot be checked: no number before it, a bad expression, a path the sweep did not record."""


@dataclass(frozen=True)
class Statement:
    cell: int
    stated: str   # as written, e.g. "0.57–0.75×"
    lo: float
    hi: float
    digits: tuple[int, int]  # decimals written for lo and hi
    scope: str    # "seeds", "seeds 0-2" or "control NAME", each perhaps after "count "
    expr: str
    single: bool  # one number (every run's value), not a range

    def __str__(self) -> str:
        return f"cell {self.cell}: {' '.join(self.stated.split())} <!-- {self.scope}: {self.expr} -->"


def _num(text: str) -> tuple[float, int]:
    text = text.replace("−", "-").replace(",", "")
    return float(text), len(text.partition(".")[2])


def find(notebook: Path) -> list[Statement]:
    """Every annotated number in the notebook's markdown cells, in order."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    out = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        src = CODE.sub(lambda c: " " * len(c[0]), "".join(cell["source"]))  # a note shown as `code` is an example
        for m in COMMENT.finditer(src):
            before = src[:m.start()].rstrip()
            s = STATED.search(before)
            if s is None:
                raise StatementError(f"{Path(notebook).stem} cell {i}: no number right before {m.group(0)}")
            lo, dlo = _num(s["lo"])
            hi, dhi = _num(s["hi"]) if s["hi"] else (lo, dlo)
            scope, expr = (" ".join(g.split()) for g in m.groups())
            out.append(Statement(i, s.group(0).strip(), lo, hi, (dlo, dhi), scope, expr, not s["hi"]))
    return out


def _eval(node: ast.AST, env: dict[str, float]) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return float(node.value)
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](_eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand, env)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _CMP:  # `count` notes
        return float(_CMP[type(node.ops[0])](_eval(node.left, env), _eval(node.comparators[0], env)))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUN and not node.keywords:
        return float(_FUN[node.func.id](*(_eval(a, env) for a in node.args)))
    raise StatementError(f"not arithmetic on recorded values: {ast.unparse(node)!r}")


def _lookup(run: dict, path: str) -> float:
    if path.strip() in run.get("values", {}):  # a claim's name, even one with "|" in it
        value = run["values"][path.strip()]
    else:
        value, parts, i = run.get("metrics", {}), path.split("|"), 0
        while i < len(parts):
            p = parts[i].strip()
            if isinstance(value, list) and p.lstrip("-").isdigit() and -len(value) <= int(p) < len(value):
                value, i = value[int(p)], i + 1
                continue
            # the longest key that matches from here: a recorded key may hold "|" itself ("inputs | outputs")
            j = next((j for j in range(len(parts), i, -1) if isinstance(value, dict)
                      and "|".join(parts[i:j]).strip() in value), None)
            if j is None:
                raise StatementError(f"{{{path}}} is not recorded (no {p!r})")
            value, i = value["|".join(parts[i:j]).strip()], j
    if not isinstance(value, (int, float)):  # a flag counts as 0 or 1
        raise StatementError(f"{{{path}}} is not a number: {fmt(value)}")
    return float(value)


def evaluate(expr: str, run: dict) -> float:
    """`expr` on one run's record (its `values` and `metrics`)."""
    names: dict[str, str] = {}
    code = PATH.sub(lambda m: names.setdefault(m[1], f"_v{len(names)}"), expr)
    try:
        tree = ast.parse(code.replace("−", "-").replace("×", "*"), mode="eval")
    except SyntaxError:
        raise StatementError(f"cannot read {expr!r} as arithmetic on {{paths}}") from None
    return _eval(tree, {v: _lookup(run, p) for p, v in names.items()})


def runs_of(scope: str, data: dict) -> dict[str, dict]:
    """The run records a statement's scope names, by seed."""
    scope = scope.removeprefix("count ")
    if scope.startswith("control"):
        name = scope.split(None, 1)[1]
        rec = data["controls"].get(name)
        if rec is None:
            raise StatementError(f"control {name!r} is not recorded")
        return rec.get("by_seed") or {str(rec["seed"]): rec}
    runs = {str(r["seed"]): r for r in data["runs"]}
    if scope == "seeds":
        return runs
    want = results.parse_seeds(scope.split(None, 1)[1])
    missing = [s for s in want if str(s) not in runs]
    if missing:
        raise StatementError(f"seeds {missing} are not recorded")
    return {str(s): runs[str(s)] for s in want}


def judge(st: Statement, data: dict) -> tuple[float, float, str | None]:
    """(recorded min, recorded max, why the statement is wrong or None)."""
    vals = [evaluate(st.expr, r) for r in runs_of(st.scope, data).values()]
    if st.scope.startswith("count "):  # how many runs meet a comparison: "ahead on 9 <!-- count seeds: {a} > {b} -->"
        if not st.single or st.digits[0] or not all(v in (0.0, 1.0) for v in vals):
            raise StatementError(f"a count states one whole number of runs where {st.expr!r} holds")
        n = int(sum(vals))
        return n, n, None if n == st.lo else f"states {st.stated}, the sweep has {n} of {len(vals)} runs"
    if not vals or not all(math.isfinite(v) for v in vals):
        raise StatementError(f"{st.expr!r} recorded {vals}")
    lo, hi = min(vals), max(vals)
    ulo, uhi = 10.0 ** -st.digits[0], 10.0 ** -st.digits[1]
    eps = 1e-9 * max(1.0, abs(lo), abs(hi))
    if st.single:
        ok = max(abs(lo - st.lo), abs(hi - st.lo)) <= ulo / 2 + eps
    else:
        ok = (lo - ulo - eps <= st.lo <= lo + ulo / 2 + eps) and (hi - uhi / 2 - eps <= st.hi <= hi + uhi + eps)
    why = None if ok else f"states {st.stated}, the sweep recorded {fmt(lo)}–{fmt(hi)} over {len(vals)} run(s)"
    return lo, hi, why


def check(stem: str, notebook: Path, folder: Path | None = None, data: dict | None = None) -> list[dict]:
    """Each statement of the notebook with what its sweep recorded (`folder`'s results file, or `data`):
    {statement, recorded, problem}."""
    data = data if data is not None else results.load(stem, folder)
    out = []
    for st in find(notebook):
        try:
            if data is None:
                raise StatementError(f"no results file for {stem}")
            lo, hi, why = judge(st, data)
            rec = f"{fmt(lo)}–{fmt(hi)}" if lo != hi else fmt(lo)
        except StatementError as e:
            rec, why = "", str(e)
        out.append({"statement": st, "recorded": rec, "problem": why})
    return out
