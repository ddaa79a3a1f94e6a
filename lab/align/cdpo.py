r"""cDPO — Lin, Liang, Xu et al., "Critical Tokens Matter: Token-Level Contrastive Estimation Enhances
LLM's Reasoning Capability", ICML 2025 (arXiv 2411.19943; code: chenzhiling9954/Critical-Tokens-Matter).

(a) **Critical tokens by rollouts** (§2). For an incorrect trajectory y, roll out K continuations from
every prefix y_≤t; c_t is the share that end correct. The critical token is the first t with c_t = 0
and c_t' < 5% for all t' > t. Replacing it (mask y_t, resample, roll out) recovers Pass@k.

(b) **Contrastive estimation** (§3.1). A positive model P_p (SFT on correct trajectories) and a
negative one P_n (SFT on the most frequent wrong answers, top-p 50%) score each rejected token:

    log s_t = (1 + β) log P_p(y_t | x, y_<t) − β log P_n(y_t | x, y_<t) − log Z,    β = 1,

i.e. softmax((1 + β)·logits_p − β·logits_n) at the realized token (as `calculate_ce_score`); a low
s_t marks a critical token.

(c) **cDPO** (§3.2, Eq. 6): DPO whose rejected side is weighted token by token,

    L = −log σ(γ Σ_t h_w,t − γ Σ_t (1 − s_t) h_l,t),    h_t = log π_θ(y_t|·) − log π_ref(y_t|·),

which is DPO when every s_t = 0. The official trainer instead pairs the t-th chosen and rejected
tokens and averages −log σ(γ(h_w,t − (1 − s_t) h_l,t)) over positions: `variant="official_positionwise"`.

Toy conventions (documented differences): full fine-tuning of copies instead of LoRA; fixed-length
responses, so no padding enters the position-wise mean; grading by the final digit (`TrickyArithmetic`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lab.align.train import response_logps, train_pairs
from lab.core import progress
from lab.models.sample import sample, sample_responses  # noqa: F401 (re-exported for notebooks)

Grade = Callable[[Tensor, Tensor], Tensor]  # (question rows (m,), responses (m, k, L)) -> correct (m, k) bool

CONTROLS = {  # the substitutions a skeptic would make; the notebook declares which claims each must break
    "dpo": "cDPO replaced by DPO: every token weight s_t set to 0 in training (Eq. 6 is then DPO)",
    "swapped_ce": "contrastive estimation with P_p and P_n swapped: softmax((1+β)·logits_n − β·logits_p)",
    "random_token": "the rollout critical token replaced by a uniformly random response position",
}


def _control(control: str) -> str:
    if control and control not in CONTROLS:
        raise ValueError(f"control={control!r} is unknown; use one of {', '.join(CONTROLS)}.")
    return control


def ce_models(pos, neg, control: str = "") -> tuple:
    """(P_p, P_n) as contrastive estimation uses them: swapped under the `swapped_ce` control."""
    return (neg, pos) if _control(control) == "swapped_ce" else (pos, neg)


def training_scores(s: Tensor, control: str = "") -> Tensor:
    """The CE scores cDPO trains with: s itself, or zeros under the `dpo` control (cDPO is then DPO)."""
    return torch.zeros_like(s) if _control(control) == "dpo" else s


def critical_or_random(c: Tensor, control: str = "", *, generator: torch.Generator | None = None) -> Tensor:
    """`critical_token(c)`, or under the `random_token` control a uniformly random position per row."""
    if _control(control) == "random_token":
        return torch.randint(c.shape[-1], c.shape[:-1], generator=generator)
    return critical_token(c)


# --------------------------------------------------------------------------- (a) rollout ground truth

def rollout_correctness(model, prompts: Tensor, responses: Tensor, grade: Grade, *, K: int,
                        generator: torch.Generator, temperature: float = 1.0) -> Tensor:
    """c (n, L): c[i, t] = share of K rollouts from prompt + y_≤t that are correct (t = L−1: y itself)."""
    n, L = responses.shape
    c = torch.zeros(n, L)
    for t in range(L):
        head = responses[:, : t + 1].repeat_interleave(K, 0)  # (n·K, t+1)
        prefix = torch.cat([prompts.repeat_interleave(K, 0), head.to(prompts.device)], 1)
        tail = sample(model, prefix, L - t - 1, generator=generator, temperature=temperature)
        c[:, t] = grade(torch.arange(n), torch.cat([head.cpu(), tail], 1).view(n, K, L)).float().mean(1)
    return c


def critical_token(c: Tensor, *, tol: float = 0.05) -> Tensor:
    """(n,) the first t with c_t = 0 and c_t' < tol for all t' > t (the paper's rule; the code's
    "reset if a later prefix has > 3/64 correct" is tol = 3/64 with ≤); −1 where there is none."""
    later = torch.cat([c.flip(-1).cummax(-1).values.flip(-1)[..., 1:], torch.zeros(*c.shape[:-1], 1)], -1)
    ok = (c == 0) & (later < tol)
    return torch.where(ok.any(-1), ok.float().argmax(-1), -1)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from n samples with c correct: 1 − C(n−c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def replacement(model, prompts: Tensor, responses: Tensor, t: Tensor, grade: Grade, *, K: int,
                generator: torch.Generator, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Correct (n, K) rollouts with y_t kept and with y_t replaced (masked out, resampled) (Fig. 2)."""
    n, L = responses.shape
    kept, swapped = torch.zeros(n, K, dtype=torch.bool), torch.zeros(n, K, dtype=torch.bool)
    for tt in t.unique().tolist():
        rows = (t == tt).nonzero()[:, 0]
        for out, upto, ban in ((kept, tt + 1, None), (swapped, tt, responses[rows, tt])):
            head = responses[rows, :upto].repeat_interleave(K, 0)
            prefix = torch.cat([prompts[rows].repeat_interleave(K, 0), head.to(prompts.device)], 1)
            tail = sample(model, prefix, L - upto, generator=generator, temperature=temperature,
                          ban=None if ban is None else ban.repeat_interleave(K, 0))
            full = torch.cat([head.cpu(), tail], 1).view(len(rows), K, L)
            out[rows] = grade(rows, full)
    return kept, swapped


