"""cDPO on a checkpoint: final-answer grading, the official selection on string answers, contrastive estimation with
two LoRA adapters of one PeftModel against a per-sample reference, the SFT and Eq. (6) losses against naive loops,
the critical-token table by hand, and notebook 19 run end to end on a tiny saved policy and problem file."""

from __future__ import annotations

import json

import pytest
import torch

from lab.align import LOSSES
from lab.align import cdpo as C
from lab.align import cdpo_checkpoint as CC
from lab.align import hf_batch as hb
from lab.align import hf_prefs as hp
from lab.models.tokenizer import word_tokenizer
from lab.models.zoo import tiny_llama

WORDS = [str(d) for d in range(10)] + ["Question:", "Answer:", "plus", "is"]


@pytest.fixture
def tok():
    return word_tokenizer(WORDS)  # <pad>=0 <unk>=1 <bos>=2 <eos>=3, "0"=4 ... "9"=13


def tiny(tok, seed=0):
    torch.manual_seed(seed)
    return tiny_llama(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4).eval()


def two_adapters(tok):
    """A PeftModel with adapters P_p and P_n whose LoRA B matrices are random (fresh adapters equal the base)."""
    cfg = hp.Config(lora_r=4, lora_alpha=8)
    model = hp.add_adapter(hp.add_adapter(tiny(tok), cfg, "P_p"), cfg, "P_n")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def trajs(samples, answers, correct, prompts=None):
    return CC.Trajectories([{"question": f"q{i}", "answer": ""} for i in range(len(samples))],
                           prompts or [f"q{i}" for i in range(len(samples))], samples,
                           [[""] * len(r) for r in samples], answers, torch.tensor(correct))


def test_selection_numbers_string_answers_as_the_official_select():
    answers = [["5", "3", "3", None, "5", "8"], ["2", "2", "1", "1", "1", "4"]]
    correct = [[True, False, False, False, True, False], [False] * 6]
    sel = CC.selection(trajs([[([], [])] * 6] * 2, answers, correct))
    ref = C.select(torch.tensor([[0, 1, 1, -1, 0, 2], [0, 0, 1, 1, 1, 2]]), torch.tensor(correct))
    assert sel == ref
    assert sel == [{"pos": 0, "neg": [1]}, {"pos": None, "neg": [2]}]  # "3" ×2 covers 2/3; "1" ×3 covers 3/6


def test_trajectories_are_the_policy_samples_graded_by_final_answer(tok):
    model, probs = tiny(tok), [{"question": "3 plus 4", "answer": "7"}, {"question": "1 plus 1", "answer": "#### 2"}]
    tr = CC.trajectories(model, tok, probs, 5, max_new_tokens=4, seed=3, chunk=1)
    assert tr.prompts == ["Question: 3 plus 4\nAnswer:", "Question: 1 plus 1\nAnswer:"]
    assert tr.samples[1] == hp.sample(model, tok, tr.prompts[1:], None, n=5, max_new_tokens=4, seed=4)  # chunk 1
    for p, row, texts, ok in zip(probs, tr.samples, tr.texts, tr.correct.tolist()):
        assert len(row) == 5 and texts == [tok.decode(y, skip_special_tokens=True) for _, y in row]
        assert ok == [CC.answer_of(t) == CC.reference_answer(p["answer"]) for t in texts]


def test_token_scores_match_ce_scores_sample_by_sample(tok):
    model = two_adapters(tok)
    samples = [([2, 14, 7], [5, 6, 3]), ([2, 14, 8, 16, 9], [10]), ([15], [4, 4, 11, 12, 3])]  # unequal lengths
    got = CC.token_scores(model, samples, beta=1.0, batch_size=2)
    pos = lambda **kw: hp.use(model, "P_p")(**kw)
    neg = lambda **kw: hp.use(model, "P_n")(**kw)
    for (p, y), s in zip(samples, got):
        ref = C.ce_scores(pos, neg, torch.tensor([p]), torch.tensor([y]), beta=1.0)[0]
        assert s.shape == (len(y),) and torch.allclose(s, ref, atol=1e-5)
    flat = CC.token_scores(model, samples[:1], beta=0.0)[0]  # β = 0: P_p's own probabilities, not the base's
    with torch.no_grad():
        p_p = hp.use(model, "P_p")(input_ids=torch.tensor([[2, 14, 7, 5, 6, 3]])).logits[0, 2:5].softmax(-1)
    assert torch.allclose(flat, p_p[[0, 1, 2], [5, 6, 3]], atol=1e-5)


