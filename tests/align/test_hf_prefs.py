"""lab.align.hf_prefs: tokenization, log-probs, the disabled-adapter reference, training, KL and win rate on a
tiny Llama; the 01 EXPO (pairs) and 11 HPS (ranked responses) notebooks on a saved tiny checkpoint and a JSONL."""

import json

import pytest
import torch

from lab.align import LOSSES
from lab.align import hf_batch as hb
from lab.align import hf_prefs as hp
from lab.align.tokens import token_dists, token_kl
from lab.models import load_reward_model
from lab.models.tokenizer import word_tokenizer
from lab.models.zoo import tiny_llama

WORDS = ["a", "b", "c", "d"] + [f"w{i}" for i in range(12)]


@pytest.fixture
def tok():
    return word_tokenizer(WORDS)  # <pad>=0 <unk>=1 <bos>=2 <eos>=3, a=4, b=5, c=6, d=7


def tiny(tok, seed=0):
    torch.manual_seed(seed)
    return tiny_llama(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4).eval()


def pairs(n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pick = lambda k: " ".join(f"w{int(i)}" for i in torch.randint(0, 12, (k,), generator=g))
    return [{"prompt": pick(3), "chosen": "a b c", "rejected": "d " + pick(2)} for _ in range(n)]


def test_tokenize_hand_computed(tok):
    b = hb.tokenize(tok, [{"prompt": "a b", "chosen": "c", "rejected": "d c d"}])
    assert b["input_ids"].tolist() == [[[4, 5, 6, 3, 0, 0], [4, 5, 7, 6, 7, 3]]]  # prompt | response EOS | pad
    assert b["attention_mask"].tolist() == [[[1, 1, 1, 1, 0, 0], [1] * 6]]
    assert b["response_mask"].tolist() == [[[0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]]
    assert b["rewards"].tolist() == [[1.0, 0.0]]
    # truncation keeps the prompt's end and the response's start
    b = hb.tokenize(tok, [{"prompt": "a b c", "chosen": "d a", "rejected": "b"}], max_len=4, max_prompt_len=2)
    assert b["input_ids"].tolist() == [[[5, 6, 7, 4], [5, 6, 5, 3]]]
    assert b["response_mask"].tolist() == [[[0, 0, 1, 1], [0, 0, 1, 1]]]
    # ranked rows keep their order and rewards
    b = hb.tokenize(tok, [{"prompt": "a", "responses": ["b", "c c", "d"], "rewards": [2.0, 1.0, 0.0]}])
    assert b["input_ids"].shape == (1, 3, 4) and b["rewards"].tolist() == [[2.0, 1.0, 0.0]]


def test_chat_prompt_without_template(tok):
    assert hb.render_prompt(tok, [{"role": "user", "content": "a"}]) == "user: a\nassistant: "


def test_sequence_logprobs_match_a_naive_loop(tok):
    model, rows = tiny(tok), pairs(5)
    rows[0]["rejected"] = "d"  # unequal lengths: padding inside the batch
    got = hp.row_logprobs(model, tok, rows, None, batch_size=3)  # (5, 2)
    for i, row in enumerate(rows):
        p = tok(row["prompt"])["input_ids"]
        for k, y in enumerate((row["chosen"], row["rejected"])):
            ids = p + tok(y)["input_ids"] + [3]
            with torch.no_grad():
                logp = model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
            naive = sum(logp[t - 1, ids[t]].item() for t in range(len(p), len(ids)))
            assert got[i, k].item() == pytest.approx(naive, abs=1e-4)


def test_disabled_adapter_is_the_base_model(tok):
    model, rows = tiny(tok), pairs(4)
    base = hp.row_logprobs(model, tok, rows, None)
    peft_model = hp.add_adapter(model, hp.Config(lora_r=4), "arm")
    assert torch.allclose(hp.row_logprobs(peft_model, tok, rows, "arm"), base, atol=1e-5)  # B = 0 at init
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert not torch.allclose(hp.row_logprobs(peft_model, tok, rows, "arm"), base, atol=1e-3)
    assert torch.allclose(hp.row_logprobs(peft_model, tok, rows, None), base, atol=1e-5)
    assert sum(p.numel() for n, p in peft_model.named_parameters() if p.requires_grad and "lora_" not in n) == 0


def test_dpo_steps_raise_the_training_margin(tok):
    rows = pairs(16)
    model, losses = hp.train(tiny(tok), tok, rows, hp.Config(steps=15, lr=5e-3, batch_size=4), name="dpo", quiet=True)
    m = hp.evaluate(model, tok, rows, ["dpo"], hp.Config(beta=0.1, n_samples=1, max_new_tokens=4))
    assert m["reference"]["margin"] == 0.0 and m["dpo"]["margin"] > 0.1 and m["dpo"]["margin accuracy"] == 1.0
    assert losses[-1] < losses[0]


def test_a_mixed_precision_arm_is_evaluated_without_autocast(tok, fresh_accelerate):
    """accelerate's mixed precision wraps the prepared model's forward in autocast (bf16 here, on CPU); the trained arm
    comes back without it, so it is scored at the precision of the base model and the reference."""
    rows = pairs(8)
    model, _ = hp.train(tiny(tok), tok, rows, hp.Config(steps=2, lr=5e-3, batch_size=4, mixed_precision="bf16"),
                        name="dpo", quiet=True)
    ids = torch.tensor([[2, 4, 5, 6]])
    with torch.no_grad():
        out = model(input_ids=ids).logits
        with model.disable_adapter():
            ref = model(input_ids=ids).logits
    assert "_original_forward" not in vars(model) and out.dtype == torch.float32
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # what the wrapper would have computed
        bf16 = model(input_ids=ids).logits.float()
    assert (out - bf16).abs().max() > 1e-4 and torch.isfinite(ref).all()


def test_every_registry_loss_trains(tok):
    rows = pairs(8)
    ranked = [{"prompt": r["prompt"], "responses": [r["chosen"], "b b", r["rejected"]], "rewards": [1.0, 0.5, 0.0]}
              for r in rows]
    model = tiny(tok)
    for loss in LOSSES:
        data = ranked if loss in ("pl", "hps") else rows
        model, losses = hp.train(model, tok, data, hp.Config(loss=loss, steps=2, batch_size=4), name=loss, quiet=True)
        assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    # HPS on plain pairs: rewards (1, 0), one negative, so it is DPO with label smoothing ε (same arm, same init)
    a, _ = hp.train(tiny(tok), tok, rows, hp.Config(loss="hps", steps=3, seed=1), name="x", quiet=True)
    b, _ = hp.train(tiny(tok), tok, rows, hp.Config(loss="dpo", steps=3, seed=1), name="x", quiet=True)
    assert torch.allclose(hp.row_logprobs(a, tok, rows, "x"), hp.row_logprobs(b, tok, rows, "x"), atol=1e-5)


def test_sampled_kl_matches_an_unpadded_token_kl(tok):
    rows = pairs(6)
    model, _ = hp.train(tiny(tok), tok, rows, hp.Config(steps=10, lr=1e-2), name="arm", quiet=True)
    samples = hp.sample(model, tok, [r["prompt"] for r in rows[:3]], None, n=2, max_new_tokens=5, seed=0)
    assert len(samples) == 6 and all(0 < len(y) <= 5 for _, y in samples)
    kl = hp.sampled_kl(model, samples, "arm", batch_size=4)
    for (p, y), got in zip(samples, kl):
        x, y = torch.tensor([p]), torch.tensor([y])
        with torch.no_grad(), model.disable_adapter():
            ref = token_dists(model, x, y)
        with torch.no_grad():
            want = token_kl(ref, token_dists(hp.use(model, "arm"), x, y))
        assert got.item() == pytest.approx(want.item(), rel=1e-4, abs=1e-6)
    assert kl.mean() > 0
    # the reference's samples are the adapter-free model's (same seed, same draws)
    base = tiny(tok)
    assert hp.sample(base, tok, [r["prompt"] for r in rows[:3]], None, n=2, max_new_tokens=5, seed=0) == samples


def test_win_rate_ties_for_an_untrained_arm(tok, tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                                    num_hidden_layers=1, num_attention_heads=2, num_labels=1,
                                                    pad_token_id=0))
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm, rm_tok = load_reward_model(str(tmp_path / "rm"))
    model = hp.add_adapter(tiny(tok), hp.Config(), "arm")  # B = 0: the arm samples what the reference samples
    prompts = [r["prompt"] for r in pairs(4)]
    assert hp.win_rate(model, tok, prompts, "arm", rm, rm_tok, max_new_tokens=4) == 0.5
    scores = hp.reward_scores(rm, rm_tok, ["a b", "c d d"])
    assert scores.shape == (2,) and scores[0] != scores[1]


def save_checkpoint(tmp_path, ranked=False):
    """A tiny Llama + word tokenizer folder and a JSONL of 24 pairs (or of 24 prompts with 3 ranked responses)."""
    from ..conftest import save_tiny_lm

    save_tiny_lm(tmp_path / "ckpt", WORDS, d_model=32, n_layers=2, n_heads=4)
    rows = pairs(24)
    if ranked:  # unsorted on purpose: the loader ranks them
        rows = [{"prompt": r["prompt"], "responses": [r["rejected"], r["chosen"], "b b"], "rewards": [-1.0, 1.0, 0.2]}
                for r in rows]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(tmp_path / "ckpt"), str(tmp_path / "prefs.jsonl")


@pytest.mark.notebook
@pytest.mark.timeout(300)
@pytest.mark.parametrize("stem, arms, ranked", [("01_expo", ("EXPO", "DPO", "IPO"), False),
                                                ("11_hps", ("HPS", "DPO"), True)])
def test_checkpoint_path_measures_every_arm(tmp_path, stem, arms, ranked):
    """model=<folder>, data=<.jsonl>: LoRA arms trained on a saved tiny Llama, measured and recorded, no claim
    (01 on pairs; 11 on ranked responses, HPS's setting)."""
    from ..conftest import run_lab

    model, data = save_checkpoint(tmp_path, ranked)
    proc = run_lab("run", stem, "-p", "model", model, "-p", "data", data, "-p", "max_len", "32",
                   "-p", "steps", "10", "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / f"{stem}.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    metrics = rec["metrics"]["checkpoint"]
    assert set(metrics) == {"reference", *arms}
    for arm in arms:
        assert set(metrics[arm]) >= {"margin", "margin accuracy", "logp accuracy", "KL(π_ref‖π_θ)"}
        assert metrics[arm]["KL(π_ref‖π_θ)"] > 0 and metrics[arm]["margin"] > 0
    assert metrics["reference"]["margin"] == 0.0 and metrics["reference"]["KL(π_ref‖π_θ)"] == 0.0


def test_config_for_scale():
    assert hp.Config.for_scale("smoke", steps=None, beta=0.5) == hp.Config(beta=0.5)
    full = hp.Config.for_scale("full", "cuda", steps=7)
    assert full.steps == 7 and full.grad_accum == 4 and full.mixed_precision == "bf16" and full.prompt_len == 256


def test_max_min_pairs():
    rows = [{"prompt": "p", "responses": ["a", "b", "c"], "rewards": [3.0, 2.0, 1.0]},
            {"prompt": "q", "chosen": "x", "rejected": "y"}]
    assert hp.max_min_pairs(rows) == [{"prompt": "p", "chosen": "a", "rejected": "c"}, rows[1]]


def test_preference_rows_read_ranked_rows_or_pairs_or_sample_and_score_a_pool(tmp_path):
    """Ranked rows and pairs are read as `lab.data.load` reads them; prompts alone need a reward model, and then K
    responses per prompt are sampled from the policy, scored and ranked best first."""
    from lab.align.infalign_checkpoint import score
    from lab.core.params import ParamError
    from lab.models import load_model

    from .test_infalign_checkpoint import WORDS, _save_models

    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}))
    assert hp.preference_rows(str(tmp_path / "pairs.jsonl"), n=1) == [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    with pytest.raises(ParamError, match="no 'responses'/'rewards' columns"):
        hp.preference_rows(str(tmp_path / "pairs.jsonl"), n=1, ranked=True)
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": w}) for w in WORDS[:3]))
    with pytest.raises(ParamError, match="or 'chosen'/'rejected'"):
        hp.preference_rows(str(tmp_path / "prompts.jsonl"), n=3)
    _save_models(tmp_path)
    policy, tok = load_model(str(tmp_path / "policy"))
    rm, rm_tok = load_reward_model(str(tmp_path / "rm"))
    rows = hp.preference_rows(str(tmp_path / "prompts.jsonl"), n=3, policy=policy, tokenizer=tok, reward_model=rm,
                              rm_tokenizer=rm_tok, N=4, max_new_tokens=3)
    assert len(rows) == 3 and all(len(r["responses"]) == len(r["rewards"]) == 4 for r in rows)
    assert all(r["rewards"] == sorted(r["rewards"], reverse=True) for r in rows)  # best first
    again = score(rm, rm_tok, [r["prompt"] for r in rows], [r["responses"] for r in rows])
    assert torch.allclose(again, torch.tensor([r["rewards"] for r in rows], dtype=torch.float64))


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_hps_checkpoint_samples_its_own_ranked_responses_from_prompts(tmp_path):
    """11 on a prompts-only file with a reward model: K = 4 responses per prompt sampled and scored, then both arms."""
    from ..conftest import run_lab
    from .test_infalign_checkpoint import WORDS, _save_models

    _save_models(tmp_path)
    prompts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(3)) for i in range(12)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts))
    proc = run_lab("run", "11_hps", "-p", "model", str(tmp_path / "policy"), "-p", "data",
                   str(tmp_path / "prompts.jsonl"), "-p", "reward_model", str(tmp_path / "rm"), "-p", "n_rows", "12",
                   "-p", "held_out", "4", "-p", "max_len", "32", "-p", "steps", "4", "--out", str(tmp_path / "out"),
                   "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "11_hps.json").read_text())["metrics"]["checkpoint"]
    assert set(metrics) == {"reference", "HPS", "DPO"} and "win rate" in " ".join(metrics["HPS"])
