r"""InfAlign on a researcher's policy and reward model (notebook 12's `model=<folder or hub id>` path).

CTRL's three steps on real samples: K responses per prompt from π_ref (`transformers`' `generate`, temperature 1)
scored by the reward model calibrate each prompt's reward (`infalign.calibrate`, the empirical Ĉ of Sec. 4); then,
for each reward — the raw reward (standard RLHF), the calibrated reward (InfAlign's calibrated-RLHF baseline) and
CTRL's transforms Φ_t(Ĉ) — the KL-regularized optimum π_β(y|x) ∝ π_ref(y|x)·exp(R(x, y)/β) (the policy RLHF with
that reward converges to, Sec. 2) is represented *on M fresh π_ref samples per prompt* by self-normalized weights
w ∝ exp(R/β) (sampling-importance-resampling). On that support the KL(π_β‖π_ref) = Σ w log(M w) and the
Best-of-N / Worst-of-N win rate of T_N(π_β) against T_N(π_ref), judged by the same reward model with ties ½, are
exact (`discrete_win_rate`); β is swept and the win rate read at matched KL budgets.

What this is not: RL training (the paper's PPO on Φ_t(Ĉ)). It measures what the optimum of each reward would give
on this policy and reward model, limited to the M samples (KL ≤ log M): a budget needs M ≫ exp(KL).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from lab.align import infalign as I


@torch.no_grad()
def sample(policy, tokenizer, prompts: list[str], n: int, *, max_new_tokens: int = 32,
           seed: int = 0) -> list[list[str]]:
    """n responses per prompt from the policy at temperature 1 (`generate`, num_return_sequences)."""
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = []
    for p in prompts:
        enc = tokenizer(p, return_tensors="pt").to(policy.device)
        ids = policy.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n,
                              max_new_tokens=max_new_tokens, pad_token_id=pad)
        out.append(tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return out


@torch.no_grad()
def score(reward_model, tokenizer, prompts: list[str], responses: list[list[str]], batch: int = 16) -> Tensor:
    """The reward model's scalar score of each (prompt, response): (n_prompts, n_responses), float64."""
    pairs = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    out = []
    for i in range(0, len(pairs), batch):
        chunk = pairs[i:i + batch]
        enc = tokenizer([p for p, _ in chunk], [r for _, r in chunk], return_tensors="pt", padding=True,
                        truncation=True).to(reward_model.device)
        out.append(reward_model(**enc).logits[:, 0].double().cpu())
    return torch.cat(out).reshape(len(prompts), -1)


def tilt(R: Tensor, beta: float) -> Tensor:
    """Self-normalized weights of π_β ∝ π_ref·exp(R/β) on each prompt's samples: R (n, M) -> (n, M)."""
    return torch.softmax(R / beta, -1)


def kl(w: Tensor) -> float:
    """Mean over prompts of KL(π_β‖π_ref) on the support: Σ w log(M w)."""
    M = w.shape[-1]
    return float(torch.where(w > 0, w * (w * M).log(), torch.zeros_like(w)).sum(-1).mean())


def discrete_win_rate(s: Tensor, w: Tensor, N: int, kind: str = "bon") -> float:
    """P(T_N(π_β) beats T_N(π_ref)) + ½ P(tie), mean over prompts, exactly, for the discrete distributions w and
    uniform on each prompt's scores s (n, M): T_N keeps the best (BoN) or worst (WoN) of N draws, both judged by s."""
    wins = []
    for sc, wi in zip(s, w):
        v, inv = torch.unique(sc, return_inverse=True)  # sorted distinct scores
        p = torch.zeros(len(v), dtype=torch.float64).index_add_(0, inv, wi.double())
        q = torch.zeros(len(v), dtype=torch.float64).index_add_(0, inv, torch.full((len(sc),), 1 / len(sc),
                                                                                    dtype=torch.float64))
        # BoN: the policy's best beats the reference's. WoN: in the reversed order the worst of N is the largest,
        # and the policy wins when the reference's worst is lower (larger in that order) than its own.
        a, b = (p, q) if kind == "bon" else (q.flip(0), p.flip(0))
        Fa, Fb = a.cumsum(0).clamp(max=1) ** N, b.cumsum(0).clamp(max=1) ** N
        ma, mb = torch.diff(Fa, prepend=Fa.new_zeros(1)), torch.diff(Fb, prepend=Fb.new_zeros(1))
        wins.append(float((ma * torch.cat([Fb.new_zeros(1), Fb[:-1]])).sum() + 0.5 * (ma * mb).sum()))
    return sum(wins) / len(wins)


