r"""Entropy-minimisation test-time adaptation, the baselines TLM is measured against (TLM, ICML 2025, Sec. 5), on a
causal LM: the entropy is that of the model's own k-token greedy continuation of the input.

- **Tent** — Wang, Shelhamer, Liu, Olshausen & Darrell, "Tent: Fully Test-Time Adaptation by Entropy
  Minimization", ICLR 2021 (official code: `DequanWang/tent`, tent.py `forward_and_adapt`, whose
  `softmax_entropy` is −Σ p log p of the model's own prediction, averaged over the batch): minimise the mean
  predictive entropy of every test input, weight 1.
- **EATA** — Niu, Wu, Zhang, Chen, Zheng, Zhao & Tan, "Efficient Test-Time Model Adaptation without Forgetting",
  ICML 2022 (official code: `mr-eggplant/EATA`, eata.py `forward_and_adapt_eata` and main.py's Fisher): the same
  entropy on *reliable* (E < E0, Eq. 3) and *non-redundant* (cosine filter against a moving average, Eqs. 4-5)
  inputs, weighted 1/exp(E − E0), plus the anti-forgetting Fisher regulariser α Σ F (θ − θ0)² (Eqs. 8-9); no
  backward pass on a skipped input, as the official code.
- **COME** — Zhang, Bian, Kong, Zhao & Zhang, "COME: Test-time Adaption by Conservatively Minimizing Entropy",
  ICLR 2025 (official code: `BlueWhaleLab/COME`, tent_come.py `dirichlet_entropy`): Tent with the softmax entropy
  replaced by the entropy of an *opinion* — belief and an explicit uncertainty mass from a Dirichlet over the
  prediction — whose minimum is not a one-hot (`opinion_entropy`). COME is a drop-in for Tent, EATA or SAR; the TLM
  paper does not say on which it ran COME, so here it is Tent's loop (`tent_come.py`).

`tent_objective`, `eata_objective` and `come_objective` return an `Objective` for the loops of `lab.adapt.loop`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lab.adapt.loop import Objective


def continuation(model, input_ids: Tensor, k: int, raw: bool = False) -> tuple[Tensor, Tensor]:
    """The model's own k greedy continuation tokens (chosen without gradient) and the log-distributions that
    chose them, with gradient: (tokens (B, k), log p (B, k, V)); `raw=True` gives the logits instead of log p.
    The first k − 1 tokens are generated without gradient; one forward with gradient over them gives all k
    distributions, and the k-th token is the argmax of the last (the same greedy token, one forward fewer)."""
    with torch.no_grad():
        x = input_ids
        for _ in range(k - 1):
            x = torch.cat([x, model(input_ids=x).logits[:, -1:].argmax(-1)], 1)
    logits = model(input_ids=x).logits[:, input_ids.shape[1] - 1:].float()  # (B, k, V)
    logp = logits.log_softmax(-1)
    return torch.cat([x[:, input_ids.shape[1]:], logp[:, -1:].detach().argmax(-1)], 1), logits if raw else logp


def entropy_of_continuation(model, input_ids: Tensor, k: int) -> Tensor:
    """Mean predictive entropy (nats) over the model's own k greedy continuation tokens: (B,), with
    gradient through the distributions (the continuation itself is chosen without gradient)."""
    logp = continuation(model, input_ids, k)[1]
    return -(logp.exp() * logp).sum(-1).mean(-1)



def tent_objective(k: int = 8) -> Objective:
    """Tent (Wang et al., ICLR 2021) as the TLM paper runs it on LLMs (Sec. 5): minimise the entropy of the
    model's own k-token greedy continuation, every input, weight 1."""
    return lambda model, x: (entropy_of_continuation(model, x, k).mean(), torch.tensor(True))


