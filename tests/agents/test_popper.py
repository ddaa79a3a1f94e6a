"""POPPER: calibrators, stopping rules, the agent loop, permutation nulls, executors, sandbox, widgets, checkpoint."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import integrate, stats

from lab.agents import popper as pp
from lab.agents import popper_agents as pa
from lab.agents import popper_study as ps
from lab.agents.backends import Offline
from lab.agents.sandbox import run_python

CFG = pp.Config.for_scale("smoke")


# ---------------------------------------------------------------- calibrators and stopping rules

def test_kappa_calibrator_hand_values_and_unit_integral():
    assert pp.kappa_e(0.04) == pytest.approx(2.5)  # 0.5 / sqrt(0.04)
    assert pp.kappa_e(0.0025) * 1 == pytest.approx(10.0)  # one test alone reaches 1/α = 10 at p = (κα)^2
    assert integrate.quad(lambda p: float(pp.kappa_e(p)), 0, 1)[0] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("p", [1e-4, 0.01, 0.2, 0.5, 0.9, 0.999])
def test_integral_calibrator_is_the_mixture_over_kappa(p):
    mixture = integrate.quad(lambda k: k * p ** (k - 1), 0, 1)[0]
    assert float(pp.integral_e(p)) == pytest.approx(mixture, rel=1e-6)


def test_integral_calibrator_at_one_is_its_limit_not_nan():
    assert float(pp.integral_e(1.0)) == 0.5  # the official code returns 0/0 = NaN here
    # ∫_ε^1 e(p) dp = ∫₀¹ (1 − ε^κ) dκ = 1 + (1 − ε)/ln ε (→ 1, slowly); integrated in t = −ln p
    eps = 1e-12
    total = integrate.quad(lambda t: float(pp.integral_e(math.exp(-t))) * math.exp(-t), 0, -math.log(eps),
                           limit=200)[0]
    assert total == pytest.approx(1 + (1 - eps) / math.log(eps), abs=1e-6)


def _reference(P, rule, cfg):
    """Naive loop over rounds, independent of `decide` (scipy's combine_pvalues for Fisher)."""
    out = []
    for row in P:
        ps_, E, hit = [], 1.0, False
        for p in row:
            if not np.isfinite(p):
                continue
            ps_.append(p)
            if rule == "popper":
                E *= cfg.kappa * p ** (cfg.kappa - 1)
                hit = E > 1 / cfg.alpha
            elif rule == "fisher":
                hit = stats.combine_pvalues(ps_, method="fisher").pvalue < cfg.alpha
            elif rule == "naive":
                hit = p < cfg.alpha
            elif rule == "llm_lr":
                z = max(stats.norm.isf(p), 0)
                E *= math.exp(z * z / 2)
                hit = E > 1 / cfg.alpha
            if hit:
                break
        out.append(hit)
    return np.array(out)


@pytest.mark.parametrize("rule", ["popper", "fisher", "naive", "llm_lr"])
def test_decide_matches_a_loop_under_optional_stopping(rule):
    rng = np.random.default_rng(0)
    P = rng.beta(0.5, 1.0, (400, 5))
    P[rng.random(P.shape) < 0.2] = np.nan  # failed rounds
    assert (pp.decide(P, rule, CFG)[0] == _reference(P, rule, CFG)).all()


def test_decide_counts_rounds_and_respects_the_budget():
    P = np.array([[0.5, 0.001, 0.001, 0.9, 0.9]])
    ok, used = pp.decide(P, "popper", CFG)
    assert ok[0] and used[0] == 2  # E_1 = 0.5/√0.5 = 0.707, E_2 = 0.707 · 0.5/√0.001 = 11.2 > 10
    assert not pp.decide(P, "popper", CFG, budget=1)[0][0]


def test_monte_carlo_type1_popper_valid_fisher_and_wrong_calibrator_not():
    rng = np.random.default_rng(1)
    null = pp.simulate_p(40_000, 5, rng)
    assert stats.kstest(null[:, 0], "uniform").pvalue > 1e-3
    assert pp.decide(null, "popper", CFG)[0].mean() <= 0.1
    assert pp.decide(null, "fisher", CFG)[0].mean() > 0.15
    wrong = pp.Config.for_scale("smoke", "e_is_one_over_p")
    assert wrong.calibrator == "one_over_p" and pp.decide(null, "popper", wrong)[0].mean() > 0.5


def test_phacked_p_is_the_least_of_m():
    p = pp.simulate_p(50_000, 1, np.random.default_rng(2), analyses=3)[:, 0]
    assert stats.kstest(p, lambda x: 1 - (1 - x) ** 3).pvalue > 1e-3


# ---------------------------------------------------------------- the loop

def _designer(replies):
    it = iter(replies)
    return Offline(lambda messages: next(it), "scripted")


def _proposal(p):
    return json.dumps({"name": f"t{p}", "h0": "x", "h1": "y", "p": p})


def _exec(prop):
    return pp.check_p(float(prop["p"]))


H = pp.Hypothesis("H", (("t", "x", "y", ""),))


def test_falsify_stops_at_first_E_above_one_over_alpha():
    tr = pp.falsify(H, "", _designer([_proposal(p) for p in (0.5, 0.01, 0.01, 0.3)]), None, _exec, CFG)
    E = np.cumprod(pp.kappa_e([0.5, 0.01, 0.01]))
    assert tr.p_values == [0.5, 0.01, 0.01] and tr.E == pytest.approx(E[-1]) and tr.validated
    tr = pp.falsify(H, "", _designer([_proposal(p) for p in (0.5, 0.01, 0.01, 0.3, 0.9)]), None, _exec, CFG,
                    stop=False)
    assert len(tr.p_values) == 5 and tr.validated  # the decision of record still sees the crossing


def test_falsify_records_failures_instead_of_raising():
    replies = ["no json here"] * 3 + [_proposal(0.0)] + [_proposal(1.5)] + [_proposal(float("nan"))] + \
              [json.dumps({"name": "x"})] * 3 + [_proposal(0.2)] * 5
    cfg = pp.Config.for_scale("smoke", budget=1)
    tr = pp.falsify(H, "", _designer(replies), None, _exec, cfg)
    notes = [r.error for r in tr.rounds if r.status == "failed"]
    assert len(notes) == 5 and "no JSON" in notes[0] and "p = 0" in notes[1] and "> 1" in notes[2]
    assert "NaN" in notes[3] and "'h0'" in notes[4] and tr.p_values == [0.2]
    broken = Offline(lambda m: (_ for _ in ()).throw(RuntimeError("model exploded")), "broken")
    tr = pp.falsify(H, "", broken, None, _exec, pp.Config.for_scale("smoke", max_failed=2))
    assert [r.status for r in tr.rounds] == ["failed", "failed"] and "RuntimeError" in tr.rounds[0].error


def test_relevance_filter_discards_low_scores_and_bad_scores():
    judge = _designer([json.dumps({"score": 0.3}), json.dumps({"score": "high"}), json.dumps({"score": 0.9})])
    tr = pp.falsify(H, "", _designer([_proposal(0.5)] * 3), judge, _exec, pp.Config.for_scale("smoke", budget=1))
    assert [r.status for r in tr.rounds] == ["irrelevant", "failed", "tested"] and tr.rounds[2].relevance == 0.9


def test_unreachable_endpoint_is_a_failed_round():
    from lab.agents.backends import OpenAIHTTP

    dead = OpenAIHTTP("none", base_url="http://127.0.0.1:9/v1", timeout=2, max_retries=0)
    tr = pp.falsify(H, "", dead, None, _exec, pp.Config.for_scale("smoke", max_failed=1))
    assert tr.rounds[0].status == "failed" and "did not answer" in tr.rounds[0].error


def test_no_relevance_checker_runs_the_loop():
    """The official NoReleCheck branch (`relevance_checker=False`) crashes on a missing design log; here it runs."""
    tr = pp.falsify(H, "", _designer([_proposal(0.3)] * 5), None, _exec, CFG)
    assert [r.relevance for r in tr.rounds] == [None] * 5 and len(tr.p_values) == 5 and not tr.validated


def test_loop_through_a_real_http_server_on_localhost():
    from lab.agents.backends import OpenAIHTTP, serve

    server, url = serve(_designer([_proposal(p) for p in (0.001, 0.001)]))
    try:
        tr = pp.falsify(H, "", OpenAIHTTP("scripted", base_url=url, timeout=10), None, _exec, CFG)
    finally:
        server.shutdown()
    assert tr.p_values == [0.001] and tr.validated  # e = 0.5/√0.001 = 15.8 > 10: stops after one test


@pytest.mark.parametrize("text,p", [("p-value: 0.03", 0.03), ("p = 1e-4 then P_value=0.2", 0.2), ("p: 0", None),
                                    ("pvalue: 2", None), ("nothing", None), ("p-value: nan", None)])
def test_parse_p(text, p):
    assert pp.parse_p(text)[0] == p


# ---------------------------------------------------------------- worlds, agents, executors

def test_official_seed_schedule_reaches_zero_at_column_30():
    seeds = ps.official_seeds(32)
    assert seeds[:3] == [42, 84, 168] and seeds[29] == 42 * 2**29 % 2**31 != 0 and seeds[30:] == [0, 0]


def test_permute_columns_fresh_breaks_rows_shared_keeps_them():
    x = np.arange(500.0)
    df = pd.DataFrame({"a": x, "b": 2 * x, "c": -x})
    fresh = ps.permute_columns(df, np.random.default_rng(0))
    assert all(sorted(fresh[c]) == sorted(df[c]) for c in df)
    assert abs(stats.spearmanr(fresh["a"], fresh["b"]).statistic) < 0.2
    shared = ps.permute_columns(df, np.random.default_rng(0), shared=True)
    assert (shared["b"] == 2 * shared["a"]).all() and not (shared["a"] == df["a"]).all()


def test_template_designer_uses_fresh_folds_and_the_judge_scores():
    tables = {"t": pd.DataFrame({"x": np.arange(50.0), "y": np.arange(50.0) % 7})}
    tr = pp.falsify(pp.Hypothesis("x ~ y", (("t", "x", "y", ""),)), ps.schema(tables),
                    pa.template_designer(5), pa.JUDGE, pa.Executor(tables, 5), CFG, stop=False)
    tests = [r.proposal["test"] for r in tr.rounds]
    assert [t["fold"] for t in tests] == [0, 1, 2, 3, 4] and [t["kind"] for t in tests][:4] == list(pa.KINDS)
    assert all(r.relevance == 1.0 for r in tr.rounds)
    bad = {"name": "n", "test": {"kind": "mean_shift", "y": ""}}
    assert json.loads(pa._judge(pp.relevance_messages(tr.hypothesis, bad)))["score"] < CFG.relevance


def test_executor_matches_scipy_on_the_fold_and_phacking_is_smaller():
    rng = np.random.default_rng(3)
    df = pd.DataFrame({"gene": np.repeat(["A", "B"], 40), "x": rng.normal(size=80), "y": rng.normal(size=80)})
    ex = pa.Executor({"t": df}, 4)
    test = {"kind": "kendall", "table": "t", "x": "x", "y": "y", "where": "B", "fold": 1}
    rows = np.arange(40, 80)[1::4]
    assert ex({"test": test})[0] == pytest.approx(stats.kendalltau(df.x[rows], df.y[rows]).pvalue)
    assert pa.Executor({"t": df}, 4, phack=8)({"test": test})[0] <= ex({"test": test})[0]
    assert ex({"test": {**test, "x": "nope"}})[0] is None and ex({"name": "?"})[0] is None


def test_synthetic_world_regulators_carry_signal():
    cfg = pp.Config.for_scale("smoke", n_genes=40)
    tables, hyps = ps.synthetic_world(cfg, 0)
    assert len(hyps) == 40 and set(tables) == set(ps.ASSAYS)
    reg = next(h for h in hyps if h.truth)
    assert all(len(tables[t][tables[t].gene == reg.implications[0][3]]) == cfg.rows_per_gene for t in tables)


def test_real_tables_load_and_hypotheses_are_non_null():
    from lab.data.tables import TABLES, load_table

    for name in TABLES:
        t = load_table(name)
        assert t.outcome in t.frame.columns and len(t.features) >= 5
    with pytest.raises(ValueError, match="not bundled"):
        load_table("iris_from_the_web")
    (h, name), = ps.real_hypotheses(1, 0)
    tab, x, y, _ = h.implications[0]
    assert tab == name and stats.spearmanr(load_table(name).frame[x], load_table(name).frame[y]).pvalue < 1e-3


def test_config_controls():
    assert pp.Config.for_scale("smoke", "shared_permutation_seed").shared_permutation
    assert ps.study_config(pp.Config.for_scale("smoke", "e_is_one_over_p")) == CFG
    with pytest.raises(ValueError):
        pp.Config.for_scale("smoke", "no_such_control")


# ---------------------------------------------------------------- sandbox and a code-writing agent

def test_sandbox_runs_code_on_tables_and_contains_failures():
    df = pd.DataFrame({"x": [1.0, 2.0, 3.0]})
    ok = run_python("print('p-value:', tables['t'].x.sum() / 100)", {"t": df}, timeout=30)
    assert ok.ok and pp.parse_p(ok.stdout)[0] == pytest.approx(0.06)
    net = run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))", timeout=30)
    assert not net.ok and "network access is disabled" in net.error
    slow = run_python("while True: pass", timeout=2)
    assert not slow.ok and "time limit" in slow.error
    assert "SyntaxError" in run_python("def (", timeout=30).error