def rewards(r_base: Tensor, r_eval: Tensor, t: float) -> dict[str, Tensor]:
    """The rewards compared, on the evaluation samples: raw (min-max scaled over all prompts, standard RLHF),
    calibrated Ĉ against the prompt's K base samples, and CTRL's exp(t·Ĉ) (BoN) and −exp(−t·Ĉ) (WoN)."""
    u = I.calibrate(r_base, r_eval)
    lo, hi = r_eval.min(), r_eval.max()
    return {"raw (RLHF)": (r_eval - lo) / (hi - lo).clamp_min(1e-12), "calibrated (IPO-like)": u,
            f"CTRL exp({t:g}u)": I.exp_bon(t)(u), f"CTRL −exp(−{t:g}u)": I.exp_won(t)(u)}


def matched_kl(R: dict[str, Tensor], s: Tensor, settings, budgets, betas: Tensor) -> dict[str, dict[str, float]]:
    """{setting: {reward @ KL: win rate}}: each reward's β frontier (KL, win) on the support, read at each budget
    (None where the budget is beyond the frontier: more samples M are needed)."""
    out = {}
    for kind, N in settings:
        row = {}
        for name, r in R.items():
            scale = float((r.max() - r.min()).clamp_min(1e-12))
            ws = [tilt(r, scale * float(b)) for b in betas]
            kls = torch.tensor([kl(w) for w in ws], dtype=torch.float64)
            wins = torch.tensor([discrete_win_rate(s, w, N, kind) for w in ws], dtype=torch.float64)
            for b in budgets:
                try:
                    row[f"{name} @ KL {b:g}"] = I.at_kl(kls, wins, b)
                except ValueError:
                    row[f"{name} @ KL {b:g}"] = None
        out[I.setting_name(kind, N)] = row
    return out


def study(policy, tokenizer, reward_model, rm_tokenizer, prompts: list[str], *, K: int = 16, M: int = 64,
          max_new_tokens: int = 32, t: float = 10.0, settings=(("bon", 1), ("bon", 4), ("won", 4)),
          budgets=(0.25, 0.5, 1.0), seed: int = 0) -> dict:
    """CTRL's calibration and the matched-KL comparison on the given models (module docstring)."""
    base = sample(policy, tokenizer, prompts, K, max_new_tokens=max_new_tokens, seed=seed)
    fresh = sample(policy, tokenizer, prompts, M, max_new_tokens=max_new_tokens, seed=seed + 1)
    r_base, r_eval = score(reward_model, rm_tokenizer, prompts, base), score(reward_model, rm_tokenizer, prompts, fresh)
    spread = r_base.std(-1)
    R = rewards(r_base, r_eval, t)
    table = matched_kl(R, r_eval, settings, budgets, torch.logspace(-3, 2, 40))
    u = R["calibrated (IPO-like)"].flatten().numpy()
    return {"prompts": len(prompts), "K": K, "M": M, "max KL on the support (log M)": math.log(M),
            "reward std per prompt": {"min": float(spread.min()), "max": float(spread.max())},
            "calibrated reward: mean, KS distance to U[0,1]": [float(u.mean()), _ks_uniform(u)],
            "win rate at matched KL": table,
            "example": {"prompt": prompts[0], "response": fresh[0][int(r_eval[0].argmax())],
                        "reward": float(r_eval[0].max())}}


def _ks_uniform(u: np.ndarray) -> float:
    from scipy.stats import kstest

    return float(kstest(u, "uniform").statistic)


def run(model: str, reward_model: str, data: str, *, n_prompts: int = 32, device: str = "cpu", seed: int = 0,
        **kw) -> dict:
    """`study` on a policy (`lab.models.load_model`), a reward model (`load_reward_model`) and the `prompt` column
    of `data` (a local .jsonl/.txt/.parquet or a cached `datasets` name, through `lab.data.text`)."""
    from lab.core.params import ParamError
    from lab.data.text import load_texts
    from lab.models import load_model, load_reward_model

    if not reward_model or not data:
        raise ParamError("a checkpoint needs a reward model and prompts: pass -p reward_model <folder or hub id> "
                         "-p data <a .jsonl with a 'prompt' column, or a datasets name>.")
    policy, tok = load_model(model, device=device)
    if tok is None:
        raise ParamError(f"model={model!r} has no tokenizer in its folder; save one beside the weights.")
    rm, rm_tok = load_reward_model(reward_model, device=device)
    prompts = load_texts(data, column="prompt", n=n_prompts, seed=seed)
    return study(policy, tok, rm, rm_tok, prompts, seed=seed, **kw)
