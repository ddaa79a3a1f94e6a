"""TLM on a checkpoint: the accelerate loop against `lab.adapt.loop.adapt`, the target rows of each data format,
the answer match, the held-out metrics against naive unpadded loops, and notebook 03 run end to end on a tiny saved
model."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from lab.adapt import loop as L
from lab.adapt import tlm as T
from lab.adapt import tlm_checkpoint as tc
from lab.core.params import ParamError
from tests.adapt.tiny import V, model

WORDS = "the a cat dog sat ran on mat fast slow good bad".split()


def test_lr_scale_by_hand():
    # 20 steps: warm-up over 2, then cosine from step 2 (1.0) to 0 at step 20
    assert [tc.lr_scale(s, 20) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert tc.lr_scale(11, 20) == pytest.approx(0.5)
    assert tc.lr_scale(7, 20, schedule="constant") == 1.0


def test_adapt_through_accelerate_equals_the_loop():
    inputs = [torch.randint(V, (1, 6 + i % 3), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    runs = []
    for fn in (L.adapt, tc.adapt):
        m = T.add_lora(model())
        with torch.no_grad():
            ce0 = [T.sample_ce(m, x).item() for x in inputs]
        objective = T.tlm_objective(threshold=sorted(ce0)[3], lamb=0.1, base_ce=T.base_ce(m))
        log = fn(m, inputs, objective, lr=1e-2, quiet=True)
        runs.append((log, {n: p.detach().clone() for n, p in m.named_parameters() if "lora_" in n}))
    (ref, w_ref), (got, w_got) = runs
    assert got.selected == ref.selected and sum(got.selected) == 4 and got.backward_passes == 4
    assert got.losses == pytest.approx(ref.losses)
    assert w_got.keys() == w_ref.keys() and all(torch.allclose(w_got[n], w_ref[n], atol=1e-6) for n in w_ref)
    assert any(w.abs().sum() > 0 for n, w in w_got.items() if "lora_B" in n)  # it did move


def test_a_mixed_precision_adaptation_leaves_no_autocast_behind(fresh_accelerate):
    """Under mixed precision (bf16 here, on CPU) accelerate wraps the model's forward in autocast; `adapt` removes
    it, so each arm is scored at the precision the base model was."""
    m = T.add_lora(model())
    inputs = [torch.randint(V, (1, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    objective = T.tlm_objective(threshold=0.0, lamb=0.1, base_ce=T.base_ce(m))
    tc.adapt(m, inputs, objective, lr=1e-2, mixed_precision="bf16", quiet=True)
    x = inputs[0]
    with torch.no_grad():
        out = m(input_ids=x).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = m(input_ids=x).logits.float()
    assert "_original_forward" not in vars(m) and (out - bf16).abs().max() > 1e-4


def test_target_rows_of_text_problems_and_alpaca(tmp_path):
    (tmp_path / "t.txt").write_text("one line\n\nanother line\n")
    assert sorted(r["input"] for r in tc.target_rows(str(tmp_path / "t.txt"), n=5)) == ["another line", "one line"]
    assert all(r["answer"] is None for r in tc.target_rows(str(tmp_path / "t.txt"), n=5))
    (tmp_path / "p.jsonl").write_text("\n".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) for i in range(4)))
    rows = tc.target_rows(str(tmp_path / "p.jsonl"), n=3, seed=1)
    assert len(rows) == 3 and all(r["answer"] == "a" + r["input"][1:] for r in rows)
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"instruction": "Name it.", "input": "a river", "output": "Nile"},
        {"instruction": "Say hi.", "input": "", "output": "hi"}]))
    got = sorted(tc.target_rows(str(tmp_path / "a.jsonl"), n=9), key=lambda r: r["answer"])
    assert got == [{"input": "Name it.\na river", "answer": "Nile"}, {"input": "Say hi.", "answer": "hi"}]
    (tmp_path / "bad.jsonl").write_text(json.dumps({"foo": "x"}))
    with pytest.raises(ParamError, match="none of the input columns"):
        tc.target_rows(str(tmp_path / "bad.jsonl"), n=1)
    with pytest.raises(ParamError, match="pass -p data"):
        tc.target_rows("", n=1)


def test_exact_match_by_hand():
    assert tc.exact_match("so she pays 1234 dollars.", "48 + 1186 = 1234\n#### 1,234")
    assert not tc.exact_match("1234 then 12", "#### 1234")  # the last number counts
    assert tc.exact_match("  The Nile. ", "the nile")
    assert not tc.exact_match("the nile river", "the nile")
    assert tc.exact_match("12 apples; #### 7 left, so 8 tomorrow", "#### 7")  # the prediction's own marker counts
    assert tc.exact_match("so \\boxed{3.50} in all", "\\boxed{3.5}") and not tc.exact_match("none", "#### 3")


def _saved(tmp_path):
    from lab.models.tokenizer import word_tokenizer
    from lab.models.zoo import tiny_llama

    tok = word_tokenizer(WORDS)
    torch.manual_seed(0)
    tiny_llama(vocab_size=len(tok), d_model=32, n_layers=2, n_heads=4).save_pretrained(tmp_path / "lm")
    tok.save_pretrained(tmp_path / "lm")
    return tmp_path / "lm"


def _sentence(g, k):
    return " ".join(WORDS[j] for j in torch.randint(len(WORDS), (k,), generator=g).tolist())


def test_scores_equal_naive_unpadded_loops(tmp_path):
    from lab.models import load_model

    net, tok = load_model(str(_saved(tmp_path)))
    g = torch.Generator().manual_seed(0)
    held = [{"input": _sentence(g, 3 + i), "answer": _sentence(g, 1 + i % 3)} for i in range(5)]
    cfg = tc.Config(max_new_tokens=4, batch_size=2)  # batches of unequal lengths: padding must not leak
    orig = torch.randint(4, len(tok), (3, 6), generator=g)
    got = tc.scores(net, tok, held, cfg, orig)
    ce, nll, count, em, preds = [], 0.0, 0, 0, []
    with torch.no_grad():
        for r in held:
            x = tok(r["input"])["input_ids"]
            a = tok(r["answer"])["input_ids"] + [tok.eos_token_id]
            logp = net(input_ids=torch.tensor([x + a])).logits[0].log_softmax(-1)
            ce.append(-sum(logp[t, x[t + 1]] for t in range(len(x) - 1)).item() / (len(x) - 1))
            nll -= sum(logp[len(x) - 1 + t, a[t]] for t in range(len(a))).item()
            count += len(a)
            y = list(x)
            for _ in range(4):  # greedy, one token at a time
                y.append(int(net(input_ids=torch.tensor([y])).logits[0, -1].argmax()))
            new = y[len(x):]
            pred = tok.decode(new[:new.index(tok.eos_token_id)] if tok.eos_token_id in new else new,
                              skip_special_tokens=True)
            preds.append(pred)
            em += tc.exact_match(pred, r["answer"])
        orig_ce = [T.sample_ce(net, b[None]).item() for b in orig]
    assert got["input PPL"] == pytest.approx(math.exp(sum(ce) / len(ce)), rel=1e-4)
    assert got["output PPL"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert got["exact match"] == em / len(held)
    assert tc.greedy(net, tok, [tok(r["input"])["input_ids"] for r in held], max_new_tokens=4, batch_size=2) == preds
    assert got["orig PPL"] == pytest.approx(math.exp(sum(orig_ce) / 3), rel=1e-4)


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_notebook_on_a_saved_model_and_inputs_is_measured(tmp_path):
    from ..conftest import run_lab

    lm = _saved(tmp_path)
    g = torch.Generator().manual_seed(1)
    rows = [{"question": _sentence(g, 6), "answer": _sentence(g, 2)} for _ in range(24)]
    (tmp_path / "target.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "orig.txt").write_text("\n".join(_sentence(g, 12) for _ in range(20)))
    proc = run_lab("run", "03_tlm", "-p", "model", str(lm), "-p", "data", str(tmp_path / "target.jsonl"),
                   "-p", "orig_data", str(tmp_path / "orig.txt"), "-p", "n_inputs", "16", "-p", "held_out", "8",
                   "-p", "log_p0", "0", "-p", "adapt_lr", "0.01", "-p", "tent_tokens", "2",
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "03_tlm.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    assert ck["inputs"] == {"adapted": 16, "held out": 8, "with answers": True}
    arms = ck["arms"]
    assert set(arms) == {"base", "TLM", "TLM w/o SEL", "Tent", "COME"}
    assert set(arms["TLM"]) == {"input PPL", "output PPL", "exact match", "ROUGE-L", "orig PPL", "backward passes"}
    assert {arms[a]["backward passes"] for a in ("TLM w/o SEL", "Tent", "COME")} == {16}
    assert arms["TLM"]["backward passes"] == round(16 * ck["selected by the base model"]) < 16  # SEL skips
    assert arms["TLM w/o SEL"]["input PPL"] != arms["base"]["input PPL"]  # it adapted


def test_study_keeps_the_base_and_refuses_bad_input(tmp_path):
    from lab.models import load_model

    net, tok = load_model(str(_saved(tmp_path)))
    g = torch.Generator().manual_seed(2)
    rows = [{"input": _sentence(g, 5), "answer": None} for _ in range(10)]
    cfg = tc.Config(held_out=4, log_p0=0.0, select_frac=0.5, lr=1e-2, tent_tokens=0)
    with pytest.raises(ParamError, match="more than held_out"):
        tc.study(net, tok, rows[:4], cfg)
    with pytest.raises(ParamError, match="no tokenizer"):
        tc.study(net, None, rows, cfg)
    with pytest.raises(ParamError, match="no c_attn layers"):
        tc.study(net, tok, rows, replace(cfg, targets=("q_proj", "v_proj", "c_attn")))
    net, ck = tc.study(net, tok, rows, cfg, quiet=True)
    assert set(ck["arms"]) == {"base", "TLM", "TLM w/o SEL"} and set(ck["arms"]["base"]) == {"input PPL"}
    assert ck["arms"]["TLM"]["backward passes"] == 3 and ck["arms"]["TLM w/o SEL"]["backward passes"] == 6
    with tc.active(net, None):  # the arms live in their adapters; the base model is untouched
        assert tc.scores(net, tok, rows[-4:], cfg) == pytest.approx(ck["arms"]["base"])
    with tc.active(net, "TLM"):
        assert tc.scores(net, tok, rows[-4:], cfg) == pytest.approx({"input PPL": ck["arms"]["TLM"]["input PPL"]})
