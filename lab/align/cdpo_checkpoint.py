r"""cDPO on a researcher's policy and problems (notebook 19's `model=<folder or hub id>` path).

Lin, Liang, Xu et al., "Critical Tokens Matter", ICML 2025 (arXiv 2411.19943; code:
chenzhiling9954/Critical-Tokens-Matter).

**Trajectories** (§3.1). K responses per problem (`lab.data.load.problems`: question + answer) sampled from the
policy by `generate` (`lab.align.hf_prefs.sample`: pure ancestral sampling, T = 1; the paper tunes T per model so
that a question has ≈ 10 wrong answers in 64), the prompt in the paper's GSM8K format "Question: …\nAnswer:" without
few-shot examples. Each is graded by its final answer (`lab.data.answers.answer_of`: the number after "####", the
last \boxed{} content, else the last number, as GSM8K answers are parsed; MATH's symbolic equivalence, the official
`grader.py`, is not built) against the problem's answer read the same way.

**Contrastive estimation** (§3.1). `lab.align.cdpo.select` picks per problem, as the official
`select_data_for_sft_and_dpo`, one trajectory of the most frequent correct answer (P_p's data) and one of each most
frequent wrong answer until they cover top-p = 50 % of the wrong samples (P_n's). P_p and P_n are two LoRA adapters
on one `PeftModel` of the policy (`hf_prefs.add_adapter`; the official SFT: r = 8, α = 16, lr 3e-4, one epoch, on
gate/up/down — here on every linear layer), trained by plain next-token loss on the response tokens (`sft`, the
`accelerate` loop of `hf_prefs.train`). Every incorrect trajectory is scored on exactly its sampled token ids (no
re-tokenization, the alignment pitfall of the official pipeline), as `calculate_ce_score`:

    s_t = softmax((1 + β)·logits_p − β·logits_n)[y_t],    β = 1,

and its critical token is argmin_t s_t (`token_scores`). Per problem `critical_table` records the most frequent
critical tokens, how many wrong trajectories each is critical in, and the share of the problem's K trajectories
containing it that end wrong — beside the problem's wrong share and the same for a uniformly random token.

**cDPO** (§3.2, Eq. 6; `train_arm`). Pairs (most frequent correct, most frequent wrong trajectory) where a problem has
both; the rejected side weighted token by token by 1 − s_t (`lab.align.cdpo.cdpo_loss`, the paper's sequence sums),
and DPO as the same loop with every s_t = 0 (Eq. 6 is then DPO), RPO (DPO + the chosen response's NLL per token,
`lab.align.losses.rpo`), and TokenDPO (TDPO2, `lab.align.losses.tdpo`, β = γ; from the policy, as DPO and cDPO,
where the paper starts it from SFT), each a LoRA arm on the same `PeftModel`
(π_ref: its adapters off) on the same token ids. `hf_prefs.evaluate` compares them and P_p (the SFT row of Table 3)
on the held-out problems' pairs, with the sampled accuracy on those problems.

Not built: the rollouts of §2 (K samples per prefix: the ground truth CE approximates), greedy accuracy with
few-shot CoT prompts, stop strings for base models. Measurements only.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from lab.align import cdpo as C
from lab.align import hf_batch, hf_prefs
from lab.align.losses import rpo
from lab.align.train import preference_loss, token_logprobs
from lab.core.params import ParamError
from lab.data.answers import answer_of, reference_answer

Sample = tuple[list[int], list[int]]  # (prompt ids, response ids)
TEMPLATE = "Question: {question}\nAnswer:"  # the paper's GSM8K prompt (MATH: "Problem: …\nSolution:")


@dataclass(frozen=True)
class Config:
    """The checkpoint path's sizes: K samples per problem, CE's β and selection, the SFT of P_p / P_n and the
    preference arms (each an `hf_prefs.Config`; the arms' `beta` is γ of DPO / cDPO)."""

    K: int = 8  # trajectories sampled per problem
    max_new_tokens: int = 64
    template: str = TEMPLATE
    top_p: float = 0.5  # P_n's answers cover this share of the wrong samples
    beta: float = 1.0  # β of contrastive estimation
    top: int = 3  # critical tokens recorded per problem
    held_out: int = 8  # the last problems: evaluation of the arms only
    sft_epochs: float = 1.0
    epochs: float = 3.0  # preference arms (the paper: 3)
    sft: hf_prefs.Config = field(default_factory=lambda: hf_prefs.Config(lr=3e-4, lora_r=8, lora_alpha=16))
    arm: hf_prefs.Config = field(default_factory=hf_prefs.Config)

    @classmethod
    def for_scale(cls, scale: str, device: str = "cpu", *, lr: float | None = None, gamma: float | None = None,
                  max_len: int | None = None, seed: int = 0, **knobs) -> Config:
        """`hf_prefs.Config.for_scale` for both trainings (SFT at the paper's lr 3e-4, r 8, α 16); full scale
        samples K = 16 trajectories of up to 256 tokens per problem."""
        sft = hf_prefs.Config.for_scale(scale, device, lr=3e-4, lora_r=8, lora_alpha=16, max_len=max_len, seed=seed)
        full = {"max_new_tokens": 256, "K": 16} if scale == "full" else {}
        knobs = full | {k: v for k, v in knobs.items() if v is not None}
        arm = hf_prefs.Config.for_scale(scale, device, lr=lr, beta=gamma, max_len=max_len, seed=seed,
                                        max_new_tokens=knobs.get("max_new_tokens"))  # also the evaluation's samples
        return cls(sft=sft, arm=arm, **knobs)


# ------------------------------------------------------------------ answers and trajectories

@dataclass
class Trajectories:
    """K samples per problem: prompts, token ids, decoded texts, final answers and grades (Q, K)."""

    problems: list[dict]
    prompts: list[str]
    samples: list[list[Sample]]
    texts: list[list[str]]
    answers: list[list[str | None]]
    correct: Tensor


def trajectories(model, tokenizer, problems: list[dict], K: int, *, adapter: str | None = None,
                 template: str = TEMPLATE, max_new_tokens: int = 64, max_prompt_len: int = 256, seed: int = 0,
                 chunk: int = 8) -> Trajectories:
    """K responses per problem from arm `adapter` (None: the policy itself), `chunk` problems per `generate` call,
    each graded by its final answer."""
    prompts = [template.format(question=p["question"]) for p in problems]
    samples = []
    for i in range(0, len(prompts), chunk):
        flat = hf_prefs.sample(model, tokenizer, prompts[i:i + chunk], adapter, n=K, max_new_tokens=max_new_tokens,
                               max_prompt_len=max_prompt_len, seed=seed + i)
        samples += [flat[j:j + K] for j in range(0, len(flat), K)]
    texts = [[tokenizer.decode(y, skip_special_tokens=True) for _, y in row] for row in samples]
    answers = [[answer_of(t) for t in row] for row in texts]
    correct = torch.tensor([[a is not None and a == reference_answer(p["answer"]) for a in row]
                            for p, row in zip(problems, answers)])
    return Trajectories(problems, prompts, samples, texts, answers, correct)


def selection(tr: Trajectories, *, top_p: float = 0.5) -> list[dict]:
    """`lab.align.cdpo.select` on the string answers (each problem's distinct answers numbered, None → −1)."""
    ids = [{a: k for k, a in enumerate(dict.fromkeys(x for x in row if x is not None))} for row in tr.answers]
    A = torch.tensor([[m[a] if a is not None else -1 for a in row] for m, row in zip(ids, tr.answers)])
    return C.select(A.view(len(tr.answers), -1), tr.correct, top_p=top_p)


# ------------------------------------------------------------------ LoRA training through accelerate

def sft_loss(model, batch: dict[str, Tensor]) -> Tensor:
    """Mean next-token NLL over the response tokens of a padded (B, 1, T) batch (completion-only SFT)."""
    ids, att, m = (batch[k][:, 0] for k in ("input_ids", "attention_mask", "response_mask"))
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()  # position t predicts token t+1
    labels = ids[:, 1:].masked_fill(m[:, 1:] == 0, -100)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def epochs_to_steps(n: int, epochs: float, cfg: hf_prefs.Config) -> int:
    return max(1, math.ceil(epochs * n / (cfg.batch_size * cfg.grad_accum)))


def sft(model, samples: list[Sample], cfg: hf_prefs.Config, name: str, *, pad: int = 0, quiet: bool | None = None):
    """LoRA adapter `name` fine-tuned on (prompt, response) token ids by `sft_loss`: (PeftModel, per-step losses)."""
    collate = lambda rows: hf_batch.pad_batch([[s] for s in rows], pad)
    return hf_prefs.fit_adapter(model, samples, cfg, name, collate, lambda policy, _, b: sft_loss(policy, b),
                                quiet=quiet)


@torch.no_grad()
def token_scores(model, samples: list[Sample], *, pos: str = "P_p", neg: str = "P_n", beta: float = 1.0,
                 pad: int = 0, batch_size: int = 4) -> list[Tensor]:
    """s_t of every response token of every sample (a (len(y),) tensor each) under adapters `pos` and `neg`."""
    out, device = [], next(model.parameters()).device
    for i in range(0, len(samples), batch_size):
        chunk = samples[i:i + batch_size]
        b = hf_batch.pad_batch([[s] for s in chunk], pad)
        ids, att = b["input_ids"][:, 0].to(device), b["attention_mask"][:, 0].to(device)
        lp, ln = (hf_prefs.use(model, a)(input_ids=ids, attention_mask=att).logits[:, :-1].float() for a in (pos, neg))
        z = (1 + beta) * lp - beta * ln  # (B, T−1, V): position t scores token t+1
        s = (z.gather(-1, ids[:, 1:, None])[..., 0] - z.logsumexp(-1)).exp().cpu()
        out += [row[len(p) - 1:len(p) - 1 + len(y)] for row, (p, y) in zip(s, chunk)]
    return out


# ------------------------------------------------------------------ critical tokens

def _token_entry(tokenizer, samples: list[Sample], ok: list[bool], tid: int, count: int) -> dict:
    present = [not ok[k] for k in range(len(samples)) if tid in samples[k][1]]  # wrong, per trajectory containing tid
    return {"token": tokenizer.decode([tid]), "count": count, "wrong share when present": sum(present) / len(present)}


def critical_table(tokenizer, tr: Trajectories, scores: dict[tuple[int, int], Tensor], *, top: int = 3,
                   seed: int = 0) -> list[dict]:
    """Per problem with a wrong trajectory: its wrong share, its `top` most frequent critical tokens (argmin_t s_t
    over its wrong trajectories) with their count and the wrong share among the problem's trajectories containing
    them, and the same for the most frequent uniformly random token of those trajectories."""
    g, rows = torch.Generator().manual_seed(seed), []
    for q, (samples, ok) in enumerate(zip(tr.samples, tr.correct.tolist())):
        wrong = [k for k in range(len(samples)) if not ok[k] and (q, k) in scores]
        if not wrong:
            continue
        crit = Counter(samples[k][1][int(scores[q, k].argmin())] for k in wrong)
        rand = Counter(samples[k][1][int(torch.randint(len(samples[k][1]), (1,), generator=g))] for k in wrong)
        entry = partial(_token_entry, tokenizer, samples, ok)
        rows.append({"problem": q, "question": tr.problems[q]["question"][:80], "wrong share": 1 - sum(ok) / len(ok),
                     "wrong trajectories scored": len(wrong),
                     "critical tokens": [entry(t, c) for t, c in crit.most_common(top)],
                     "random token": entry(*rand.most_common(1)[0]),
                     "relative position": sum(int(scores[q, k].argmin()) / len(scores[q, k]) for k in wrong)
                     / len(wrong)})
    return rows


def summary(rows: list[dict]) -> dict[str, float]:
    """Means over problems: wrong share; wrong share when the top critical / the random token is present; how many
    of the wrong trajectories the top critical token is critical in; its relative position."""
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    return {"problems with a wrong trajectory": len(rows), "wrong share": mean([r["wrong share"] for r in rows]),
            "wrong share, top critical token present":
                mean([r["critical tokens"][0]["wrong share when present"] for r in rows]),
            "wrong share, random token present": mean([r["random token"]["wrong share when present"] for r in rows]),
            "top critical token's share of the wrong trajectories":
                mean([r["critical tokens"][0]["count"] / r["wrong trajectories scored"] for r in rows]),
            "critical token's relative position": mean([r["relative position"] for r in rows])}


def contrastive_estimation(model, tokenizer, tr: Trajectories, cfg: Config, *, quiet: bool | None = None):
    """P_p and P_n as LoRA adapters from `selection`, and s_t on every wrong trajectory: (PeftModel, selection,
    scores {(problem, sample): (len(y),)}, SFT info)."""
    sel = selection(tr, top_p=cfg.top_p)
    pos = [tr.samples[q][s["pos"]] for q, s in enumerate(sel) if s["pos"] is not None]
    neg = [tr.samples[q][k] for q, s in enumerate(sel) for k in s["neg"]]
    if not pos or not neg:
        raise ParamError(f"the {len(sel)} problems × {cfg.K} samples give {len(pos)} correct and {len(neg)} wrong "
                         "trajectories for P_p / P_n; CE needs both: raise n_samples or pass other problems.")
    pad, info = hf_batch.pad_id(tokenizer), {"P_p data": len(pos), "P_n data": len(neg)}
    for name, data in (("P_p", pos), ("P_n", neg)):
        c = replace(cfg.sft, steps=epochs_to_steps(len(data), cfg.sft_epochs, cfg.sft))
        model, losses = sft(model, data, c, name, pad=pad, quiet=quiet)
        info[f"{name} SFT loss, first → last"] = [losses[0], losses[-1]]
    wrong = [(q, k) for q in range(len(tr.samples)) for k in range(cfg.K) if not tr.correct[q, k]]
    s = token_scores(model, [tr.samples[q][k] for q, k in wrong], beta=cfg.beta, pad=pad)
    return model, sel, dict(zip(wrong, s)), info


# ------------------------------------------------------------------ cDPO, DPO and TokenDPO arms

def pair_batch(rows: list[dict], pad: int = 0) -> dict[str, Tensor]:
    """Rows {chosen, rejected: Sample, s: (len(y_l),)} -> the padded (B, 2, T) batch and s (B, T − 1) placed at the
    positions that predict the rejected response's tokens (0 elsewhere)."""
    b = hf_batch.pad_batch([[r["chosen"], r["rejected"]] for r in rows], pad)
    s = torch.zeros(len(rows), b["input_ids"].shape[-1] - 1)
    for i, r in enumerate(rows):
        P = len(r["rejected"][0])
        s[i, P - 1:P - 1 + len(r["s"])] = r["s"]
    return b | {"s": s}


def cdpo_batch_loss(policy, reference, batch: dict[str, Tensor], *, gamma: float) -> Tensor:
    """Mean Eq. (6) loss of a `pair_batch`: per-token log-ratios (zero off the responses) into `cdpo_loss`."""
    B, n, T = batch["input_ids"].shape
    ids, att = (batch[k].reshape(B * n, T) for k in ("input_ids", "attention_mask"))
    m = batch["response_mask"].reshape(B * n, T)[:, 1:]
    pi = (token_logprobs(policy, ids, att)[0] * m).view(B, n, T - 1)
    with torch.no_grad():
        ref = (token_logprobs(reference, ids, att)[0] * m).view(B, n, T - 1)
    return C.cdpo_loss(pi[:, 0], ref[:, 0], pi[:, 1], ref[:, 1], batch["s"], gamma=gamma).mean()


def rpo_batch_loss(policy, reference, batch: dict[str, Tensor], *, beta: float) -> Tensor:
    """Mean RPO loss of a `pair_batch` (the paper's RPO arm, `lab.align.losses.rpo`): DPO on the responses' summed
    log-ratios + the chosen response's NLL per token (weight 1, as the toy's arm)."""
    B, n, T = batch["input_ids"].shape
    ids, att = (batch[k].reshape(B * n, T) for k in ("input_ids", "attention_mask"))
    m = batch["response_mask"].reshape(B * n, T)[:, 1:]
    pi = (token_logprobs(policy, ids, att)[0] * m).view(B, n, T - 1).sum(-1)
    with torch.no_grad():
        ref = (token_logprobs(reference, ids, att)[0] * m).view(B, n, T - 1).sum(-1)
    return rpo(pi, ref, beta=beta, chosen_len=m.view(B, n, T - 1)[:, 0].sum(-1)).mean()


def pairs(tr: Trajectories, sel: list[dict], scores: dict, problems: range) -> list[dict]:
    """(most frequent correct, most frequent wrong) of each problem in `problems` that has both, with s of y_l."""
    keep = [(q, sel[q]["pos"], sel[q]["neg"][0]) for q in problems if sel[q]["pos"] is not None and sel[q]["neg"]]
    return [{"prompt": tr.prompts[q], "chosen": tr.samples[q][w], "rejected": tr.samples[q][l], "s": scores[q, l]}
            for q, w, l in keep]


ARMS = ("dpo", "rpo", "tokendpo", "cdpo")


def train_arm(model, rows: list[dict], cfg: hf_prefs.Config, name: str, *, pad: int = 0,
              quiet: bool | None = None):
    """Arm `name` of `ARMS` as a LoRA adapter, γ = `cfg.beta`: cdpo (Eq. 6), dpo (Eq. 6 with every s_t = 0), rpo
    (`rpo_batch_loss`) or tokendpo (TDPO2 on the same padded pairs, `lab.align.train.preference_loss`): (PeftModel,
    per-step losses)."""
    if name not in ARMS:
        raise ValueError(f"arm {name!r} is not one of {ARMS}.")
    if name == "tokendpo":
        loss = lambda policy, m, b: preference_loss(policy, hf_prefs.DisabledAdapter(m), b, "tdpo", beta=cfg.beta)
    elif name == "rpo":
        loss = lambda policy, m, b: rpo_batch_loss(policy, hf_prefs.DisabledAdapter(m), b, beta=cfg.beta)
    else:
        rows = rows if name == "cdpo" else [r | {"s": torch.zeros_like(r["s"])} for r in rows]
        loss = lambda policy, m, b: cdpo_batch_loss(policy, hf_prefs.DisabledAdapter(m), b, gamma=cfg.beta)
    return hf_prefs.fit_adapter(model, rows, cfg, name, partial(pair_batch, pad=pad), loss, quiet=quiet)


def as_text(tokenizer, rows: list[dict]) -> list[dict]:
    """Token-id pairs as the text rows `hf_prefs.evaluate` reads."""
    dec = lambda s: tokenizer.decode(s[1], skip_special_tokens=True)
    return [{"prompt": r["prompt"], "chosen": dec(r["chosen"]), "rejected": dec(r["rejected"])} for r in rows]


def study(model, tokenizer, problems: list[dict], cfg: Config, *, arms: bool = True,
          quiet: bool | None = None) -> tuple[dict, list[dict]]:
    """Trajectories, contrastive estimation and the critical-token table on every problem; with `arms`, the `ARMS`
    on the pairs of all but the last `cfg.held_out` problems, evaluated (with P_p) on those (module docstring)."""
    Q = len(problems)
    if tokenizer is None:
        raise ParamError("the model has no tokenizer in its folder; save one beside the weights.")
    if arms and Q < cfg.held_out + 2:
        raise ParamError(f"{Q} problems leave no training pairs beside held_out = {cfg.held_out}; pass more problems.")
    gen = dict(template=cfg.template, max_new_tokens=cfg.max_new_tokens, max_prompt_len=cfg.arm.prompt_len)
    tr = trajectories(model, tokenizer, problems, cfg.K, seed=cfg.arm.seed, **gen)
    model, sel, scores, info = contrastive_estimation(model, tokenizer, tr, cfg, quiet=quiet)
    table = critical_table(tokenizer, tr, scores, top=cfg.top, seed=cfg.arm.seed)
    both = int((tr.correct.any(1) & ~tr.correct.all(1)).sum())
    out = {"problems": Q, "K": cfg.K, "share correct": tr.correct.float().mean().item(),
           "problems with a correct and a wrong trajectory": both, **info, "critical tokens": summary(table)}
    if not arms:
        return out, table
    train, test = (pairs(tr, sel, scores, r) for r in (range(Q - cfg.held_out), range(Q - cfg.held_out, Q)))
    if not train or not test:
        raise ParamError(f"{len(train)} training and {len(test)} held-out problems have both a correct and a wrong "
                         "trajectory; the arms need both: raise n_samples or n_problems.")
    pad = hf_batch.pad_id(tokenizer)
    for name in ARMS:
        c = replace(cfg.arm, steps=epochs_to_steps(len(train), cfg.epochs, cfg.arm))
        model, _ = train_arm(model, train, c, name, pad=pad, quiet=quiet)
    ev = hf_prefs.evaluate(model, tokenizer, as_text(tokenizer, test), ["P_p", *ARMS], cfg.arm)
    held = problems[Q - cfg.held_out:]
    for arm, m in ev.items():  # share of K samples per held-out problem whose final answer is right
        tr_arm = trajectories(model, tokenizer, held, cfg.K, adapter=None if arm == "reference" else arm,
                              seed=cfg.arm.seed + 1, **gen)
        m["sampled accuracy"] = tr_arm.correct.float().mean().item()
    out["pairs"] = {"train": len(train), "held out": len(test)}
    out["arms"] = ev
    return out, table


def frame_rows(table: list[dict]) -> list[dict]:
    """`critical_table` flattened for a table: one row per problem, each critical token as 'token' ×count (wrong
    share when present)."""
    cell = lambda c: f"{c['token']!r} ×{c['count']} ({c['wrong share when present']:.2f})"
    return [{"question": r["question"], "wrong share": round(r["wrong share"], 3),
             **{f"critical {i + 1}": cell(c) for i, c in enumerate(r["critical tokens"])},
             "random token": cell(r["random token"])} for r in table]
