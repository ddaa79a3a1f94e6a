"""BanditSpec against independent references: Monte Carlo and closed forms for the environment, the radius and
EXP3 by hand, scipy's KL, plain greedy `generate` for exactness, the exact output distribution of a tiny target
(enumerated) for speculative sampling, and the checkpoint path through the runner."""

import itertools
import json
import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, entropy

from lab.models.zoo import tiny_llama
from lab.reasoning import banditspec as bs
from lab.reasoning import banditspec_bench as bb
from lab.reasoning.banditspec_decode import (
    Arm,
    LMDrafter,
    PromptLookup,
    SuffixTree,
    bandit_generate,
    verify_greedy,
    verify_sample,
)


def test_truncated_geometric_mean_matches_monte_carlo_and_pmf():
    rng = np.random.default_rng(0)
    for p, L in [(0.5, 4), (0.85, 4), (0.7, 2)]:
        y = bs.tg_sample(np.full(200_000, p), L, rng)
        assert y.min() >= 1 and y.max() <= L + 1
        assert abs(y.mean() - bs.tg_mean(p, L)) < 0.01
        pmf = bs.tg_pmf(p, L)
        assert abs(pmf.sum() - 1) < 1e-12 and abs((pmf * np.arange(1, L + 2)).sum() - bs.tg_mean(p, L)) < 1e-12
        assert np.allclose(np.bincount(y, minlength=L + 2)[1:] / len(y), pmf, atol=0.005)


def test_ucb_radius_by_hand_and_variants():
    n, t, K, L = np.array([[4.0, 9.0]]), 20, 2, 4
    by_hand = [2 * math.sqrt((1 + m) / m**2 * (1 + 2 * math.log(K * t**2 * math.sqrt(1 + m) / 0.5))) for m in (4, 9)]
    assert np.allclose(bs.ucb_radius(n, t, K, L), by_hand)
    wrong = bs.ucb_radius(np.array([[10.0, 1000.0]]), 2000, K, L, kind="wrong")
    paper = bs.ucb_radius(np.array([[10.0, 1000.0]]), 2000, K, L)
    assert paper[0, 1] < paper[0, 0] / 5 and wrong[0, 1] > wrong[0, 0] * 0.5  # the wrong one does not shrink
    assert np.allclose(bs.ucb_radius(n, t, K, L, kind="repo"), math.sqrt(6 * math.log(t) / t))


def test_ucbspec_plays_each_arm_once_then_the_index():
    pol = bs.UCBSpec(3, 1, L=4, cr_scale=0.0)
    picks = []
    for y in (1.0, 4.0, 2.0, 0.0, 0.0):
        a = pol.select()
        picks.append(int(a[0]))
        pol.update(a, np.array([y]))
    assert picks[:3] == [0, 1, 2] and picks[3] == 1  # greedy on the means once the radius is off


def test_exp3spec_probabilities_and_importance_weights_by_hand():
    pol = bs.EXP3Spec(2, 1, np.random.default_rng(0), L=4)
    Z = np.zeros(2)
    for t in range(1, 30):
        a = pol.select()
        eta = math.sqrt(math.log(2) / (t * 2))
        w = np.exp(-eta * Z)
        assert np.allclose(pol.probs[0], w / w.sum())
        y = 5.0 if a[0] == 0 else 1.0
        Z[a[0]] += (4 + 1 - y) / (4 * pol.probs[0, a[0]])
        pol.update(a, np.array([y]))
    assert np.allclose(pol.Z[0], Z) and pol.probs[0, 0] > 0.5


def test_lower_bound_slope_with_scipy_kl():
    p, L = (0.5, 0.85), 4
    mu = [bs.tg_mean(q, L) for q in p]
    kl = entropy(bs.tg_pmf(p[0], L), bs.tg_pmf(p[1], L))
    assert math.isclose(bs.lower_bound_slope(p, L), (mu[1] - mu[0]) / (mu[1] * kl))


