"""Token Assorted (Su et al., ICML 2025, arXiv 2502.03275) end to end: the automaton toy the notebook measures, and
the checkpoint path (a causal LM fine-tuned on mixed latent traces built from a JSONL of problems with traces).

The method's training side (VQ-VAE, mixed traces, LM data) is `lab.reasoning.latent_tokens`; this module holds the
inference side — greedy decoding constrained to the grammar (latent tokens only between the delimiters), forced-m
decoding (<eoLatent> masked until m/r codes, then forced), the length metric (latent + text tokens) — and wires it
all into studies that return data (the notebook displays).
"""

from __future__ import annotations

import math
import os
import random
import tempfile

import torch
from torch import nn
from torch.nn import functional as F

from lab.core.stages import stage
from lab.models.sample import cached_step
from lab.reasoning import latent_tokens as lt
from lab.reasoning.latent_tokens import Vocab

NEG = float("-inf")


@torch.no_grad()
def generate(model, prefix: torch.Tensor, vocab: Vocab, *, latent: bool, force_codes: int | None = None,
             in_latent: bool = False, max_new: int = 64) -> torch.Tensor:
    """Constrained greedy decoding (KV cache) from equal-length prefixes (B, T0); returns (B, ≤ max_new) new ids,
    <pad> after <eos>. Grammar: <boLatent> only first, latent tokens only between the delimiters, text after.
    `force_codes`: forced-m decoding — exactly m/r latent tokens (0: no latent segment). `in_latent`: the prefix
    already ends inside (`False`: before) a latent segment — e.g. it ends with <eoLatent>, then set `latent=False`."""
    dev = next(model.parameters()).device
    B, V = len(prefix), vocab.size  # a text-only model's logits are padded with -inf up to V
    lat = torch.zeros(V, dtype=torch.bool)
    lat[vocab.first_latent: vocab.size] = True
    text = torch.ones(V, dtype=torch.bool)
    text[vocab.n_text:] = False
    phase = torch.full((B,), 1 if in_latent else (0 if latent else 2))  # 0 start, 1 in latent, 2 text
    count, done = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.bool)
    need = force_codes
    out, past, step_in = [], None, prefix.to(dev)
    for _ in range(max_new):
        res, past = cached_step(model, step_in, past)
        logits = res.logits[:, -1].float().cpu()
        logits = F.pad(logits, (0, V - logits.shape[1]), value=NEG)
        allow = torch.zeros(B, V, dtype=torch.bool)
        allow[phase == 2] = text
        start = phase == 0
        allow[start] = text
        allow[start, vocab.bol] = True
        inside = phase == 1
        allow[inside] = lat
        allow[inside, vocab.eol] = True
        if need is not None:
            allow[start] = text if need == 0 else False
            allow[start, vocab.bol] = need > 0
            allow[inside & (count < need), vocab.eol] = False
            allow[inside & (count >= need)] = False
            allow[inside & (count >= need), vocab.eol] = True
        nxt = logits.masked_fill(~allow, NEG).argmax(-1)
        nxt = torch.where(done, vocab.pad, nxt)
        count += (inside & lat[nxt]).long()
        phase = torch.where(start, torch.where(nxt == vocab.bol, 1, 2), phase)
        phase = torch.where(inside & (nxt == vocab.eol), 2, phase)
        done |= nxt == vocab.eos
        out.append(nxt)
        if done.all():
            break
        step_in = nxt[:, None].to(dev)
    return torch.stack(out, 1)


greedy = stage(generate)  # the same decoding, its result cached by the model's weights and the prefixes


def score(gen: torch.Tensor, answer: torch.Tensor, vocab: Vocab) -> dict:
    """Accuracy (the token after the first `ans` = the true final state) and generated length (to <eos>, latent +
    text + delimiters; the whole budget if no <eos>)."""
    is_ans = gen == vocab.ans
    pos = torch.where(is_ans.any(1), is_ans.float().argmax(1) + 1, gen.shape[1] - 1).clamp(max=gen.shape[1] - 1)
    pred = gen[torch.arange(len(gen)), pos]
    ok = is_ans.any(1) & (pred == answer)
    ended = (gen == vocab.eos).any(1)
    length = torch.where(ended, (gen == vocab.eos).float().argmax(1) + 1, gen.shape[1])
    return {"acc": ok.float().mean().item(), "tokens": length.float().mean().item(), "correct": ok,
            "length": length}


