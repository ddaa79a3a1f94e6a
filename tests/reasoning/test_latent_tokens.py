"""Token Assorted: the automaton task, the VQ-VAE quantizer, mixed-trace construction, constrained decoding and
scoring, each against an independent reference; the widgets; the checkpoint path through the runner."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
import torch

from lab.data.automaton import Automaton
from lab.models.tokenizer import word_tokenizer
from lab.models.zoo import tiny_llama
from lab.reasoning import latent_tokens as lt
from lab.reasoning import latent_tokens_study as lts

CFG = replace(lt.Config(), vq_steps=2)


def test_automaton_states_follow_the_maps_and_text_matches_the_tokenizer():
    task = Automaton(n_states=4, n_actions=3, n_steps=5, seed=1)
    ex = task.sample(20, torch.Generator().manual_seed(0))
    for i in range(20):  # naive loop over the permutations
        s = int(ex["start"][i])
        for t in range(task.n_steps):
            s = int(task.perms[ex["actions"][i, t], s])
            assert s == int(ex["states"][i, t])
    P, C, S = task.encode(ex)
    tok = word_tokenizer(task.words)
    a, st = ex["actions"][0].tolist(), ex["states"][0].tolist()
    text = (f"<bos> start s{int(ex['start'][0])} | " + " ".join(f"T{t + 1}=a{a[t]}" for t in range(5)) + " | ? "
            + " ".join(f"T{t + 1} -> s{st[t]} ;" for t in range(5)) + f" ans s{st[-1]} <eos>")
    assert torch.cat([P[0], C[0], S[0]]).tolist() == tok(text, add_special_tokens=False)["input_ids"]
    assert sorted(task.perms[0].tolist()) == list(range(4))


def test_held_out_problems_are_never_drawn_for_training():
    task = Automaton(n_states=4, n_actions=4, n_steps=5)
    every = [(s, a) for s in range(4) for a in itertools.product(range(4), repeat=5)]  # all 4,096
    start, actions = torch.tensor([s for s, _ in every]), torch.tensor([a for _, a in every])
    assert sorted(task.index(start, actions).tolist()) == list(range(4096))  # a bijection onto 0..4095
    test = {(int(s), tuple(a.tolist())) for s, a, h in zip(start, actions, task.held_out(start, actions)) if h}
    assert 0.17 < len(test) / 4096 < 0.23  # about one in five
    g = torch.Generator().manual_seed(0)
    drawn = {split: task.sample(3000, g, split=split) for split in ("train", "test", "all")}
    as_set = lambda ex: {(int(s), tuple(a.tolist())) for s, a in zip(ex["start"], ex["actions"])}
    assert not as_set(drawn["train"]) & test and as_set(drawn["test"]) <= test
    assert len(as_set(drawn["all"]) & test) > 300 and len(drawn["test"]["start"]) == 3000
    with pytest.raises(ValueError, match="split"):
        task.sample(1, g, split="val")


def test_chunks_of_pads_the_last_chunk():
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    assert lt.chunks_of(x, 4, pad=0).tolist() == [[1, 2, 3, 4], [5, 6, 0, 0]]


def test_codes_are_the_nearest_codebook_entries():
    torch.manual_seed(0)
    vq = lt.VQVAE(CFG, CFG.task.vocab_size)
    ch, P = lt.vq_batch(CFG.task, 16, CFG.L, torch.Generator().manual_seed(0))
    vq.train()
    vq(ch, P)  # k-means initialisation on the first batch
    codes = vq.codes(ch).flatten().tolist()
    x = vq.x_bar(ch).detach().reshape(-1, CFG.d_latent)
    E = vq.q.codebook.reshape(-1, CFG.d_latent)
    for xi, c in zip(x, codes):  # naive loop over the codebook: the chosen entry is a nearest one
        d = [float(((xi - E[k]) ** 2).sum()) for k in range(len(E))]
        assert d[c] <= min(d) + 1e-5
    assert len(set(codes)) > 10


def test_code_table_is_what_encoding_a_trace_gives():
    torch.manual_seed(0)
    vq = lt.VQVAE(CFG, CFG.task.vocab_size)
    vq(*lt.vq_batch(CFG.task, 4, CFG.L, torch.Generator().manual_seed(0)))
    table = lt.code_table(vq, CFG)
    ex = CFG.task.sample(6, torch.Generator().manual_seed(1))
    _, C, _ = CFG.task.encode(ex)
    direct = vq.codes(lt.chunks_of(C, CFG.L)).view(6, CFG.task.n_steps, CFG.n_z)
    assert torch.equal(direct, table[torch.arange(CFG.task.n_steps), ex["states"]])


@pytest.mark.parametrize("r", [4, 1])
def test_mixed_trace_round_trip(r):
    """X̃ built by id surgery equals the one spelled out by hand, and mapping its latents back through the code
    table (chunk -> code is a bijection on a collision-free table) restores X."""
    cfg = replace(CFG, r=r)
    t = cfg.task
    ex = t.sample(3, torch.Generator().manual_seed(2))
    P, C, S = t.encode(ex)
    n_z, n = cfg.n_z, t.n_steps
    size = n * t.n_states * n_z  # an injective code table: every chunk its own codes
    table = torch.randperm(size, generator=torch.Generator().manual_seed(0)).view(n, t.n_states, n_z)
    cfg = replace(cfg, K=size)
    v = lt.vocab_of(cfg)
    for i in range(3):
        z = table[torch.arange(n), ex["states"][i]].flatten()
        for k in range(n + 1):
            x = lt.mix_trace(P[i], C[i], S[i], z, k, L=cfg.L, vocab=v)
            hand = P[i].tolist() + ([v.bol] + [v.first_latent + int(c) for c in z[: k * n_z]] + [v.eol] if k else [])
            hand += C[i, k * cfg.L:].tolist() + S[i].tolist()
            assert x.tolist() == hand
            assert len(x) == len(P[i]) + (2 + k * n_z if k else 0) + len(C[i]) - k * cfg.L + len(S[i])
            # back: each group of n_z latents -> its chunk
            inv = {tuple(table[tt, s].tolist()): (tt, s) for tt in range(n) for s in range(t.n_states)}
            lat = [int(c) - v.first_latent for c in x if int(c) >= v.first_latent]
            back = []
            for j in range(0, len(lat), n_z):
                tt, s = inv[tuple(lat[j:j + n_z])]
                back += [t.ids[f"T{tt + 1}"], t.ids["->"], t.ids[f"s{s}"], t.ids[";"]]
            assert back + C[i, k * cfg.L:].tolist() == C[i].tolist()


def test_trace_task_batches_mask_the_prompt_and_padding():
    codes = tuple(range(CFG.task.n_steps * CFG.task.n_states))
    b = lt.TraceTask.of(CFG, "latent", codes).batch(16, torch.Generator().manual_seed(0))
    plen = CFG.task.n_steps + 6
    assert (b["labels"][:, :plen] == -100).all()
    pad = b["input_ids"] == 0
    assert (b["labels"][pad] == -100).all() and (b["labels"][~pad][:, None] != -100).any()
    assert (b["input_ids"][:, plen:] == lt.vocab_of(CFG).bol).any()  # some examples have a latent segment
    sol = lt.TraceTask.of(CFG, "sol").batch(4, torch.Generator().manual_seed(0))
    assert sol["input_ids"].shape[1] == plen + 3
    shuf = lt.TraceTask.of(replace(CFG, shuffled=True), "latent", codes)
    assert shuf.shuffled and lt.TraceTask.of(CFG, "cot") == lt.TraceTask.of(replace(CFG, shuffled=True), "cot")
    # Pause (Goyal et al.): the CoT example with every trace token replaced by <pause>, no loss on prompt or pauses
    cot = lt.TraceTask.of(CFG, "cot").batch(4, torch.Generator().manual_seed(1))
    pau = lt.TraceTask.of(CFG, "pause").batch(4, torch.Generator().manual_seed(1))
    n_c = cot["input_ids"].shape[1] - plen - 3  # the trace's length
    assert pau["input_ids"].shape == cot["input_ids"].shape
    assert (pau["input_ids"][:, plen:plen + n_c] == lt.vocab_of(CFG).bol).all()
    assert torch.equal(pau["input_ids"][:, :plen], cot["input_ids"][:, :plen])
    assert torch.equal(pau["input_ids"][:, plen + n_c:], cot["input_ids"][:, plen + n_c:])
    assert (pau["labels"][:, :plen + n_c] == -100).all() and torch.equal(pau["labels"][:, plen + n_c:],
                                                                         cot["labels"][:, plen + n_c:])


class _Prefers(torch.nn.Module):
    """A stub LM whose next-token logits rank ids by a fixed preference (highest first)."""

    def __init__(self, order: list[int], V: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.logits = torch.zeros(V)
        for rank, i in enumerate(order):
            self.logits[i] = 100.0 - rank
        self.config = type("C", (), {"vocab_size": V})()

    def forward(self, input_ids, cache=None, use_cache=True):
        out = type("O", (), {})()
        out.logits = self.logits.expand(len(input_ids), input_ids.shape[1], -1).clone()
        out.cache = None
        return out


def test_generate_obeys_the_grammar_and_forced_m():
    v = lt.vocab_of(CFG)
    lat = v.first_latent + 5
    stub = _Prefers([lat, v.bol, v.eol, 7, v.eos], v.size)
    P = torch.zeros(2, 3, dtype=torch.long)
    free = lts.generate(stub, P, v, latent=True, max_new=6)[0].tolist()
    assert free[0] == v.bol and free[1:] == [lat] * 5  # latents only after <boLatent>
    forced = lts.generate(stub, P, v, latent=True, force_codes=3, max_new=8)[0].tolist()
    assert forced[:6] == [v.bol, lat, lat, lat, v.eol, 7]
    none = lts.generate(stub, P, v, latent=True, force_codes=0, max_new=3)[0].tolist()
    text = lts.generate(stub, P, v, latent=False, max_new=3)[0].tolist()
    assert none == text == [7, 7, 7]


def test_generate_with_cache_equals_naive_greedy():
    torch.manual_seed(0)
    v = lt.vocab_of(CFG)
    model = tiny_llama(vocab_size=v.n_text, d_model=32, n_layers=1, n_heads=2, max_len=64).eval()
    P = torch.randint(4, v.n_text, (3, 5))
    got = lts.generate(model, P, v, latent=False, max_new=6)
    x = P.clone()
    for _ in range(6):  # full recompute, argmax over text ids
        nxt = model(x).logits[:, -1].argmax(-1)
        x = torch.cat([x, nxt[:, None]], 1)
    ref = x[:, 5:]
    for i in range(3):  # after <eos> the cached path pads
        stop = (ref[i] == v.eos).nonzero()
        n = int(stop[0]) + 1 if len(stop) else 6
        assert got[i, :n].tolist() == ref[i, :n].tolist()


def test_score_by_hand():
    v = lt.vocab_of(CFG)
    a, s1, s2 = v.ans, 15, 16
    gen = torch.tensor([[5, a, s1, v.eos, 0], [a, s2, v.eos, 0, 0], [5, 5, 5, 5, 5]])
    r = lts.score(gen, torch.tensor([s1, s1, s1]), v)
    assert r["correct"].tolist() == [True, False, False]
    assert r["length"].tolist() == [4, 3, 5] and r["acc"] == pytest.approx(1 / 3)


def test_extend_vocab_adds_rows_and_tokens():
    torch.manual_seed(0)
    tok = word_tokenizer(["a", "b"])
    model = tiny_llama(vocab_size=len(tok), d_model=16, n_layers=1, n_heads=2)
    old = model.get_input_embeddings().weight.detach().clone()
    lt.extend_vocab(model, 3, tok, ["<x0>", "<x1>", "<x2>"])
    assert len(tok) == 9 and model.get_input_embeddings().num_embeddings == 9
    assert model.get_output_embeddings().weight.shape[0] == 9
    assert torch.equal(model.get_input_embeddings().weight[:6], old)
    assert tok.convert_tokens_to_ids("<x2>") == 8


def test_widgets_follow_their_controls():
    from lab.widgets.latent_tokens import example_explorer, frontier_explorer, frontier_figure

    front = {k: (10.0 + k, 0.5 + k / 10) for k in range(4)}
    pts = {"CoT": (20.0, 0.9), "Sol-Only": (3.0, 0.3)}
    fig = frontier_figure(pts, front)
    assert len(fig.layout.sliders[0].steps) == 4
    box = frontier_explorer(pts, front)
    box.controls[0].value = 1
    assert box.selected == front[1]
    rows = [{"prompt": "p", "generated": ["<bol>", "<z3>", "<eol>", "ans"], "decoded": ["T1 -> s2 ;"],
             "correct": True}, {"prompt": "q", "generated": ["ans"], "decoded": [], "correct": False}]
    ex = example_explorer(rows)
    assert "T1 -&gt; s2 ;" in ex.html and "✓" in ex.html
    ex.controls[0].value = 1
    assert "✗" in ex.html


def test_new_token_rows_are_drawn_around_the_mean_even_in_a_padded_matrix():
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=40, d_model=16, n_layers=1, n_heads=2)  # 40 rows; pretend the tokenizer has 30
    emb, out = m.get_input_embeddings().weight, m.get_output_embeddings().weight  # untied: both matrices
    assert emb.data_ptr() != out.data_ptr()
    spare, spare_out = emb[30:33].clone(), out[30:33].clone()
    lts.new_rows(m, [30, 31, 32], 30, seed=0)
    for w, before in ((emb, spare), (out, spare_out)):
        mean, std = w[:30].mean(0), w[:30].std(0)
        assert not torch.allclose(w[30:33], before)
        assert ((w[30:33] - mean).abs() <= 0.6 * std + 1e-6).all()  # 0.1·std noise: within 6 of its s.d.


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_checkpoint_folder_is_fine_tuned_on_mixed_traces_saved_and_reloads(tmp_path):
    """model=<folder>, data=<GSM8K-style .jsonl>: latent tokens added, fine-tuned, written to out_dir, reloaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..conftest import run_lab, save_tiny_lm

    words = [f"w{i}" for i in range(20)] + ["####"]
    tok = word_tokenizer(words)
    save_tiny_lm(tmp_path / "ckpt", tok, d_model=32, n_layers=1, n_heads=2)
    g = torch.Generator().manual_seed(0)
    w = lambda n: " ".join(f"w{int(i)}" for i in torch.randint(20, (n,), generator=g))
    rows = [{"question": w(6), "answer": f"{w(12)} #### {w(1)}"} for _ in range(40)]
    (tmp_path / "gsm.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    proc = run_lab("run", "08_latent_tokens", "-p", "model", str(tmp_path / "ckpt"), "-p", "data",
                   str(tmp_path / "gsm.jsonl"), "-p", "out_dir", str(tmp_path / "out_model"), "-p", "codebook", "16",
                   "--out", str(tmp_path / "out"), "--no-page")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "out" / "08_latent_tokens.json").read_text())
    assert rec["status"] == "measured" and rec["claims"] == []
    ck = rec["metrics"]["checkpoint"]
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out_model")
    back_tok = AutoTokenizer.from_pretrained(tmp_path / "out_model")
    K = ck["added_tokens"] - 2
    assert K == 16  # the codebook parameter reaches the checkpoint path
    assert back.get_input_embeddings().num_embeddings == len(tok) + K + 2 == len(back_tok)
    assert back_tok.convert_tokens_to_ids("<|bol|>") == len(tok)
    # 12-token traces, L = 4: all-latent form is 3 codes + 2 delimiters = 5 tokens
    assert ck["trace_tokens"] == 12 and ck["all_latent_trace_tokens"] == 5