def test_regret_of_bandits_is_far_below_uniform():
    cfg = bs.Config(runs=20, lens=(500, 4000))
    r = bs.regret_curves(cfg, 0, names=("UCBSpec", "uniform"))
    assert r["UCBSpec"][-1] < 0.25 * r["uniform"][-1]
    cfg_rr = bs.Config(runs=20, lens=(500, 4000), bandit="round robin")
    assert bs.regret_curves(cfg_rr, 0, names=("UCBSpec",))["UCBSpec"][-1] > 0.8 * r["uniform"][-1]


def test_cost_model_round_time_and_oracle_gamma_moves_down():
    cfg = bs.Config()
    assert bs.round_time(0, 1, cfg) == 1.0 and math.isclose(bs.round_time(3, 1, cfg), 1.3)
    assert math.isclose(bs.round_time(3, 16, cfg), 0.3 + 4.0)
    out = bs.gamma_load(cfg, 0)
    means = [out[b]["oracle γ"].mean() for b in cfg.batches]
    assert means[0] > means[-1] and all(out[b]["oracle"] >= out[b]["best fixed"] - 1e-12 for b in cfg.batches)


def test_transformers_heuristic_schedule_by_hand():
    """`heuristic_throughput` follows transformers' rule — γ + 2 after an all-accepted round (capped at L), else
    max(1, γ − 1) — on scripted acceptances (a stand-in generator), and its two limits in closed form."""

    class Scripted:  # rng.geometric returns the next scripted y per prompt (y − 1 drafts accepted before a miss)
        def __init__(self, ys):
            self.ys = iter(ys)

        def geometric(self, p):
            return np.asarray(next(self.ys))

    t = [1.0, 1.5, 2.0, 2.5, 3.0]  # round time for γ = 0..4 (L = 4)
    # one prompt: γ 4 (y 5: all) -> 4 (cap); y 2 -> 3; y 4 (all of 3) -> 4; y 1 -> 3; y 1 -> 2; y 3 (all) -> 4
    ys, gammas = [5, 5, 2, 4, 1, 1, 3], [4, 4, 4, 3, 4, 3, 2]
    got = bs.heuristic_throughput(np.array([0.5]), t, len(ys), Scripted([[y] for y in ys]))
    assert got == pytest.approx(sum(ys) / sum(t[g] for g in gammas))
    # the +2 step away from the cap: γ 4 -> 3 -> 2 -> 1 on misses, then all accepted at γ = 1 (y 2) -> 3, not 2
    ys, gammas = [1, 1, 1, 2, 1], [4, 3, 2, 1, 3]
    got = bs.heuristic_throughput(np.array([0.5]), t, len(ys), Scripted([[y] for y in ys]))
    assert got == pytest.approx(sum(ys) / sum(t[g] for g in gammas))
    # y capped at γ + 1: a scripted 9 in round 1 counts as 5 tokens
    assert bs.heuristic_throughput(np.array([0.5]), t, 1, Scripted([[9]])) == pytest.approx(5 / 3.0)
    rng = np.random.default_rng(0)  # a → 1: every draft accepted, γ stays at L; a = 0: γ falls to 1 and stays
    assert bs.heuristic_throughput(np.array([1 - 1e-12]), t, 50, rng) == pytest.approx(5 / 3.0)
    assert bs.heuristic_throughput(np.array([0.0]), t, 10, rng) == pytest.approx(10 / (3.0 + 2.5 + 2.0 + 7 * 1.5))


def test_verify_greedy_by_hand():
    logits = torch.full((4, 6), -1.0)
    for i, x in enumerate([3, 2, 5, 1]):
        logits[i, x] = 1.0
    assert verify_greedy(logits, [3, 2, 4]) == (2, 5)
    assert verify_greedy(logits, [3, 2, 5]) == (3, 1)
    assert verify_greedy(logits[:1], []) == (0, 3)


def test_prompt_lookup_takes_the_earliest_longest_match():
    pld = PromptLookup(3, 10)
    ids = [1, 2, 3, 4, 5, 9, 2, 3, 7, 1, 2, 3]
    assert pld.propose(ids, 3, greedy=True, temperature=1.0, gen=None)[0] == [4, 5, 9]  # 3-gram (1, 2, 3)
    assert pld.propose([5, 6, 8], 2, greedy=True, temperature=1.0, gen=None)[0] == []
    drafts, q = pld.propose(ids, 2, greedy=False, temperature=1.0, gen=None)
    assert drafts == [4, 5] and torch.equal(q.argmax(-1), torch.tensor([4, 5])) and q.sum() == 2