def opinion_entropy(z: Tensor, K: int | None = None) -> Tensor:
    """COME's entropy of opinion (official `dirichlet_entropy`) of logits z (…, K) -> (…): z is rescaled to its own
    norm held constant (z/‖z‖ · sg(‖z‖): the value is z, but the gradient cannot grow the norm); evidence e = exp(z),
    Dirichlet α = e + 1, S = Σ α = Σ e + K; belief b_k = e_k / S, uncertainty u = K / S; the entropy of
    (b_1 … b_K, u) with 1e-7 added to each entry, as the official code. K is the class count (the official code
    writes ImageNet's 1000); for an LM, the vocabulary. Computed in log space (logits of an LM overflow exp)."""
    n = z.norm(dim=-1, keepdim=True)
    z = z / n * n.detach()
    K = z.shape[-1] if K is None else K
    log_s = torch.logaddexp(z.logsumexp(-1, keepdim=True), torch.tensor(math.log(K), dtype=z.dtype))
    q = torch.cat([z - log_s, math.log(K) - log_s], -1).exp() + 1e-7
    return -(q * q.log()).sum(-1)


def come_objective(k: int = 8) -> Objective:
    """COME (Zhang et al., ICLR 2025) in Tent's loop: minimise the mean entropy of opinion over the model's own
    k-token greedy continuation, every input, weight 1."""
    return lambda model, x: (opinion_entropy(continuation(model, x, k, raw=True)[1]).mean(), torch.tensor(True))


def fisher_information(model, inputs: list[Tensor], k: int) -> dict[str, tuple[Tensor, Tensor]]:
    """EATA's anti-forgetting weights (Niu et al., ICML 2022, Eq. 9; official `mr-eggplant/EATA`, main.py):
    the diagonal Fisher of the trainable parameters on in-distribution inputs, i.e. the squared gradient of the
    cross-entropy against the model's own greedy continuation (pseudo-labels), averaged over the batches
    `inputs` (each (B, T)). Returns {name: (F, θ0)}."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    for x in inputs:
        tokens, logp = continuation(model, x, k)
        ce = -logp.gather(-1, tokens[..., None]).mean()
        for n, g in zip(params, torch.autograd.grad(ce, list(params.values()), allow_unused=True)):
            if g is not None:
                fisher[n] += g.detach() ** 2
    return {n: (f / len(inputs), params[n].detach().clone()) for n, f in fisher.items()}


def eata_objective(e0: float, k: int = 8, *, d_margin: float = 1.0, fishers: dict | None = None,
                   alpha: float = 2000.0, per_sample: Callable[..., Tensor] | None = None) -> Objective:
    """EATA (Niu et al., ICML 2022; official `mr-eggplant/EATA`, eata.py `forward_and_adapt_eata`) on the
    model's k-token greedy continuation: a sample is *reliable* if its entropy E < E0 (Eq. 3) and *non-redundant*
    if its mean predicted distribution p̄ has |cos(p̄, m)| < d_margin with m the moving average (0.9) of the
    kept samples' p̄ (Eqs. 4-5; none before the first); kept samples' entropies are weighted 1/exp(E − E0) and
    averaged, plus the Fisher regulariser α Σ F (θ − θ0)² (Eqs. 8-9). No kept sample: no backward, as the
    official code. `per_sample(model, x)` (B,) replaces the entropy in the weighted loss only (filters and weights
    stay the entropy's): the lab's `entropy_as_ppl` control passes the input's NLL."""
    state: dict[str, Tensor | None] = {"m": None}

    def f(model, x):
        logp = continuation(model, x, k)[1]
        p = logp.exp()
        e = -(p * logp).sum(-1).mean(-1)  # (B,)
        pbar = p.mean(1).detach()  # (B, V)
        keep = e.detach() < e0
        if state["m"] is not None:
            keep &= torch.nn.functional.cosine_similarity(state["m"][None], pbar, dim=1).abs() < d_margin
        if keep.any():
            new = pbar[keep].mean(0)
            state["m"] = new if state["m"] is None else 0.9 * state["m"] + 0.1 * new
        term = e if per_sample is None else per_sample(model, x)
        loss = (torch.exp(e0 - e.detach()) * term * keep).sum() / keep.sum().clamp_min(1)
        if fishers:
            loss = loss + alpha * sum((fishers[n][0] * (q - fishers[n][1]) ** 2).sum()
                                      for n, q in model.named_parameters() if n in fishers)
        return loss, keep.any()

    return f