# --------------------------------------------------------------------------------- (b) selection, CE

def select(answers: Tensor, correct: Tensor, *, top_p: float = 0.5) -> list[dict | None]:
    """Per question from N samples (answers (Q, N), −1 = unparsable; correct (Q, N)): `pos`, one
    sample of the most frequent correct answer; `neg`, one sample of each most frequent wrong answer
    until they cover `top_p` of the wrong samples (after the first, only answers seen more than once,
    as the official `select_data_for_sft_and_dpo`); the DPO pair is (pos, neg[0]). None if either is
    missing."""
    out = []
    for a, ok in zip(answers.tolist(), correct.tolist()):
        right = Counter(x for x, y in zip(a, ok) if y)
        wrong = Counter(x for x, y in zip(a, ok) if not y and x >= 0)
        if not right or not wrong:
            out.append(None)
            continue
        pos = a.index(right.most_common(1)[0][0])
        neg, covered, total = [], 0, sum(wrong.values())
        for ans, count in wrong.most_common():
            if covered >= top_p * total or (neg and count <= 1):
                break
            neg.append(next(i for i, (x, y) in enumerate(zip(a, ok)) if x == ans and not y))
            covered += count
        out.append({"pos": pos, "neg": neg})
    return out


@torch.no_grad()
def ce_scores(pos, neg, prompts: Tensor, responses: Tensor, *, beta: float = 1.0) -> Tensor:
    """s (n, L): the realized tokens' probabilities under softmax((1+β)·logits_p − β·logits_n)."""
    ids, P = torch.cat([prompts, responses], 1), prompts.shape[1]
    lp = pos(input_ids=ids).logits[:, P - 1:-1].float()  # position t predicts token t+1
    ln = neg(input_ids=ids).logits[:, P - 1:-1].float()
    return F.softmax((1 + beta) * lp - beta * ln, -1).gather(-1, responses[..., None])[..., 0].cpu()


# ------------------------------------------------------------------------------------- (c) the loss

def cdpo_loss(pi_w: Tensor, ref_w: Tensor, pi_l: Tensor, ref_l: Tensor, s: Tensor, *, gamma: float = 0.1,
              variant: str = "paper") -> Tensor:
    """Per-example cDPO loss (B,) from per-token log-probs (B, L) of chosen (w) and rejected (l)
    responses under the policy and the reference, and CE scores s (B, L) of the rejected tokens."""
    w = 1 - s.detach()  # no gradient into the frozen P_p / P_n
    if variant == "paper":
        return -F.logsigmoid(gamma * ((pi_w - ref_w).sum(-1) - (w * (pi_l - ref_l)).sum(-1)))
    if variant == "official_positionwise":
        return -F.logsigmoid(gamma * ((pi_w - ref_w) - w * (pi_l - ref_l))).mean(-1)
    raise ValueError(f"variant={variant!r} is not 'paper' or 'official_positionwise'.")


def arm_loss(arm: str, pi_w, ref_w, pi_l, ref_l, s, *, gamma: float) -> Tensor:
    """Mean loss of one batch for an arm: dpo, rpo (NLL weight 1 per token), cdpo, cdpo_positionwise."""
    from lab.align import LOSSES

    if arm.startswith("cdpo"):
        variant = "official_positionwise" if arm.endswith("positionwise") else "paper"
        return cdpo_loss(pi_w, ref_w, pi_l, ref_l, s, gamma=gamma, variant=variant).mean()
    pi = torch.stack([pi_w.sum(-1), pi_l.sum(-1)], 1)  # (B, 2) sequence log-probs
    ref = torch.stack([ref_w.sum(-1), ref_l.sum(-1)], 1)
    extra = {"chosen_len": torch.full((len(pi),), float(pi_w.shape[1]))} if arm == "rpo" else {}
    return LOSSES[arm](pi, ref, beta=gamma, **extra).mean()


def fine_tune(model, prompts: Tensor, responses: Tensor, *, steps: int, lr: float, batch_size: int,
              seed: int = 0, quiet: bool | None = None) -> list[float]:
    """SFT in place on (prompt, response) pairs, loss on the response tokens (P_p, P_n)."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in progress(range(steps), quiet=quiet, desc="sft"):
        i = torch.randint(len(prompts), (batch_size,), generator=g)
        loss = -response_logps(model, prompts[i], responses[i]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return losses


def train_arm(base, pairs: dict[str, Tensor], arm: str, *, gamma: float, **kw) -> tuple[torch.nn.Module, dict]:
    """One arm (dpo, rpo, cdpo, cdpo_positionwise) from `base` on pairs {prompt, chosen, rejected, s}
    (`lab.align.train.train_pairs`: the policy and its chosen / rejected log-likelihood log)."""
    return train_pairs(base, pairs, lambda b: arm_loss(arm, b["pi_w"], b["ref_w"], b["pi_l"], b["ref_l"], b["s"],
                                                       gamma=gamma), desc=arm, **kw)