def _prefix(P: torch.Tensor, z: torch.Tensor, v: lt.Vocab) -> torch.Tensor:
    """P ⊕ <boLatent> z <eoLatent>: a latent segment handed to the model (z: codebook ids, (B, k·L/r))."""
    col = lambda i: torch.full((len(P), 1), i)
    return torch.cat([P, col(v.bol), v.first_latent + z, col(v.eol)], 1)


def toy_study(cfg: lt.Config, seed: int, device: str = "cpu") -> dict:
    """VQ-VAE, the five LMs (Sol-Only, CoT, iCoT, Pause, Latent) and every evaluation on `cfg.n_eval` held-out
    problems. The VQ-VAE and every decoding are stage-cached and the LMs come from the trained-model cache, so a control
    recomputes only what it changes (`shuffled_codes`: the latent LM; `no_compression`: the VQ-VAE and the latent
    LM) and the evaluations of those."""
    task, v = cfg.task, lt.vocab_of(cfg)
    vq, vq_losses = lt.train_vqvae(cfg, seed)
    table = lt.code_table(vq, cfg)  # (n_steps, n_states, L/r)
    codes = tuple(table.flatten().tolist())
    runs = {m: lt.train_lm(cfg, m, seed, codes=codes, device=device) for m in ("sol", "cot", "icot", "pause", "latent")}
    ex = task.sample(cfg.n_eval, torch.Generator().manual_seed(20_000 + seed), split="test")
    P, C, S = task.encode(ex)
    answer, budget = task.state_id(ex["states"][:, -1]), C.shape[1] + S.shape[1] + 6
    gen = {"Sol-Only": greedy(runs["sol"].model, P, v, latent=False, max_new=budget),
           "CoT": greedy(runs["cot"].model, P, v, latent=False, max_new=budget),
           "iCoT": greedy(runs["icot"].model, P, v, latent=False, max_new=budget),
           "Latent-AR": greedy(runs["latent"].model, P, v, latent=True, max_new=budget)}
    pauses = torch.full_like(C, v.bol)  # Pause reads as many <pause> positions as CoT writes trace tokens
    gen["Pause"] = greedy(runs["pause"].model, torch.cat([P, pauses], 1), v, latent=False, max_new=budget)
    scores = {k: score(g, answer, v) for k, g in gen.items()}
    scores["Pause"]["tokens"] += C.shape[1]  # its pauses count as positions, as CoT's trace tokens do
    frontier = {k: score(greedy(runs["latent"].model, P, v, latent=True, force_codes=k * cfg.n_z, max_new=budget),
                         answer, v) for k in range(task.n_steps + 1)}
    # the latent prefix given, not generated: the true codes of the first k chunks vs another problem's codes
    k_f = math.ceil(cfg.forced_frac * task.n_steps)
    z = table[torch.arange(k_f), ex["states"][:, :k_f]].flatten(1)  # (B, k_f·L/r)
    given = {name: score(greedy(runs["latent"].model, _prefix(P, zz, v), v, latent=False, max_new=budget),
                         answer, v) for name, zz in (("real", z), ("shuffled", z.roll(1, 0)))}
    return {"vq": vq, "vq_losses": vq_losses, "vq_report": lt.vq_report(vq, cfg, seed), "table": table,
            "runs": runs, "scores": scores, "frontier": frontier, "given": given, "k_forced": k_f,
            "gen": gen, "prompts": P, "answer": answer}


def words_of(ids, cfg: lt.Config) -> list[str]:
    """Token ids -> words, latent tokens as `<z17>`, delimiters as `<bol>` / `<eol>`, padding dropped."""
    names = {i: w for w, i in cfg.task.ids.items()}
    v = lt.vocab_of(cfg)
    names |= {v.bol: "<bol>", v.eol: "<eol>"} | {v.first_latent + k: f"<z{k}>" for k in range(cfg.K)}
    return [names[int(i)] for i in ids if int(i) != v.pad]


