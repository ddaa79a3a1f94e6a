"""InfAlign on a checkpoint: the exact discrete BoN / WoN win rate against brute-force enumeration, the support's KL,
the reward-model loader's refusals, and notebook 12 run end to end on a tiny policy and reward model saved to disk."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from lab.align import infalign_checkpoint as ck
from lab.models import ModelNotAvailable, load_reward_model

WORDS = "the a cat dog sat ran on mat fast slow good bad".split()


@pytest.mark.parametrize("kind", ["bon", "won"])
@pytest.mark.parametrize("N", [1, 2, 3])
def test_discrete_win_rate_is_brute_force_enumeration(kind, N):
    s = torch.tensor([[0.1, 0.5, 0.5, 0.9, 0.3], [2.0, -1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    w = torch.softmax(torch.randn(2, 5, generator=torch.Generator().manual_seed(N), dtype=torch.float64), -1)
    pick = max if kind == "bon" else min
    want = []
    for sc, wi in zip(s, w):
        tot = 0.0
        for xs in itertools.product(range(5), repeat=N):
            for ys in itertools.product(range(5), repeat=N):
                a, b = pick(sc[list(xs)]), pick(sc[list(ys)])
                tot += float(torch.prod(wi[list(xs)])) * 5.0 ** -N * (float(a > b) + 0.5 * float(a == b))
        want.append(tot)
    assert ck.discrete_win_rate(s, w, N, kind) == pytest.approx(sum(want) / 2, abs=1e-12)


def test_kl_on_the_support_and_the_tilt():
    M = 8
    assert ck.kl(torch.full((3, M), 1 / M)) == pytest.approx(0.0, abs=1e-12)
    assert ck.kl(torch.eye(M)[:2].double()) == pytest.approx(math.log(M))
    R = torch.randn(3, M, dtype=torch.float64)
    assert torch.allclose(ck.tilt(R, 1e9), torch.full((3, M), 1 / M, dtype=torch.float64))
    assert (ck.tilt(R, 1e-3).argmax(-1) == R.argmax(-1)).all()  # β → 0: all mass on the best sample
    assert ck.discrete_win_rate(R, torch.full((3, M), 1 / M, dtype=torch.float64), 4) == pytest.approx(0.5)


def test_rewards_calibrate_per_prompt():
    base = torch.tensor([[0.0, 1.0, 2.0, 3.0], [100.0, 200.0, 300.0, 400.0]], dtype=torch.float64)
    ev = torch.tensor([[1.5, 3.5], [150.0, 450.0]], dtype=torch.float64)
    R = ck.rewards(base, ev, 10.0)
    assert torch.equal(R["calibrated (IPO-like)"], torch.tensor([[0.5, 1.0], [0.25, 1.0]], dtype=torch.float64))
    assert R["raw (RLHF)"][0].max() < 0.01  # the first prompt's rewards vanish on the global scale


def _save_models(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from lab.models.tokenizer import word_tokenizer

    from ..conftest import save_tiny_lm

    tok = word_tokenizer(WORDS)
    save_tiny_lm(tmp_path / "policy", tok, d_model=32, n_layers=2, n_heads=4)
    for labels, name in ((1, "rm"), (2, "classifier")):
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_labels=labels, pad_token_id=tok.pad_token_id)
        LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)


def test_reward_model_loader_refuses_what_is_not_one(tmp_path):
    _save_models(tmp_path)
    rm, tok = load_reward_model(str(tmp_path / "rm"))
    assert rm.config.num_labels == 1 and tok.pad_token is not None
    with pytest.raises(ModelNotAvailable, match="has 2 labels"):
        load_reward_model(str(tmp_path / "classifier"))
    with pytest.raises(ModelNotAvailable, match="neither a folder"):
        load_reward_model(str(tmp_path / "nothing"))


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_notebook_on_a_saved_policy_and_reward_model_is_measured(tmp_path):
    from ..conftest import run_lab

    _save_models(tmp_path)
    rows = [{"prompt": " ".join(WORDS[i % 5: i % 5 + 3])} for i in range(6)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    proc = run_lab("run", "12_infalign", "-p", "model", str(tmp_path / "policy"), "-p", "reward_model",
                   str(tmp_path / "rm"), "-p", "data", str(tmp_path / "prompts.jsonl"), "-p", "n_prompts", "4",
                   "-p", "K", "8", "-p", "M", "32", "-p", "max_new_tokens", "6", "--out", str(tmp_path / "out"),
                   "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "12_infalign.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    got = rec["metrics"]["checkpoint"]
    assert got["prompts"] == 4 and got["K"] == 8
    assert set(got["win rate at matched KL"]) == {"standard", "BON-4", "WON-4"}
    row = got["win rate at matched KL"]["BON-4"]
    reached = [v for v in row.values() if v is not None]  # None: a budget beyond the support's frontier
    assert reached and all(0 <= v <= 1 for v in reached)
    proc = run_lab("run", "12_infalign", "-p", "model", str(tmp_path / "policy"), "--out", str(tmp_path / "o2"))
    assert proc.returncode == 2 and "needs a reward model and prompts" in proc.stderr, proc.stderr[-2000:]