def test_sft_loss_is_the_mean_response_nll_and_sft_trains_only_its_adapter(tok):
    model = tiny(tok)
    samples = [([2, 14, 7], [5, 6, 3]), ([2, 15], [10])]
    batch = hb.pad_batch([[s] for s in samples], 0)
    with torch.no_grad():
        got = CC.sft_loss(model, batch)
        nll = []
        for p, y in samples:
            logp = model(input_ids=torch.tensor([p + y])).logits[0].log_softmax(-1)
            nll += [-logp[len(p) - 1 + t, y[t]] for t in range(len(y))]
    assert torch.allclose(got, torch.stack(nll).mean(), atol=1e-5)
    cfg = hp.Config(steps=30, batch_size=2, lr=1e-2, lora_r=4, lora_alpha=8)
    model, losses = CC.sft(model, samples, cfg, "P_p")
    before = {k: v.clone() for k, v in model.named_parameters() if ".P_p." in k}
    model, losses_n = CC.sft(model, samples[:1], cfg, "P_n")
    assert losses[-1] < 0.9 * losses[0] and losses_n[-1] < 0.9 * losses_n[0]
    assert all(torch.equal(v, dict(model.named_parameters())[k]) for k, v in before.items())


def test_pair_batch_places_s_on_the_rejected_tokens_and_the_loss_is_eq6(tok):
    model = two_adapters(tok)  # policy: adapter P_p; reference: adapters off
    rows = [{"chosen": ([2, 14], [5, 3]), "rejected": ([2, 14], [6, 7, 3]), "s": torch.tensor([0.1, 0.9, 0.5])},
            {"chosen": ([15], [4, 4, 3]), "rejected": ([15], [8]), "s": torch.tensor([0.3])}]
    b = CC.pair_batch(rows)
    assert torch.allclose(b["s"], torch.tensor([[0, 0.1, 0.9, 0.5], [0.3, 0, 0, 0]]))
    policy, ref = hp.use(model, "P_p"), hp.DisabledAdapter(model)

    def lp(m, p, y):  # naive per-token log-probs of y after p
        with torch.no_grad():
            logp = m(input_ids=torch.tensor([p + y])).logits[0].log_softmax(-1)
        return torch.stack([logp[len(p) - 1 + t, y[t]] for t in range(len(y))])

    want = []
    for r in rows:
        h_w = lp(policy, *r["chosen"]) - lp(ref, *r["chosen"])
        h_l = lp(policy, *r["rejected"]) - lp(ref, *r["rejected"])
        want.append(-torch.nn.functional.logsigmoid(0.5 * (h_w.sum() - ((1 - r["s"]) * h_l).sum())))
    with torch.no_grad():
        assert torch.allclose(CC.cdpo_batch_loss(policy, ref, b, gamma=0.5), torch.stack(want).mean(), atol=1e-5)
        b0 = CC.pair_batch([r | {"s": torch.zeros_like(r["s"])} for r in rows])  # s = 0: DPO
        pi, rf = hp.sequence_logprobs(policy, b0), hp.sequence_logprobs(ref, b0)
        assert torch.allclose(CC.cdpo_batch_loss(policy, ref, b0, gamma=0.5), LOSSES["dpo"](pi, rf, beta=0.5).mean(),
                              atol=1e-5)


def test_tokendpo_arm_is_tdpo2_on_the_pairs_by_hand(tok):
    """The checkpoint's TokenDPO arm: −log σ(β(h_w − h_l − α(D_l − D_w))), α = 0.5, with D the response's sequential
    KL(π_ref ‖ π_θ) summed over its own tokens only (naive per-response loops here); an unknown arm is refused."""
    model = two_adapters(tok)
    rows = [{"chosen": ([2, 14], [5, 3]), "rejected": ([2, 14], [6, 7, 3]), "s": torch.tensor([0.1, 0.9, 0.5])},
            {"chosen": ([15], [4, 4, 3]), "rejected": ([15], [8]), "s": torch.tensor([0.3])}]
    policy, ref = hp.use(model, "P_p"), hp.DisabledAdapter(model)

    def dists(m, p, y):  # log π(·|p, y_<t) at each token of y
        with torch.no_grad():
            return m(input_ids=torch.tensor([p + y])).logits[0, len(p) - 1:len(p) - 1 + len(y)].log_softmax(-1)

    want = []
    for r in rows:
        h, D = [], []
        for p, y in (r["chosen"], r["rejected"]):
            dp, dr = dists(policy, p, y), dists(ref, p, y)
            h.append(sum(dp[t, y[t]] - dr[t, y[t]] for t in range(len(y))))
            D.append((dr.exp() * (dr - dp)).sum())
        want.append(-torch.nn.functional.logsigmoid(0.5 * (h[0] - h[1] - 0.5 * (D[1] - D[0]))))
    with torch.no_grad():
        got = hp.preference_loss(policy, ref, CC.pair_batch(rows), "tdpo", beta=0.5)
    assert got.item() == pytest.approx(torch.stack(want).mean().item(), abs=1e-5)
    assert got.item() != pytest.approx(CC.cdpo_batch_loss(policy, ref, CC.pair_batch(rows), gamma=0.5).item(), abs=1e-4)
    with pytest.raises(ValueError, match="not one of"):
        CC.train_arm(model, rows, hp.Config(), "ipo")


