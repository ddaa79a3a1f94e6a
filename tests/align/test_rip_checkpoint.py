"""R.I.P. on a checkpoint: the pool's pairs and metrics from text rows, a pool sampled and scored when the data has
only prompts, and notebook 13 run end to end on a tiny saved policy and pool."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lab.align import rip as R
from lab.align import rip_checkpoint as rc
from lab.core.params import ParamError

WORDS = "the a cat dog sat ran on mat fast slow good bad".split()


def rows_():
    return [{"prompt": "p0", "responses": ["long answer", "ok", "x"], "rewards": [0.9, 0.5, 0.1]},
            {"prompt": "p1", "responses": ["same", "tie", "bad one"], "rewards": [0.2, 0.2, -1.0]}]


def test_pool_is_best_vs_worst_with_character_lengths():
    pool = rc.pool_of(rows_())
    ref = R.best_vs_worst(torch.tensor([[0.9, 0.5, 0.1], [0.2, 0.2, -1.0]], dtype=torch.float64),
                          torch.tensor([[11, 2, 1], [4, 3, 7]]))
    for f in ("w", "l", "m1", "m2", "m3", "valid"):
        assert torch.equal(getattr(pool, f), getattr(ref, f)), f
    assert pool.m2.tolist() == [1.0, 7.0]  # the rejected responses "x" and "bad one", in characters
    assert rc.pairs(rows_(), pool, torch.tensor([True, True])) == [
        {"prompt": "p0", "chosen": "long answer", "rejected": "x"},
        {"prompt": "p1", "chosen": "same", "rejected": "bad one"}]
    with pytest.raises(ParamError, match="same number of responses"):
        rc.pool_of([rows_()[0], {**rows_()[1], "responses": ["a"], "rewards": [1.0]}])


def test_pool_rows_reads_a_ranked_pool_and_refuses_pairs_or_bare_prompts(tmp_path):
    """A ranked pool is read best first; pairs or prompts without a reward model are refused (sampling and scoring a
    pool is `hf_prefs.preference_rows`, tested in tests/align/test_hf_prefs.py)."""
    (tmp_path / "pool.jsonl").write_text("\n".join(json.dumps(r) for r in rows_()))
    got = rc.pool_rows(str(tmp_path / "pool.jsonl"), n=2)
    assert sorted(r["prompt"] for r in got) == ["p0", "p1"] and all(r["rewards"][0] >= r["rewards"][-1] for r in got)
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}))
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": w}) for w in WORDS[:3]))
    for name in ("pairs", "prompts"):
        with pytest.raises(ParamError, match="no 'responses'/'rewards' columns .*; pass -p reward_model"):
            rc.pool_rows(str(tmp_path / f"{name}.jsonl"), n=1)


def test_chosen_scores_are_the_chosen_responses_mean_nll_with_and_without_the_prompt():
    from lab.models.tokenizer import word_tokenizer
    from lab.models.zoo import tiny_llama

    tok = word_tokenizer(WORDS)
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4).eval()
    rows = [{"prompt": "the cat", "responses": ["sat on the mat", "the mat ran"], "rewards": [1.0, 0.0]},
            {"prompt": "a dog ran fast", "responses": ["bad", "good dog"], "rewards": [0.0, 2.0]}]
    pool = rc.pool_of(rows)
    got = rc.chosen_scores(m, tok, rows, pool, batch_size=1)

    def nll(ctx, y):  # naive: mean −log p of y's tokens after ctx
        with torch.no_grad():
            logp = m(input_ids=torch.tensor([ctx + y])).logits[0].log_softmax(-1)
        return -sum(logp[len(ctx) - 1 + t, y[t]] for t in range(len(y))).item() / len(y)

    for i, (row, w) in enumerate(zip(rows, pool.w.tolist())):
        p = tok(row["prompt"])["input_ids"]
        y = tok(row["responses"][w], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with_q, alone = nll(p, y), nll([tok.bos_token_id], y)
        assert got["s(A|Q)"][i].item() == pytest.approx(with_q, rel=1e-4)
        assert got["IFD"][i].item() == pytest.approx(with_q / alone, rel=1e-4)
        assert got["ppl"][i].item() == pytest.approx(math.exp(with_q), rel=1e-4)
    # {the, mat} of {sat, on, the, mat, ran}; "good dog" vs "bad"
    assert got["overlap"].tolist() == pytest.approx([2 / 5, 0.0])


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_notebook_on_a_saved_policy_and_pool_is_measured(tmp_path):
    from lab.models.tokenizer import word_tokenizer

    from ..conftest import run_lab, save_tiny_lm

    tok = word_tokenizer(WORDS)
    save_tiny_lm(tmp_path / "policy", tok, d_model=32, n_layers=2, n_heads=4)
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(24):
        resp = [" ".join(WORDS[j] for j in torch.randint(len(WORDS), (int(k) + 1,), generator=g).tolist())
                for k in torch.randint(6, (4,), generator=g)]
        rows.append({"prompt": f"{WORDS[i % 12]} {WORDS[(i + 3) % 12]}", "responses": resp,
                     "rewards": torch.randn(4, generator=g).tolist()})
    (tmp_path / "pool.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    proc = run_lab("run", "13_rip", "-p", "model", str(tmp_path / "policy"), "-p", "data", str(tmp_path / "pool.jsonl"),
                   "-p", "n_prompts", "24", "-p", "held_out", "6", "-p", "epochs", "1.0", "-p", "max_len", "32",
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "13_rip.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert set(ck["arms"]) == {"reference", "full", "RIP", "random", "IFD", "ppl", "overlap"}
    assert ck["kept"]["RIP"] == ck["kept"]["random"] < ck["kept"]["full"] <= 18
    n = ck["kept"]["full"]  # 25–100 %: the ranks at or above the linear 25 % quantile, (n − 1)/4
    assert ck["kept"]["IFD"] == ck["kept"]["ppl"] == n - math.ceil((n - 1) / 4)
    kept, dropped = ck["mean metrics, kept vs dropped"]["rejected reward"].values()
    assert kept >= dropped  # RIP keeps the pairs whose rejected response scores high