def decoded_examples(st: dict, cfg: lt.Config, n: int = 8) -> list[dict]:
    """The first `n` Latent-AR generations: each latent token (L/r of them a chunk) decoded back to its L text
    tokens by f_dec(q, g(P)) — what the model "said" in latent form — beside the true trace."""
    v, vq, rows = lt.vocab_of(cfg), st["vq"], []
    for i in range(n):
        g = st["gen"]["Latent-AR"][i]
        z = g[(g >= v.first_latent) & (g < v.size)] - v.first_latent
        z = z[: len(z) // cfg.n_z * cfg.n_z].view(-1, cfg.n_z)
        text = vq.decode_codes(z, st["prompts"][i].expand(len(z), -1)) if len(z) else torch.zeros(0, cfg.L)
        rows.append({"prompt": " ".join(words_of(st["prompts"][i], cfg)), "generated": words_of(g, cfg),
                     "decoded": [" ".join(words_of(c, cfg)) for c in text],
                     "correct": bool(st["scores"]["Latent-AR"]["correct"][i])})
    return rows


# ---------------------------------------------------------------- checkpoint path
def _problems(data: str, n: int, seed: int) -> list[tuple[str, str, str]]:
    """(P, C, S) strings from a local JSONL (or a cached `datasets` name) in GSM8K form: `question`, and `answer` =
    the worked solution, then `#### final`."""
    import datasets

    ds = (datasets.load_dataset("json", data_files=data, split="train") if os.path.isfile(data)
          else datasets.load_dataset(data, split="train"))
    rows = [(r["question"], *r["answer"].rsplit("####", 1)) for r in ds if "####" in r["answer"]]
    random.Random(seed).shuffle(rows)
    return [(q, c.strip(), "#### " + s.strip()) for q, c, s in rows[:n]]


@torch.no_grad()
def new_rows(model, ids: list[int], n_old: int, seed: int) -> None:
    """The rows of the added tokens `ids` in the input and output embeddings drawn around the mean of the first
    `n_old` rows (mean + 0.1 · per-dimension std · N(0, 1)): `resize_token_embeddings` adds no row when a padded
    matrix already has room (len(tokenizer) < rows, as Qwen's), and would leave the new tokens on untrained rows."""
    g = torch.Generator().manual_seed(seed)
    mats = {m.weight.data_ptr(): m.weight for m in (model.get_input_embeddings(), model.get_output_embeddings())
            if m is not None}
    for w in mats.values():
        old = w[:n_old].float()
        noise = torch.randn(len(ids), w.shape[1], generator=g) * old.std(0) * 0.1
        w[ids] = (old.mean(0) + noise).to(w.dtype)


def checkpoint_run(model_name: str, data: str, cfg: lt.Config, *, seed: int = 0, device: str = "cpu",
                   out_dir: str = "", n_problems: int = 256, ft_steps: int = 50, batch_size: int = 8,
                   lr: float = 1e-4) -> dict:
    """A causal LM fine-tuned on mixed traces: the VQ-VAE over L-token chunks of P ⊕ C ⊕ S (token ids of the model's
    tokenizer), `<|bol|>`, `<|eol|>` and K `<|latent_i|>` tokens added (`resize_token_embeddings`), m uniform over
    the chunk multiples of each trace, next-token loss on the response, trained through `accelerate`. Writes the
    model and tokenizer to `out_dir` (default a temporary folder) and returns the measurements."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from lab.models import load_model

    model, tok = load_model(model_name, device="cpu")
    if tok is None:
        raise ValueError(f"{model_name!r} has no tokenizer; the latent traces are built from its token ids.")
    probs = _problems(data, n_problems, seed)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []  # S ends in EOS: the model learns to stop
    enc = [[torch.tensor(tok(s, add_special_tokens=False)["input_ids"] + (eos if j == 2 else []), dtype=torch.long)
            for j, s in enumerate(x)] for x in probs]
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    n_text = len(tok)
    vcfg = lt.Config(L=cfg.L, r=cfg.r, K=cfg.K, vq_steps=cfg.vq_steps)
    dev = torch.device(device)  # the VQ-VAE's logits span the model's vocabulary: train it where the model runs
    torch.manual_seed(seed)
    vq, g = lt.VQVAE(vcfg, n_text).to(dev), torch.Generator().manual_seed(seed)
    chunks = [(lt.chunks_of(torch.cat(x)[None], cfg.L, pad), x[0]) for x in enc]
    opt = torch.optim.Adam(vq.parameters(), lr=vcfg.vq_lr)
    for _ in range(vcfg.vq_steps):
        pick = torch.randint(len(chunks), (8,), generator=g).tolist()
        ch = torch.cat([chunks[i][0] for i in pick])
        P = nn.utils.rnn.pad_sequence([chunks[i][1] for i in pick for _ in range(len(chunks[i][0]))],
                                      batch_first=True, padding_value=pad)
        logits, _, vq_loss = vq(ch.to(dev), P.to(dev))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ch.to(dev).flatten()) + vq_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    vq.eval()
    names = ["<|bol|>", "<|eol|>"] + [f"<|latent_{k}|>" for k in range(cfg.K)]
    tok.add_tokens(names, special_tokens=True)
    model.resize_token_embeddings(max(len(tok), model.get_input_embeddings().num_embeddings), mean_resizing=True)
    new_rows(model, tok.convert_tokens_to_ids(names), n_text, seed)
    v = lt.Vocab(n_text=tok.convert_tokens_to_ids("<|bol|>"), K=cfg.K, eos=tok.eos_token_id or pad, ans=-1, pad=pad)
    full = [(p, c[: len(c) // cfg.L * cfg.L], s) for p, c, s in enc]  # whole chunks of the trace only
    zs = [vq.codes(c.view(-1, cfg.L).to(dev)).flatten().cpu() if len(c) else torch.zeros(0, dtype=torch.long)
          for _, c, _ in full]
    rec = [(vq.decode_codes(z.view(-1, cfg.L // cfg.r).to(dev), p.expand(len(c) // cfg.L, -1).to(dev)).flatten().cpu()
            == c).float() for (p, c, _), z in zip(full, zs) if len(c)]
    acc = Accelerator(cpu=device == "cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model, opt = acc.prepare(model, opt)
    model.train()
    losses = []
    for _ in range(ft_steps):
        pick = torch.randint(len(full), (batch_size,), generator=g).tolist()
        seqs, plen = [], []
        for i in pick:
            (p, c, s), z = full[i], zs[i]
            k = int(torch.randint(len(c) // cfg.L + 1, (1,), generator=g))
            seqs.append(lt.mix_trace(p, enc[i][1], s, z, k, L=cfg.L, vocab=v))
            plen.append(len(p))
        x = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad)
        labels = x.clone()
        for j, (q, n) in enumerate(zip(plen, map(len, seqs))):
            labels[j, :q], labels[j, n:] = -100, -100
        loss = model(input_ids=x.to(acc.device), labels=labels.to(acc.device)).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    out = out_dir or tempfile.mkdtemp(prefix="latent-tokens-")
    acc.unwrap_model(model).save_pretrained(out)
    tok.save_pretrained(out)
    back = AutoModelForCausalLM.from_pretrained(out)
    t_c = sum(len(c) for _, c, _ in enc) / len(enc)
    t_full = sum(len(c) - len(cc) + (len(z) + 2 if len(z) else 0) for (_, c, _), (_, cc, _), z in zip(enc, full, zs))
    return {"out_dir": out, "problems": len(enc), "vq_recon_acc": torch.cat(rec).mean().item() if rec else None,
            "codes_used": len(set(torch.cat(zs).tolist())), "trace_tokens": t_c,
            "all_latent_trace_tokens": t_full / len(enc), "ft_loss_first": losses[0], "ft_loss_last": losses[-1],
            "vocab_size": back.get_input_embeddings().num_embeddings, "added_tokens": len(names)}