def test_rpo_arm_is_dpo_plus_the_chosen_nll_per_token_by_hand(tok):
    model = two_adapters(tok)
    rows = [{"chosen": ([2, 14], [5, 3]), "rejected": ([2, 14], [6, 7, 3]), "s": torch.tensor([0.1, 0.9, 0.5])},
            {"chosen": ([15], [4, 4, 3]), "rejected": ([15], [8]), "s": torch.tensor([0.3])}]
    policy, ref = hp.use(model, "P_p"), hp.DisabledAdapter(model)

    def seq(m, p, y):  # naive summed log-prob of y after p
        with torch.no_grad():
            logp = m(input_ids=torch.tensor([p + y])).logits[0].log_softmax(-1)
        return sum(logp[len(p) - 1 + t, y[t]] for t in range(len(y)))

    want = []
    for r in rows:
        h = [seq(policy, *r[k]) - seq(ref, *r[k]) for k in ("chosen", "rejected")]
        nll = -seq(policy, *r["chosen"]) / len(r["chosen"][1])
        want.append(-torch.nn.functional.logsigmoid(0.5 * (h[0] - h[1])) + nll)
    with torch.no_grad():
        got = CC.rpo_batch_loss(policy, ref, CC.pair_batch(rows), beta=0.5)
    assert got.item() == pytest.approx(torch.stack(want).mean().item(), abs=1e-5)


def test_critical_table_hand_computed(tok):
    samples = [[([2], [5, 6, 3]), ([2], [5, 7, 3]), ([2], [8, 7, 3]), ([2], [8, 6, 3])]]
    tr = trajs(samples, [["1", "2", "2", "1"]], [[True, False, False, True]])
    scores = {(0, 1): torch.tensor([0.9, 0.1, 0.5]), (0, 2): torch.tensor([0.9, 0.2, 0.8])}  # both: token 7 ("3")
    (row,) = CC.critical_table(tok, tr, scores, top=2)
    assert row["wrong share"] == 0.5 and row["relative position"] == pytest.approx(1 / 3)
    assert row["critical tokens"] == [{"token": "3", "count": 2, "wrong share when present": 1.0}]
    assert row["random token"]["wrong share when present"] in (0.5, 1.0)  # 5/8 or <eos>: 0.5; 7: 1.0
    s = CC.summary([row])
    assert s["wrong share, top critical token present"] == 1.0 and s["problems with a wrong trajectory"] == 1
    assert row["wrong trajectories scored"] == 2 and s["top critical token's share of the wrong trajectories"] == 1.0
    assert CC.frame_rows([row])[0]["critical 1"] == "'3' ×2 (1.00)"


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_notebook_on_a_saved_policy_and_problems_is_measured(tmp_path, tok):
    from ..conftest import run_lab, save_tiny_lm

    save_tiny_lm(tmp_path / "policy", tok, d_model=32, n_layers=2, n_heads=4)
    rows = [{"question": f"{a} plus {b}", "answer": str((a + b) % 10)} for a in range(4) for b in range(4)]
    (tmp_path / "problems.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    proc = run_lab("run", "19_cdpo", "-p", "model", str(tmp_path / "policy"), "-p", "data",
                   str(tmp_path / "problems.jsonl"), "-p", "n_problems", "16", "-p", "n_samples", "8", "-p", "held_out",
                   "4", "-p", "max_new_tokens", "4", "-p", "max_len", "32", "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "19_cdpo.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert ck["problems"] == 16 and ck["K"] == 8 and 0 < ck["share correct"] < 1
    assert ck["P_p data"] >= 1 and ck["P_n data"] >= 1
    table = ck["critical tokens per problem"]
    assert len(table) == ck["critical tokens"]["problems with a wrong trajectory"] > 0
    assert all(0 <= c["wrong share when present"] <= 1 for r in table for c in r["critical tokens"])
    assert set(ck["arms"]) == {"reference", "P_p", "dpo", "rpo", "tokendpo", "cdpo"}
    assert all(0 <= m["sampled accuracy"] <= 1 for m in ck["arms"].values())