def _trie(texts, depth):
    """A suffix trie with counts, built by hand: node[path] = {next token: occurrences of path + token}."""
    node: dict = {}
    for t in texts:
        for s in range(len(t)):
            for e in range(s, min(len(t) - 1, s + depth)):
                nxt = node.setdefault(tuple(t[s:e + 1]), {})
                nxt[t[e + 1]] = nxt.get(t[e + 1], 0) + 1
    return node


def _trie_chain(node, ids, gamma, max_depth, min_prob):
    """The reference walk: the longest suffix of ids with children, then the most frequent child (every tied token
    listed; the walk stops at a tie) while the path probability stays >= min_prob."""
    for n in range(min(max_depth, len(ids)), 0, -1):
        if node.get(tuple(ids[-n:])):
            path = list(ids[-n:])
            break
    else:
        return [], 0.0
    chain, p, score = [], 1.0, 0.0
    for _ in range(gamma):
        kids = node.get(tuple(path))
        if not kids:
            break
        c = max(kids.values())
        p *= c / sum(kids.values())
        if p < min_prob:
            break
        chain.append([x for x, v in kids.items() if v == c])  # every most frequent token (ties)
        score += p
        path.append(chain[-1][0] if len(chain[-1]) == 1 else None)
        if path[-1] is None:
            break
    return chain, score


def test_suffix_tree_walk_matches_a_counted_trie():
    """The chain on random texts against a trie built by hand: the longest match, the most frequent child, the
    product of count ratios as the path probability, the stop below min_prob; the local text excludes its own end."""
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(200):
        texts = [rng.integers(0, 4, rng.integers(5, 30)).tolist() for _ in range(rng.integers(1, 4))]
        ids = rng.integers(0, 4, rng.integers(1, 10)).tolist()
        st = SuffixTree(max_depth=5, min_prob=0.2)
        got, score = st.walk(texts, ids, 4)
        want, want_score = _trie_chain(_trie(texts, 5 + 4), ids, 4, 5, 0.2)
        # compare up to the first tie (a tie may go either way; the counts are the same)
        k = next((i for i, w in enumerate(want) if len(w) > 1), len(want))
        assert [w[0] for w in want[:k]] == got[:k]
        if k == len(want):
            assert len(got) == len(want) and math.isclose(score, want_score)
            checked += 1
    assert checked > 100
    # the local tree: the text's own last n tokens are not a match of themselves
    st = SuffixTree(max_depth=4, min_prob=0.1, vocab_size=10)
    assert st.propose([1, 2, 3], 3, greedy=True, temperature=1.0, gen=None) == ([], None)
    assert st.propose([1, 2, 3, 9, 1, 2], 3, greedy=True, temperature=1.0, gen=None)[0] == [3, 9, 1]
    # the global tree drafts once it has seen an output; the higher-scoring tree wins
    st.finish([5, 6, 7, 8])
    assert st.propose([0, 5, 6], 2, greedy=True, temperature=1.0, gen=None)[0] == [7, 8]
    st.finish([5, 6, 4])
    st.finish([5, 6, 4])  # now 6 -> 4 twice, 6 -> 7 once: p = 2/3, then 4 ends every text
    drafts, q = st.propose([0, 5, 6], 2, greedy=False, temperature=1.0, gen=None)
    assert drafts == [4] and torch.equal(q.argmax(-1), torch.tensor([4]))


def test_suffix_tree_arm_is_lossless_and_remembers_earlier_outputs():
    target, _ = _tiny_pair()
    arms = [Arm("suffix", SuffixTree(vocab_size=40), 4)]
    prompt = [3, 4, 5, 6, 7]
    first = bandit_generate(target, arms, prompt, 30, policy="fixed 0")
    again = bandit_generate(target, arms, prompt, 30, policy="fixed 0")  # its own output is now in the global tree
    assert first.tokens == again.tokens == bb.plain(target, prompt, 30)
    assert arms[0].drafter.outputs == [first.tokens, again.tokens]
    assert again.rounds <= first.rounds // 2  # 9 against 20 here: most rounds now accept four drafts


