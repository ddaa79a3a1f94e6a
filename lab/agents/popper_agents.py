"""POPPER's offline agents and executors (`lab.agents.popper`, Sec. 3.1: design agent, relevance checker,
executor): what designs, judges and runs the falsification experiments of the toy studies (`lab.agents.popper_study`)
when no language model is given.

Offline agents (`Offline` backends of `lab.agents.backends`, seeded, rule-based, reading the STATE line of the
design prompt): `template` tests the hypothesis's implications one per round on fresh data (a new assay table, or
a disjoint fold of rows), cycling Spearman, Mann–Whitney (median split), Kendall and Pearson; `sloppy` proposes,
with probability `sloppy_rate`, an irrelevant test ("the gene is expressed": mean x ≠ 0) whose null is false even
when H0 holds; `judge` scores a proposal 1.0 when it tests the x–y association and 0.3 otherwise.

Executors: `Executor` runs a proposal's built-in `test` spec (`run_test`) on the rows it names, or its model-written
`code` in the sandbox (`lab.agents.sandbox`). The p-hacking ablation is an executor (`Executor(phack=m)`) that
reports the least p of m analyses.
"""

from __future__ import annotations

import json
import warnings
import zlib

import numpy as np
import pandas as pd
from scipy import stats

from lab.agents import popper as pp
from lab.agents.backends import Offline
from lab.agents.sandbox import run_python

KINDS = ("spearman", "mannwhitney", "kendall", "pearson")


# ---------------------------------------------------------------- offline agents

def _state(messages) -> dict:
    return json.loads(messages[-1]["content"].rsplit("STATE ", 1)[1])


def _template(state: dict, n_folds: int) -> dict:
    imps, i = state["implications"], len(state["tested"])
    order = np.random.default_rng(zlib.crc32(state["hypothesis"].encode())).permutation(len(imps))
    table, x, y, where = imps[order[i % len(imps)]]
    fold = None if len(imps) > 1 else i % n_folds
    kind = "spearman" if len(imps) > 1 else KINDS[i % len(KINDS)]
    part = f" (fold {fold} of {n_folds})" if fold is not None else ""
    who = f"for {where} " if where else ""
    return {"name": f"{kind}: {x} vs {y} {who}in {table}{part}", "description": f"{kind} test on unused rows",
            "h0": f"{x} and {y} are independent {who}in {table}", "h1": f"{x} and {y} are associated",
            "test": {"kind": kind, "table": table, "x": x, "y": y, "where": where, "fold": fold}}


def template_designer(n_folds: int) -> Offline:
    return Offline(lambda messages: json.dumps(_template(_state(messages), n_folds)), "template")


def sloppy_designer(n_folds: int, rate: float, seed: int) -> Offline:
    """The template agent that, with probability `rate`, proposes "the gene is expressed" (irrelevant to H)."""
    def fn(messages):
        st = _state(messages)
        rng = np.random.default_rng([seed, zlib.crc32(st["hypothesis"].encode()), st["round"]])
        if rng.random() >= rate:
            return json.dumps(_template(st, n_folds))
        table, x, _, where = st["implications"][int(rng.integers(len(st["implications"])))]
        return json.dumps({"name": f"{where or x} is expressed in {table}", "description": "one-sample t test",
                           "h0": f"mean {x} is 0", "h1": f"mean {x} is not 0",
                           "test": {"kind": "mean_shift", "table": table, "x": x, "y": "", "where": where,
                                    "fold": None}})
    return Offline(fn, "sloppy")


def _judge(messages) -> str:
    prop = json.loads(messages[-1]["content"].rsplit("PROPOSAL ", 1)[1])
    test = prop.get("test") or {}
    direct = test.get("kind") in KINDS and bool(test.get("y"))
    return json.dumps({"score": 1.0 if direct else 0.3,
                       "reason": "tests the association itself" if direct else "does not involve the outcome"})


JUDGE = Offline(_judge, "rule_judge")


# ---------------------------------------------------------------- executors

def run_test(kind: str, x: np.ndarray, y: np.ndarray) -> float:
    """Two-sided p of one built-in analysis (NaN when it cannot be computed)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "spearman":
            return float(stats.spearmanr(x, y).pvalue)
        if kind == "pearson":
            return float(stats.pearsonr(x, y).pvalue)
        if kind == "kendall":
            return float(stats.kendalltau(x, y).pvalue)
        if kind == "mannwhitney":
            hi = x > np.median(x)
            return float(stats.mannwhitneyu(y[hi], y[~hi]).pvalue) if 0 < hi.sum() < len(x) else float("nan")
        if kind == "mean_shift":
            return float(stats.ttest_1samp(x, 0.0).pvalue)
    raise ValueError(f"unknown test kind {kind!r}")


class Executor:
    """Runs a proposal: its built-in `test` spec here, or its model-written `code` in the sandbox.

    `phack=m` (an ablation) runs up to m analyses — every kind on the rows, then on each half — and reports the least
    p. Returns (p, "") or (None, the reason the round failed)."""

    def __init__(self, tables: dict[str, pd.DataFrame], n_folds: int, phack: int = 0, timeout: float = 20.0):
        self.tables, self.n_folds, self.phack, self.timeout = tables, n_folds, phack, timeout
        self._rows: dict = {}

    def __stage_key__(self):
        return (self.tables, self.n_folds, self.phack)

    def rows(self, table: str, where: str) -> np.ndarray:
        key = (table, where)
        if key not in self._rows:
            df = self.tables[table]
            self._rows[key] = np.flatnonzero(df["gene"].to_numpy() == where) if where else np.arange(len(df))
        return self._rows[key]

    def __call__(self, prop: dict) -> tuple[float | None, str]:
        test = prop.get("test")
        if isinstance(test, dict):
            try:
                df, idx = self.tables[test["table"]], self.rows(test["table"], test.get("where") or "")
                if test.get("fold") is not None:
                    idx = idx[int(test["fold"]) % self.n_folds::self.n_folds]
                x = df[test["x"]].to_numpy(float)[idx]
                y = df[test["y"]].to_numpy(float)[idx] if test.get("y") else x
            except (KeyError, TypeError, ValueError) as err:
                return None, f"the test names data that do not exist ({err})"
            if self.phack and test["kind"] in KINDS:
                halves = [slice(None), slice(None, len(x) // 2), slice(len(x) // 2, None)]
                p = min(run_test(k, x[h], y[h]) for h, k in [(h, k) for h in halves for k in KINDS][: self.phack])
            else:
                p = run_test(test["kind"], x, y)
            return pp.check_p(p)
        if isinstance(prop.get("code"), str):
            res = run_python(prop["code"], self.tables, timeout=self.timeout)
            return pp.parse_p(res.stdout) if res.ok else (None, res.error)
        return None, "the proposal has neither a runnable test nor code"

