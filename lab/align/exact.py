"""Exact enumeration of a tiny LM's response space: every response of length L over V tokens is
scored, so distributions, KLs and win rates over responses are computed exactly (no sampling).
Shared by the preference toys (EXPO's, HPS's and InfAlign's tiny transformers). A response set is scored
by `seq_logprobs` (any responses, one forward each) or, when it is all of V^L, by `all_logprobs` (one forward
over the V^(L−1) prefixes, the last position scoring every final token; `avoid_prob` sums a prefix tree the
same way). The two solvers, SFT onto a target distribution (`fit_exact`, `fit_all`) and the exact
KL-regularized objective (`train_rlhf`, `train_rlhf_all`), are gradient loops of `lab.align.train.optimize`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lab.align.train import optimize


def all_sequences(V: int, L: int) -> Tensor:
    """Every response of length L over V tokens: (V^L, L)."""
    return torch.cartesian_prod(*[torch.arange(V)] * L).reshape(-1, L)


def seq_logprobs(model, prompts: Tensor, seqs: Tensor, V: int) -> Tensor:
    """log π(y | x) for every prompt token x (C,) and response y: (C, S). `seqs` is (S, L), shared
    by the prompts, or (C, S, L), one set per prompt. The next-token softmax is over the V response
    tokens (ids 0..V-1) only, so all V^L responses exhaust the space and distributions are exact."""
    C, (S, L) = len(prompts), seqs.shape[-2:]
    seqs = seqs.expand(C, S, L)
    x = torch.cat([prompts[:, None, None].expand(C, S, 1), seqs], -1).reshape(C * S, L + 1)
    logp = model(input_ids=x).logits[:, :-1, :V].log_softmax(-1)  # (C·S, L, V)
    return logp.gather(-1, x[:, 1:, None])[..., 0].sum(-1).reshape(C, S)


def _prefix_forward(model, prompts: Tensor, tokens: Tensor, L: int, V: int) -> tuple[Tensor, Tensor]:
    """One forward over every prompt x (C,) × prefix of length L−1 over `tokens` (in `all_sequences` order):
    log π(prefix | x) (C·S,) and the next-token log-distribution after the prefix (C·S, V), rows prompt-major.
    Same next-token softmax over the V response tokens as `seq_logprobs`."""
    prefixes = tokens[all_sequences(len(tokens), L - 1)] if L > 1 else torch.zeros(1, 0, dtype=torch.long)  # (S, L−1)
    C, S = len(prompts), len(prefixes)
    x = torch.cat([prompts[:, None, None].expand(C, S, 1), prefixes.expand(C, S, L - 1)], -1).reshape(C * S, L)
    logp = model(input_ids=x).logits[..., :V].log_softmax(-1)  # (C·S, L, V): position t predicts token t+1
    return logp[:, :-1].gather(-1, x[:, 1:, None])[..., 0].sum(-1), logp[:, -1]  # log π(prefix | x), last step


def all_logprobs(model, prompts: Tensor, V: int, L: int) -> Tensor:
    """`seq_logprobs` over every response of `all_sequences(V, L)`: (C, V^L), from one forward over the V^(L−1)
    prefixes instead of V^L responses (the last position's distribution scores all V final tokens; lexicographic
    order, the last token running fastest). Equal up to float rounding, not bit for bit."""
    prefix, last = _prefix_forward(model, prompts, torch.arange(V), L, V)
    return (prefix[:, None] + last).reshape(len(prompts), -1)


def avoid_prob(model, prompts: Tensor, V: int, L: int, token: int) -> Tensor:
    """P(a response of length L contains no `token`), exactly, per prompt token (C,): one forward over the
    (V−1)^(L−1) token-free prefixes instead of all V^L responses; the last position's softmax sums the
    allowed final tokens. Same next-token softmax over the V response tokens as `seq_logprobs`."""
    keep = torch.tensor([v for v in range(V) if v != token])
    prefix, last = _prefix_forward(model, prompts, keep, L, V)
    last = last.index_select(-1, keep).logsumexp(-1)  # log π(last token ≠ `token` | x, prefix)
    return (prefix + last).reshape(len(prompts), -1).logsumexp(-1).exp()


def _sft(model, logprobs: Callable[[], Tensor], target_logp: Tensor, *, steps: int, lr: float,
         quiet: bool | None) -> list[float]:
    p = target_logp.exp()

    def step_loss(_: int) -> Tensor:
        return (p * (target_logp - logprobs())).sum(-1).mean()

    return optimize(model.parameters(), step_loss, steps=steps, lr=lr, desc="exact SFT", quiet=quiet)


def fit_exact(model, prompts: Tensor, seqs: Tensor, target_logp: Tensor, V: int, *, steps: int,
              lr: float, quiet: bool | None = None) -> list[float]:
    """SFT by enumeration: minimize KL(target ‖ π_model), averaged over prompts, with Adam; returns
    the KL before each step."""
    return _sft(model, lambda: seq_logprobs(model, prompts, seqs, V), target_logp, steps=steps, lr=lr, quiet=quiet)


def fit_all(model, prompts: Tensor, target_logp: Tensor, V: int, L: int, *, steps: int, lr: float,
            quiet: bool | None = None) -> list[float]:
    """`fit_exact` over every response of `all_sequences(V, L)`, scored by `all_logprobs`."""
    return _sft(model, lambda: all_logprobs(model, prompts, V, L), target_logp, steps=steps, lr=lr, quiet=quiet)


def _tail_probs(p: Tensor, N: int, kind: str) -> Tensor:
    """Probability of each (sorted, unique-reward) group under BoN / WoN of N draws: (G,)."""
    F = p.cumsum(0).clamp(max=1.0)
    F_minus = F - p
    if N == 1:
        return p
    if kind == "bon":
        return F ** N - F_minus ** N
    return (1 - F_minus) ** N - (1 - F) ** N


def win_rate(logp: Tensor, ref_logp: Tensor, r: Tensor, N: int = 1, kind: str = "bon") -> Tensor:
    """Exact win rate of T(π) against T(π_ref) under reward r, ties counted ½, per prompt: (C,).

    logp, ref_logp, r: (C, S) over the enumerated responses; T is BoN or WoN of N draws (N = 1: plain)."""
    out = []
    for c in range(len(r)):
        values, group = torch.unique(r[c], return_inverse=True)  # ascending reward groups
        P = torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, logp[c].double().exp())
        Q = torch.zeros(len(values), dtype=torch.float64).index_add_(0, group, ref_logp[c].double().exp())
        PT, QT = _tail_probs(P, N, kind), _tail_probs(Q, N, kind)
        below = QT.cumsum(0) - QT  # P_ref_T(reward < this group)
        out.append((PT * (below + 0.5 * QT)).sum())
    return torch.stack(out)


def calibrate_exact(ref_logp: Tensor, r: Tensor) -> Tensor:
    """The reward's quantile under the reference, C(x, y) = P_{y'~π_ref(·|x)}(r(y') < r(y)) + ½P(=), exactly over
    the enumerated responses: (C, S)."""
    p = ref_logp.double().exp()  # (C, S)
    less = (r[:, None, :] < r[:, :, None]).double()  # (C, S_y, S_y')
    equal = (r[:, None, :] == r[:, :, None]).double()
    return ((less + 0.5 * equal) * p[:, None, :]).sum(-1)


def tilt_logp(ref_logp: Tensor, R: Tensor, beta: float) -> Tensor:
    """The closed-form KL-regularized optimum log π ∝ log π_ref + R/β, per prompt: (C, S)."""
    return (ref_logp.double() + R / beta).log_softmax(-1)


def beta_for_kl(ref_logp: Tensor, R: Tensor, target: float) -> float:
    """One β shared by all prompts with mean KL(π_β ‖ π_ref) = target (bisection on log β)."""
    lo, hi = -15.0, 15.0
    for _ in range(100):
        mid = (lo + hi) / 2
        q = tilt_logp(ref_logp, R, math.exp(mid))
        kl_ = (q.exp() * (q - ref_logp.double())).sum(-1).mean()
        lo, hi = (mid, hi) if kl_ > target else (lo, mid)
    return math.exp((lo + hi) / 2)


def _rlhf(policy, logprobs: Callable[[], Tensor], ref_logp: Tensor, R: Tensor, beta: float, *, steps: int,
          lr: float, quiet: bool | None) -> Tensor:
    def step_loss(_: int) -> Tensor:
        logp = logprobs()
        return -(logp.exp() * (R - beta * (logp - ref_logp))).sum(-1).mean()

    optimize(policy.parameters(), step_loss, steps=steps, lr=lr, desc="exact RLHF", quiet=quiet)
    with torch.no_grad():
        return logprobs()


def train_rlhf(policy, prompts: Tensor, seqs: Tensor, ref_logp: Tensor, R: Tensor, beta: float, V: int, *,
               steps: int, lr: float, quiet: bool | None = None) -> Tensor:
    """Maximize the exact KL-regularized objective Σ_y π_θ(y)[R(y) − β(log π_θ(y) − log π_ref(y))],
    averaged over prompts, with Adam. Returns log π_θ (C, S)."""
    return _rlhf(policy, lambda: seq_logprobs(policy, prompts, seqs, V), ref_logp, R, beta, steps=steps, lr=lr,
                 quiet=quiet)


def train_rlhf_all(policy, prompts: Tensor, ref_logp: Tensor, R: Tensor, beta: float, V: int, L: int, *,
                   steps: int, lr: float, quiet: bool | None = None) -> Tensor:
    """`train_rlhf` over every response of `all_sequences(V, L)`, scored by `all_logprobs`. Returns log π_θ
    (C, V^L)."""
    return _rlhf(policy, lambda: all_logprobs(policy, prompts, V, L), ref_logp, R, beta, steps=steps, lr=lr,
                 quiet=quiet)