def _tiny_pair(V=40, seed=0):
    torch.manual_seed(seed)
    target = tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_len=128).eval()
    draft = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=128).eval()
    for m in (target, draft):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    return target, draft


@pytest.mark.parametrize("policy", ["UCBSpec", "EXP3Spec", "fixed 0", "fixed 1", "uniform"])
def test_greedy_output_is_token_identical_to_generate(policy):
    target, draft = _tiny_pair()
    # the draft shares the target's first layer weights partly, so some drafts are accepted and caches get cropped
    arms = [Arm("PLD", PromptLookup(3, 40), 4), Arm("draft", LMDrafter(draft), 3), Arm("self", LMDrafter(target), 2)]
    g = torch.Generator().manual_seed(1)
    accepted = 0
    for j in range(4):
        prompt = torch.randint(1, 40, (12,), generator=g).tolist()
        tr = bandit_generate(target, arms, prompt, 40, policy=policy, seed=j, cr_scale=0.25)
        assert tr.tokens == bb.plain(target, prompt, 40)
        assert len(tr.source) == 40 and tr.rounds <= 40
        accepted += sum(tr.accepted)
    assert accepted > 0


def test_verify_sample_first_token_has_the_target_law():
    """One round on fixed tables: drafts x ~ q, the first emitted token must follow p[0] whatever q is."""
    g = torch.Generator().manual_seed(0)
    V, n = 5, 20_000
    p = torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64) * 2, -1)
    q = torch.softmax(torch.randn(2, V, generator=g, dtype=torch.float64) * 2, -1)
    first = np.zeros(V)
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        k, nxt = verify_sample(p, q, drafts, g)
        first[drafts[0] if k > 0 else nxt] += 1
    assert chisquare(first, p[0].numpy() * n).pvalue > 1e-3


def test_speculative_sampling_has_exactly_the_target_distribution():
    """Tiny vocabulary (V=4), 3 new tokens: the empirical law of 1200 BanditSpec samples (arms: an untrained LM
    drafter at γ=2 and prompt lookup, picked by EXP3Spec) against the target's exact law over all 64 outputs."""
    V, T, n = 4, 1.0, 1200
    torch.manual_seed(3)
    target = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=32).eval()
    draft = tiny_llama(vocab_size=V, d_model=8, n_layers=1, n_heads=2, max_len=32).eval()
    with torch.no_grad():  # make the target peaked enough that drafts are often accepted and often rejected
        target.lm_head.weight.mul_(8)
    prompt = [1, 2, 3, 1]
    outs = list(itertools.product(range(V), repeat=3))
    with torch.no_grad():
        exact = []
        for o in outs:
            logp = torch.log_softmax(target(torch.tensor([prompt + list(o)])).logits[0].double() / T, -1)
            exact.append(float(sum(logp[len(prompt) - 1 + i, o[i]] for i in range(3)).exp()))
    exact = np.array(exact)
    assert abs(exact.sum() - 1) < 1e-9
    arms = [Arm("draft", LMDrafter(draft), 2), Arm("PLD", PromptLookup(2, V), 2)]
    counts = dict.fromkeys(outs, 0)
    rejected = 0
    for s in range(n):
        tr = bandit_generate(target, arms, prompt, 3, policy="EXP3Spec", greedy=False, temperature=T, seed=s)
        counts[tuple(tr.tokens)] += 1
        rejected += sum(o > a for o, a in zip(tr.offered, tr.accepted))
    obs = np.array([counts[o] for o in outs])
    keep = exact * n >= 5  # chi-square cells with enough expected mass; the rest pooled
    f_obs = np.append(obs[keep], obs[~keep].sum())
    f_exp = np.append(exact[keep], exact[~keep].sum()) * n
    assert rejected > 100  # the rejection branch was exercised
    assert chisquare(f_obs[f_exp > 0], f_exp[f_exp > 0]).pvalue > 1e-3