def test_code_writing_agent_end_to_end_through_the_sandbox():
    code = "from scipy import stats\nd = tables['t']\nprint('p-value:', stats.spearmanr(d.x, d.y).pvalue)"
    prop = json.dumps({"name": "spearman", "h0": "none", "h1": "some", "code": code})
    llm = Offline(lambda m: json.dumps({"score": 0.9}) if "PROPOSAL" in m[-1]["content"] else prop, "fake_llm")
    x = np.arange(30.0)
    tables = {"t": pd.DataFrame({"x": x, "y": np.sin(x)})}
    tr = pp.falsify(H, ps.schema(tables), llm, llm, pa.Executor(tables, 5), pp.Config.for_scale("smoke", budget=1))
    assert tr.p_values == [pytest.approx(stats.spearmanr(x, np.sin(x)).pvalue)]


# ---------------------------------------------------------------- widgets

def test_widgets_card_and_trajectories():
    from lab.widgets.popper import card_figure, hypothesis_card, log_e_figure

    tr1 = pp.falsify(H, "", _designer([_proposal(p) for p in (0.01, 0.001)]), None, _exec, CFG)
    tr2 = pp.falsify(H, "", _designer([_proposal(0.6)] * 5), None, _exec, CFG)
    cards = {"a": ("H1", ps.card_rows(tr1, CFG)), "b": ("H2", ps.card_rows(tr2, CFG))}
    box = hypothesis_card(cards, 0.1)
    assert "VALIDATED" in box.html
    box.controls[0].value = "b"
    assert box.key == "b" and "not validated" in box.html
    assert len(card_figure(cards, 0.1).layout.updatemenus[0].buttons) == 2
    fig = log_e_figure({"null": np.zeros((3, 5)), "alt": np.ones((2, 5))})
    assert len(fig.layout.sliders[0].steps) == 3 and len(fig.data) == 5 + 3


# ---------------------------------------------------------------- the checkpoint path

@pytest.mark.notebook
def test_checkpoint_folder_drives_the_loop(tmp_path):
    """model=<folder>: a saved tiny Llama is the designer and judge; its unusable replies are recorded failures."""

    from lab.models.tokenizer import word_tokenizer

    from ..conftest import run_lab, save_tiny_lm

    tok = word_tokenizer(["p-value:", "{", "}", "0.5", "name", "h0", "h1", "code", "score"])
    save_tiny_lm(tmp_path / "m", tok, d_model=16, n_layers=1, n_heads=2, max_len=4096)
    proc = run_lab("run", "02_popper", "-p", "model", str(tmp_path / "m"), "-p", "llm_hypotheses", "1",
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "02_popper.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    runs = rec["metrics"]["checkpoint"]["runs"]
    assert len(runs) == 4 and all(r["failed"] >= 1 and r["errors"] for r in runs)
    assert {r["data"] for r in runs} == {"original", "permuted"}
