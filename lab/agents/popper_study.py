"""POPPER's toy worlds and the studies the notebook runs (`lab.agents.popper`); the offline agents and executors
they use are `lab.agents.popper_agents`.

Worlds. (1) Real tables the installed packages ship (`lab.data.tables`); the hypotheses are the pairs
"feature x is associated with the outcome y" that are clearly non-null in the table (|Spearman| with p < 1e-3 on all
rows, the paper's DiscoveryBench protocol keeps non-null hypotheses), and their null versions are the same
hypotheses on the table with every column permuted independently (the code's `permute_selected_columns`, but with
a fresh generator per column: its seed schedule 42·2^i mod 2^31 reaches 0 at column 30 and later columns share one
permutation, `official_seeds`). (2) TinyTargetVal: genes, 25 % true regulators of a phenotype, five assay tables
(long format: gene, a measurement x, a phenotype readout y) in which a regulator's rows show y = b·x + noise with
an effect b drawn per table (30 % of tables uninformative for a given regulator); positives are the regulators'
hypotheses, negatives the same hypotheses on the column-permuted world, as in the paper's TargetVal protocol.

Studies (stage-cached): the p-value-level Monte Carlo (`mc_study`), the template agent on permuted real tables
(`real_study`, honest and p-hacking executors), TinyTargetVal with the sloppy designer and the relevance filter
(`synthetic_study`), and any LLM as designer and judge (`llm_study`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from scipy import stats

from lab.agents import popper as pp
from lab.agents.popper_agents import JUDGE, Executor, sloppy_designer, template_designer
from lab.core.stages import stage
from lab.data.tables import TABLES, load_table

ASSAYS = {"expression": ("expression", "phenotype"), "crispr": ("guide_dose", "phenotype_change"),
          "eqtl": ("allele_dosage", "trait"), "perturb_seq": ("knockdown", "marker_level"),
          "tissue": ("tissue_expression", "trait_score")}


# ---------------------------------------------------------------- worlds and permutation nulls

def official_seeds(n_columns: int) -> list[int]:
    """The official `permute_selected_columns` seed per column: 42, then seed ← 2·seed mod 2^31 (0 from column 30)."""
    seeds, s = [], 42
    for _ in range(n_columns):
        seeds.append(s)
        s = 2 * s % 2**31
    return seeds


def permute_columns(frame: pd.DataFrame, rng: np.random.Generator, *, shared: bool = False) -> pd.DataFrame:
    """Every column permuted by its own fresh permutation (a valid null: no association survives); `shared=True`
    applies ONE permutation to all columns (rows stay intact: the bug's limit, the null is not null)."""
    n = len(frame)
    one = rng.permutation(n)
    cols = {c: frame[c].to_numpy()[one if shared else rng.permutation(n)] for c in frame.columns}
    return pd.DataFrame(cols)


def schema(tables: dict[str, pd.DataFrame]) -> str:
    """What the design agent sees: each table's columns and one example row (as the official code shows)."""
    return "\n".join(f"table {name} ({len(df)} rows): columns {list(df.columns)}; example row "
                     f"{df.iloc[0].to_dict()}" for name, df in tables.items())


def real_hypotheses(n: int, seed: int) -> list[tuple[pp.Hypothesis, str]]:
    """n (hypothesis, table) draws among the clearly non-null feature–outcome pairs of the bundled tables."""
    pairs = []
    for name in TABLES:
        t = load_table(name)
        for x in t.features:
            if stats.spearmanr(t.frame[x], t.frame[t.outcome]).pvalue < 1e-3:
                pairs.append((name, x, t.outcome))
    rng = np.random.default_rng([seed, 2])
    out = []
    for i in rng.choice(len(pairs), size=n, replace=True):
        name, x, y = pairs[i]
        out.append((pp.Hypothesis(f"In {name}, {x} is associated with {y}.", ((name, x, y, ""),)), name))
    return out


def synthetic_world(cfg: pp.Config, seed: int) -> tuple[dict[str, pd.DataFrame], list[pp.Hypothesis]]:
    """TinyTargetVal: five assay tables and one hypothesis per gene ("gene g regulates the phenotype")."""
    rng = np.random.default_rng([seed, 3])
    genes = [f"G{i:04d}" for i in range(cfg.n_genes)]
    regulator = rng.random(cfg.n_genes) < cfg.frac_regulators
    tables = {}
    for t, (xc, yc) in ASSAYS.items():
        b = rng.uniform(0.4, 1.2, cfg.n_genes) * rng.choice([-1, 1], cfg.n_genes)
        b *= regulator & (rng.random(cfg.n_genes) > 0.3)
        g = np.repeat(np.arange(cfg.n_genes), cfg.rows_per_gene)
        x = rng.normal(2.0, 1.0, len(g))
        y = b[g] * (x - 2.0) + rng.standard_normal(len(g))
        tables[t] = pd.DataFrame({"gene": np.array(genes)[g], xc: x.round(4), yc: y.round(4)})
    hyps = [pp.Hypothesis(f"Gene {g} regulates the phenotype.", tuple((t, *ASSAYS[t], g) for t in ASSAYS),
                          bool(regulator[i])) for i, g in enumerate(genes)]
    return tables, hyps


# ---------------------------------------------------------------- studies (stage-cached)

@stage
def mc_study(cfg: pp.Config, seed: int) -> dict:
    """p-value-level Monte Carlo: Type-I / power of every rule under optional stopping, budgets 1..K, ablations."""
    rng = np.random.default_rng([seed, 1])
    null = pp.simulate_p(cfg.n_mc, cfg.budget, rng)
    alt = pp.simulate_p(cfg.n_mc, cfg.budget, rng, shift=cfg.mc_shift)
    out = {"type1": {r: float(pp.decide(null, r, cfg)[0].mean()) for r in pp.RULES},
           "power": {r: float(pp.decide(alt, r, cfg)[0].mean()) for r in pp.RULES},
           "mean_e": float(pp.calibrate(null[:, 0], cfg).mean()),
           "tests_used": float(pp.decide(alt, "popper", cfg)[1].mean())}
    out["budget_power"] = [float(pp.decide(alt, "popper", cfg, k)[0].mean()) for k in range(1, cfg.budget + 1)]
    phack = pp.simulate_p(cfg.n_mc // 4, cfg.budget, rng, analyses=3)
    out["phack3_type1"] = float(pp.decide(phack, "popper", cfg)[0].mean())
    red = {k: pp.simulate_p(cfg.n_mc // 4, k, rng, redundant=True) for k in (5, 10, 20)}
    out["redundant_type1"] = {k: float(pp.decide(p, "popper", cfg, k)[0].mean()) for k, p in red.items()}
    out["log_e"] = {k: np.log(pp.calibrate(P[:60], cfg)).cumsum(1) for k, P in (("null", null), ("alternative", alt))}
    return out


def _run_many(hyps, schema_text, designer, judge, execute, cfg) -> tuple[np.ndarray, list[pp.Trajectory]]:
    trajs = [pp.falsify(h, schema_text, designer, judge, execute, cfg, stop=False) for h in hyps]
    P = np.full((len(trajs), cfg.budget), np.nan)
    for i, t in enumerate(trajs):
        ps = t.p_values[: cfg.budget]
        P[i, : len(ps)] = ps
    return P, trajs


@stage
def real_study(cfg: pp.Config, seed: int) -> dict:
    """The template agent (with the relevance judge) on the column-permuted real tables, honest and (on the first
    third of the hypotheses) with the p-hacking executor."""
    rng = np.random.default_rng([seed, 4])
    honest, hacked, trajs = [], [], []
    for i, (h, name) in enumerate(real_hypotheses(cfg.n_real, seed)):
        tables = {name: permute_columns(load_table(name).frame, rng, shared=cfg.shared_permutation)}
        text = schema(tables)
        P, tr = _run_many([h], text, template_designer(cfg.n_folds), JUDGE, Executor(tables, cfg.n_folds), cfg)
        honest.append(P[0])
        trajs += tr
        if i < cfg.n_real // 3:
            hacked.append(_run_many([h], text, template_designer(cfg.n_folds), JUDGE,
                                    Executor(tables, cfg.n_folds, phack=cfg.phack), cfg)[0][0])
    return {"null": np.array(honest), "phack": np.array(hacked), "trajectories": trajs[:20]}


@stage
def synthetic_study(cfg: pp.Config, seed: int) -> dict:
    """TinyTargetVal: positives on the world, negatives (the same hypotheses) on its column-permuted copy, natural
    nulls (non-regulators), and the sloppy designer on the negatives with and without the relevance judge."""
    tables, hyps = synthetic_world(cfg, seed)
    judge = JUDGE if cfg.relevance_filter else None
    rng = np.random.default_rng([seed, 5])
    permuted = {t: permute_columns(df, rng, shared=cfg.shared_permutation) for t, df in tables.items()}
    pos = [h for h in hyps if h.truth]
    nat = [h for h in hyps if not h.truth][: len(pos)]
    ex, exn = Executor(tables, cfg.n_folds), Executor(permuted, cfg.n_folds)
    tpl, sloppy = template_designer(cfg.n_folds), sloppy_designer(cfg.n_folds, cfg.sloppy_rate, seed)
    out, trajs = {}, {}
    out["positive"], trajs["positive"] = _run_many(pos, schema(tables), tpl, judge, ex, cfg)
    out["negative"], trajs["negative"] = _run_many(pos, schema(permuted), tpl, judge, exn, cfg)
    out["natural_null"], _ = _run_many(nat, schema(tables), tpl, judge, ex, cfg)
    out["sloppy_filtered"], trajs["sloppy"] = _run_many(pos, schema(permuted), sloppy, judge, exn, cfg)
    out["sloppy_unfiltered"], _ = _run_many(pos, schema(permuted), sloppy, None, exn, cfg)
    out["trajectories"] = {k: v[:20] for k, v in trajs.items()}
    out["n_positive"] = len(pos)
    return out


def rates(P: np.ndarray, cfg: pp.Config, budget: int | None = None) -> dict[str, float]:
    """Share validated by every rule on sequences P."""
    return {r: float(pp.decide(P, r, cfg, budget)[0].mean()) for r in pp.RULES}


def study_config(cfg: pp.Config) -> pp.Config:
    """The studies record p-value sequences, which do not depend on the calibrator: keying them on a κ config lets
    the `e_is_one_over_p` control reuse the default run's cached studies (its rules re-apply `cfg`'s calibrator)."""
    import dataclasses

    return dataclasses.replace(cfg, calibrator="kappa")


def card_rows(traj: pp.Trajectory, cfg: pp.Config) -> list[dict]:
    """One row per round of a run (proposal, status, relevance, p, e, cumulative E) with `cfg`'s calibrator."""
    rows, E = [], 1.0
    for i, r in enumerate(traj.rounds):
        e = float(pp.calibrate(r.p, cfg)) if r.status == "tested" else None
        E *= e or 1.0
        rows.append({"round": i + 1, "proposal": (r.proposal or {}).get("name", "(no proposal)"), "status": r.status,
                     "relevance": r.relevance, "p": r.p, "e": e, "E": E, "note": r.error})
    return rows


def llm_study(backend, cfg: pp.Config, seed: int) -> list[dict]:
    """A real model (any backend) as designer AND judge, its code run in the sandbox, on a few hypotheses of each
    world — each on its data and on the column-permuted copy. Measured, never asserted; failures are recorded."""
    import dataclasses

    cfg = dataclasses.replace(cfg, max_failed=cfg.llm_max_failed)
    rng = np.random.default_rng([seed, 6])
    world, hyps = synthetic_world(cfg, seed)
    cases = [(h, {name: load_table(name).frame}) for h, name in real_hypotheses(cfg.llm_hypotheses, seed)]
    cases += [(h, world) for h in [h for h in hyps if h.truth][: cfg.llm_hypotheses]]
    out = []
    for h, tables in cases:
        permuted = {t: permute_columns(df, rng) for t, df in tables.items()}
        for data, tabs in (("original", tables), ("permuted", permuted)):
            tr = pp.falsify(h, schema(tabs), backend, backend, Executor(tabs, cfg.n_folds, timeout=cfg.timeout), cfg)
            out.append({"hypothesis": h.text, "data": data, "validated": tr.validated, "E": tr.E,
                        "tested": len(tr.p_values), "failed": sum(r.status != "tested" for r in tr.rounds),
                        "errors": [r.error for r in tr.rounds if r.error][:3], "trajectory": tr})
    return out


def backend_for(spec: str, cfg: pp.Config, seed: int, device: str = "cpu"):
    """The notebook's agent: "template" (offline), "openai[:<model>]" or a causal LM folder / hub id; a spec no
    backend can serve is one ParamError sentence."""
    from lab.agents.backends import BackendError, from_spec
    from lab.core.params import ParamError

    offline = {"template": template_designer(cfg.n_folds)}
    try:
        return from_spec(spec, offline, device=device)
    except BackendError as err:
        raise ParamError(str(err)) from err