def test_edit_generate_task_answers():
    task = bb.EditGenerate()
    g = torch.Generator().manual_seed(0)
    for kind in ("edit", "generate"):
        rows, p = task.sequences(3, kind, g, 60)
        for r in rows.tolist():
            assert r[p:] == task.continuation(r[:p], 60 - p)
    rows, p = task.sequences(2, "generate", g, 60)
    assert not set(rows[:, p:].flatten().tolist()) & set(rows[:, :p].flatten().tolist())  # never in the prompt
    b = task.batch(8, g)
    assert b["input_ids"].shape == (8, task.length) and (b["labels"] == -100).any()


@pytest.mark.notebook
def test_checkpoint_target_and_drafter_folders_run_the_bandit(tmp_path):
    """model=<folder>, draft=<folder>, data=<.txt>, eagle_steps: BanditSpec over the drafter, prompt lookup, the suffix
    tree, REST and EAGLE, measured."""
    from lab.models.tokenizer import word_tokenizer

    from ..conftest import run_lab, save_tiny_lm

    words = [f"w{i}" for i in range(30)]
    tok = word_tokenizer(words)
    save_tiny_lm(tmp_path / "t", tok, d_model=32, n_layers=2, n_heads=4, max_len=256)
    save_tiny_lm(tmp_path / "d", tok, seed=None, d_model=16, n_layers=1, n_heads=2, max_len=256)
    g = np.random.default_rng(0)
    (tmp_path / "text.txt").write_text("\n".join(" ".join(g.choice(words[:8], 30)) for _ in range(20)))
    proc = run_lab("run", "16_banditspec", "-p", "model", str(tmp_path / "t"), "-p", "draft", str(tmp_path / "d"),
                   "-p", "data", str(tmp_path / "text.txt"), "-p", "n_prompts", "3", "-p", "gen_len", "24",
                   "-p", "eagle_steps", "20",
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "16_banditspec.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert ck["identical"] == {k: 1.0 for k in ck["identical"]} and set(ck["rounds"]) >= {"UCBSpec", "EXP3Spec"}
    assert ck["tokens"] == 3 * 24 and all(ck["rounds"][k] <= ck["tokens"] for k in ck["rounds"])
    assert {"REST γ=4", "EAGLE γ=4"} <= set(ck["arms"]) and len(ck["arms"]) == 7  # over the 17 texts not prompted
    assert ck["eagle_loss"] > 0
    print(f"checkpoint run: {rec['seconds']:.1f} s")


def test_widgets_colour_tokens_by_arm_and_follow_the_controls():
    from lab.reasoning.banditspec_decode import Trace
    from lab.widgets.banditspec import COLORS, TARGET_COLOR, spec_explorer, timeline_figure, token_html

    a = Trace([5, 6, 7, 8], arms=[0, 1], offered=[4, 4], accepted=[2, 0], source=[0, 0, -1, -1])
    b = Trace([9, 9, 9], arms=[1, 1, 1], offered=[4, 4, 4], accepted=[0, 0, 0], source=[-1, -1, -1])
    html = token_html(a.tokens, a.source, ["PLD", "draft"])
    assert html.count(f"background:{COLORS[0]};color:white;font") == 2
    assert html.count(f"background:{TARGET_COLOR};color:black;font") == 2
    panel = spec_explorer({"UCBSpec": [a, b]}, ["PLD", "draft"], ["p0", "p1"])
    policy, prompt = panel.children[0].children
    text = panel.children[2]
    before = text.value
    prompt.value = 1
    assert text.value != before and text.value.count(f"background:{TARGET_COLOR};color:black;font") == 3
    fig = timeline_figure({"UCBSpec": [a, b], "fixed 0": [b, a]}, ["PLD", "draft"], ["p0", "p1"])
    assert len(fig.data) == 2 and fig.data[0].visible and not fig.data[1].visible
    assert np.nan_to_num(np.asarray(fig.data[0].z, dtype=float), nan=-1).tolist() == [[0, 1, -1], [1, 1, 1]]
