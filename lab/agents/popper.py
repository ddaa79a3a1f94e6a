"""POPPER (Huang, Jin, Li et al., ICML 2025): hypothesis validation by agentic sequential falsification.

arXiv 2502.09858, official code `snap-stanford/POPPER` (`popper/agent.py`, `popper/prompt_utils.py`,
`popper/utils.py`). A free-form main hypothesis H (null H0) is tested through falsification experiments: at round
i a design agent proposes a measurable implication h_i (a sub-null h0_i that must hold when H0 holds, Sec. 3.1,
assumption A1), a relevance checker scores it (rubric 0.1–1, kept when ≥ 0.8), an executor runs it on data and
returns one p-value p_i, which is calibrated into an e-value (Vovk & Wang 2021):

    κ calibrator      e_i = κ · p_i^(κ−1)                (the code's `e_value_kappa_calibrator`, κ = 0.5)
    integral calib.   e_i = (1 − p + p ln p) / (p (ln p)²)  (`e_value_integral_calibrator`; limit 1/2 at p = 1)

and multiplied, E_i = ∏_{s≤i} e_s. H is *validated* as soon as E_i > 1/α (the code's strict `>`); when the budget is
spent it is "not validated" (never "falsified"). Theorem 4: under A1, A2 (each p valid given everything seen
before: E[e_i | D_{i−1}] ≤ 1) and A3 (stopping is a stopping time), P_H0(validate) ≤ α by Ville's inequality.

Baselines (paper Table 3, rules as the official code applies them): sequential Fisher (`fishers_method`: the
combined p of X = −2 Σ ln p_s ~ χ²_{2k} re-tested after every round — peeking), the LLM likelihood ratio
(`likelihood_ratio_e_value`: validate when ∏ LR_s > 1/α; here a stand-in, see `lr_standin`) and the naive
"any p < α". Known bugs of the official code avoided here: the integral calibrator returns NaN at p = 1 (here its
limit 1/2); a p-value of exactly 0 or > 1 is a failed test with its reason, never a NaN product; the NoReleCheck
branch (`relevance_checker=False`) crashes on a missing design log there — here the relevance judge is optional
(`judge=None`). The null data are built by column-wise permutation with a fresh generator per column
(`lab.agents.popper_study.permute_columns`), not the code's `permute_selected_columns` seed schedule.

The prompts (`DESIGN_PROMPT`, `RELEVANCE_PROMPT`, used only when a real LLM plays the agents) are this lab's short
forms, not the official `prompt_utils.py` texts: the relevance rubric here defines 1.0 by assumption A1 and reads the
whole proposal (code included), where the official rubric anchors six levels on evidence strength, mechanistic link
and predictive value and reads the proposal's name, description and null/alternative; the designer's STATE line
names the hypothesis's implications (what the template agent reads) and omits the earlier p-values the official
designer sees. A real LLM gets `llm_max_failed` = 2 failed rounds and no executor retry (official: 10 and 5).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np
from scipy import stats

from lab.agents.backends import BackendError, complete_json
from lab.core import params

CONTROLS = {
    "e_is_one_over_p": "a wrong calibrator: e = 1/p (not an e-value: E[1/p] = ∞ under the null)",
    "shared_permutation_seed": "the null tables permute every column with ONE permutation (rows stay intact), the "
                               "official code's seed bug taken to its limit: the null is not null",
    "no_relevance_filter": "the relevance judge removed: every test the designer proposes is run and counted",
}
RULES = ("popper", "popper_integral", "fisher", "llm_lr", "naive")
DESIGN_KEYS = ("name", "h0", "h1")


@dataclass(frozen=True)
class Config:
    """Every size and knob: the test (α, κ, budget), the agents' limits, the toy's sizes."""

    alpha: float = 0.1  # the paper's and the code's α
    kappa: float = 0.5  # the code hard-codes κ = 0.5
    budget: int = 5  # max_num_of_tests (`Popper.configure`)
    max_failed: int = 10  # max_failed_tests (`SequentialFalsificationTest.configure`)
    relevance: float = 0.8  # relevance threshold (the rubric's 0.8)
    calibrator: str = "kappa"  # "kappa" | "integral" | "one_over_p" (the e_is_one_over_p control)
    shared_permutation: bool = False  # the shared_permutation_seed control
    relevance_filter: bool = True  # False under the no_relevance_filter control (the synthetic study's judge)
    n_mc: int = 200_000  # Monte-Carlo replicates of p-value sequences
    mc_shift: float = 1.5  # one-sided z-test shift μ of the alternative sub-tests
    n_real: int = 300  # null hypotheses on permuted real tables
    n_folds: int = 5  # disjoint row folds of a real table (fresh data per round: A2)
    n_genes: int = 400  # synthetic world
    frac_regulators: float = 0.25
    rows_per_gene: int = 12  # rows per gene in each synthetic assay table
    sloppy_rate: float = 0.4  # share of irrelevant proposals of the sloppy designer
    phack: int = 8  # analyses per round the p-hacking executor minimises over
    timeout: float = 20.0  # seconds per model-written experiment (the code: time_limit minutes)
    llm_hypotheses: int = 2  # hypotheses per world a real model (agent / model parameter) validates
    llm_max_failed: int = 2  # failed rounds allowed per hypothesis for a real model

    @classmethod
    def for_scale(cls, scale: str, control: str = "", *, llm: bool = False, **overrides) -> Config:
        """Sizes for `scale`; `control` sets the wrong calibrator, the shared permutation or drops the relevance
        judge; `llm=True` (a real model drives the loop, the toy studies are skipped) keeps the Monte Carlo short."""
        if scale not in params.SCALES:
            raise ValueError(f"scale={scale!r} is unknown; use one of {', '.join(params.SCALES)}.")
        params.check_control(control, CONTROLS)
        sizes = {} if scale == "smoke" else dict(n_mc=1_000_000, n_real=1000, n_genes=1000)
        sizes |= dict(n_mc=20_000) if llm else {}
        wrong = dict(calibrator="one_over_p") if control == "e_is_one_over_p" else {}
        wrong |= dict(shared_permutation=True) if control == "shared_permutation_seed" else {}
        wrong |= dict(relevance_filter=False) if control == "no_relevance_filter" else {}
        return cls(**{**sizes, **overrides, **wrong})


# ---------------------------------------------------------------- p -> e calibration and aggregation

def kappa_e(p, kappa: float = 0.5) -> np.ndarray:
    """e = κ p^(κ−1) (Vovk & Wang's calibrator; ∫₀¹ e dp = 1)."""
    return kappa * np.asarray(p, dtype=float) ** (kappa - 1)


def integral_e(p) -> np.ndarray:
    """e = ∫₀¹ κ p^(κ−1) dκ = (1 − p + p ln p) / (p (ln p)²); its limit 1/2 at p = 1 (the code: NaN)."""
    p = np.asarray(p, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        lp = np.log(np.where(p < 1, p, 0.5))
        e = (1 - p + p * lp) / (p * lp**2)
    return np.where(p < 1 - 1e-9, e, 0.5)


def calibrate(p, cfg: Config) -> np.ndarray:
    """The configured p -> e map; `one_over_p` is the known-wrong one (a control)."""
    if cfg.calibrator == "kappa":
        return kappa_e(p, cfg.kappa)
    if cfg.calibrator == "integral":
        return integral_e(p)
    if cfg.calibrator == "one_over_p":
        return 1 / np.asarray(p, dtype=float)
    raise ValueError(f"calibrator={cfg.calibrator!r} is unknown; use 'kappa', 'integral' or 'one_over_p'.")


def lr_standin(p) -> np.ndarray:
    """Stand-in for the LLM-estimated likelihood ratio: the LR of a one-sided z-test at the effect that best explains
    the result, exp(max(z, 0)² / 2), z = Φ⁻¹(1 − p) — a ratio chosen after seeing the data, as a model judging
    "how likely is this result under h1" does; not an e-value (its null mean is infinite)."""
    z = np.maximum(stats.norm.isf(np.asarray(p, dtype=float)), 0)
    return np.exp(z**2 / 2)


def decide(P, rule: str, cfg: Config, budget: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Apply a stopping rule to p-value sequences P (n × K, NaN = no test) under optional stopping.

    Returns (validated, rounds used). `popper` uses `cfg`'s calibrator (κ by default), `popper_integral` the
    integral one; both validate at the first prefix with E > 1/α. `fisher` re-tests the combined p after every
    round (the code's `Fisher` switch), `llm_lr` multiplies `lr_standin`, `naive` validates on any p < α.
    """
    P = np.atleast_2d(np.asarray(P, dtype=float))[:, : budget or cfg.budget]
    ok = np.isfinite(P)
    q = np.where(ok, P, 0.5)
    if rule in ("popper", "popper_integral", "llm_lr"):
        e = (calibrate(q, cfg) if rule == "popper" else integral_e(q) if rule == "popper_integral"
             else lr_standin(q))
        hit = np.cumsum(np.where(ok, np.log(e), 0.0), axis=1) > math.log(1 / cfg.alpha)
    elif rule == "fisher":
        k = np.cumsum(ok, axis=1)
        x = np.cumsum(np.where(ok, -2 * np.log(q), 0.0), axis=1)
        hit = (k > 0) & (stats.chi2.sf(x, 2 * np.maximum(k, 1)) < cfg.alpha)
    elif rule == "naive":
        hit = ok & (q < cfg.alpha)
    else:
        raise ValueError(f"rule={rule!r} is unknown; use one of {', '.join(RULES)}.")
    hit &= ok
    validated = hit.any(axis=1)
    used = np.where(validated, hit.argmax(axis=1) + 1, ok.sum(axis=1))
    return validated, used


def simulate_p(n: int, K: int, rng: np.random.Generator, *, shift: float = 0.0, analyses: int = 1,
               redundant: bool = False) -> np.ndarray:
    """n sequences of K one-sided z-test p-values, p = Φ̄(Z + shift): uniform under the null (shift 0); `analyses`
    m > 1 reports the least of m independent analyses per round (p-hacking); `redundant` repeats round 1."""
    z = rng.standard_normal((n, 1 if redundant else K, analyses)) + shift
    p = stats.norm.sf(z).min(axis=2)
    return np.repeat(p, K, axis=1) if redundant else p


# ---------------------------------------------------------------- the agent loop

@dataclass(frozen=True)
class Hypothesis:
    """A main hypothesis: its text, and (for the offline agents) the implications they may test."""

    text: str
    implications: tuple  # ((table, x, y, where), ...): x~y association among rows `where` (gene name or "")
    truth: bool | None = None  # ground truth when the world knows it


@dataclass
class Round:
    proposal: dict | None
    status: str  # "tested" | "irrelevant" | "failed"
    relevance: float | None = None
    p: float | None = None
    e: float | None = None
    E: float = 1.0
    error: str = ""


@dataclass
class Trajectory:
    hypothesis: Hypothesis
    rounds: list[Round] = field(default_factory=list)
    alpha: float = 0.1

    @property
    def p_values(self) -> list[float]:
        return [r.p for r in self.rounds if r.status == "tested"]

    @property
    def E(self) -> float:
        return self.rounds[-1].E if self.rounds else 1.0

    @property
    def validated(self) -> bool:
        """The e-value decision of record (`agent.res` in the code): some E_i > 1/α."""
        return any(r.status == "tested" and r.E > 1 / self.alpha for r in self.rounds)


DESIGN_PROMPT = (
    "You design falsification experiments for a main hypothesis. Propose ONE experiment that tests a measurable "
    "implication of the main hypothesis on the data below: its null sub-hypothesis h0 must be true whenever the "
    "main hypothesis is false (self-critique: if the main hypothesis is null, is this test also null?). Do not "
    "repeat earlier experiments; use data not used before. Answer with one JSON object with keys name, description, "
    "h0, h1 and code: Python that reads the pandas DataFrames in the dict `tables` and prints 'p-value: <number>'.")
RELEVANCE_PROMPT = (
    "Score how relevant the proposed falsification experiment is to the main hypothesis, from 0.1 (unrelated) to "
    "1.0 (a direct implication: if the main hypothesis is false, the experiment's null holds). Answer with one JSON "
    "object with keys score and reason.")


def design_messages(h: Hypothesis, schema: str, rounds: list[Round]) -> list[dict]:
    done = [r.proposal.get("name", "") for r in rounds if r.proposal and r.status == "tested"]
    bad = [f"{r.proposal.get('name', '') if r.proposal else '?'} ({r.status}: {r.error})"
           for r in rounds if r.status != "tested"]
    state = {"hypothesis": h.text, "implications": h.implications, "round": len(rounds), "tested": done}
    user = (f"Main hypothesis: {h.text}\n\nData:\n{schema}\n\nExperiments done: {done or 'none'}\n"
            f"Failed or rejected: {bad or 'none'}\n\nSTATE {json.dumps(state)}")
    return [{"role": "system", "content": DESIGN_PROMPT}, {"role": "user", "content": user}]


def relevance_messages(h: Hypothesis, proposal: dict) -> list[dict]:
    user = f"Main hypothesis: {h.text}\n\nPROPOSAL {json.dumps(proposal)}"
    return [{"role": "system", "content": RELEVANCE_PROMPT}, {"role": "user", "content": user}]


_P = re.compile(r"p[\s_-]*(?:value)?\s*[:=]\s*([-+0-9.eE]+|nan)", re.IGNORECASE)


def parse_p(text: str) -> tuple[float | None, str]:
    """The last 'p-value: x' in an executor's output, checked: (p, "") or (None, why it is not a p-value)."""
    found = _P.findall(text or "")
    if not found:
        return None, "the experiment printed no 'p-value: <number>'"
    try:
        p = float(found[-1])
    except ValueError:
        return None, f"{found[-1]!r} is not a number"
    return check_p(p)


def check_p(p: float) -> tuple[float | None, str]:
    if not math.isfinite(p):
        return None, "the p-value is NaN"
    if p <= 0:
        return None, "p = 0 exactly is treated as an execution bug (as in the official code)"
    if p > 1:
        return None, f"p = {p:g} > 1 is not a p-value"
    return p, ""


def _why(err: Exception) -> str:
    return str(err) if isinstance(err, BackendError) else f"{type(err).__name__}: {err}"[:300]


def falsify(h: Hypothesis, schema: str, designer, judge, execute, cfg: Config, *, stop: bool = True) -> Trajectory:
    """Algorithm 1: propose → relevance → execute → p → e → E, until E > 1/α or the budget is spent.

    `designer` and `judge` are backends (`lab.agents.backends`; `judge=None` is the NoReleCheck ablation),
    `execute(proposal) -> (p, error)`. Tests and failed rounds are budgeted separately, as in the official code
    (the paper's Algorithm 1 counts all rounds). `stop=False` runs the whole budget (for studies that apply
    several stopping rules to the same sequence; with a designer that does not read past p-values this is the
    same sequence the stopped loop sees). Backend and executor failures are recorded rounds, never exceptions.
    """
    traj, E, tested, failed = Trajectory(h, alpha=cfg.alpha), 1.0, 0, 0
    while tested < cfg.budget and failed < cfg.max_failed:
        try:
            prop = complete_json(designer, design_messages(h, schema, traj.rounds), DESIGN_KEYS)
        except Exception as err:  # a backend that cannot answer (BackendError, a model error) is a failed round
            traj.rounds.append(Round(None, "failed", E=E, error=_why(err)))
            failed += 1
            continue
        score = None
        if judge is not None:
            try:
                score = float(complete_json(judge, relevance_messages(h, prop), ("score",))["score"])
            except Exception as err:  # no JSON, a non-numeric score, an unreachable endpoint
                traj.rounds.append(Round(prop, "failed", E=E, error=f"relevance: {_why(err)}"))
                failed += 1
                continue
            if score < cfg.relevance:
                traj.rounds.append(Round(prop, "irrelevant", score, E=E, error=f"relevance {score:.2f}"))
                failed += 1
                continue
        p, err = execute(prop)
        if p is None:
            traj.rounds.append(Round(prop, "failed", score, E=E, error=err))
            failed += 1
            continue
        e = float(calibrate(p, cfg))
        E *= e
        tested += 1
        traj.rounds.append(Round(prop, "tested", score, p, e, E))
        if stop and E > 1 / cfg.alpha:
            break
    return traj
