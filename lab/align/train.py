"""Preference training for causal LMs: policy + frozen reference, masked sequence log-probs, and the
losses of the `lab.align.LOSSES` registry.

A batch holds n responses per example (column 0 chosen, the rest rejected, ranked for listwise
losses), each already concatenated with its prompt and right-padded:

    input_ids, attention_mask, response_mask: (B, n, T)    [rewards: (B, n), for HPS's sampler]

`response_mask` marks the tokens whose log-probs form log π(y|x) (the response, not the prompt).

`train_preferences` trains on such padded batches (any registry loss; tested here, and the trainer of
the checkpoint-scale path). `train_pairs` is the per-token variant for fixed-length (prompt, chosen,
rejected) tensors, used by token-weighted losses (cDPO) and by RIP's DPO arms: the loss sees per-token
log-probs.

`optimize` (from `lab.models.train`, re-exported here) is the one gradient loop under both, and under
every other training loop of `lab.align` (EXPO's and HPS's toys, SFT, the exact-enumeration solvers,
the tabular policies): a paper says what a step's loss is, the loop is the same everywhere.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor

from lab.models.train import optimize

__all__ = ["optimize", "token_logprobs", "sequence_logprobs", "sequential_kl", "response_kls", "chosen_token_kl",
           "preference_loss", "train_preferences", "response_dists", "response_logps", "train_pairs"]


def token_logprobs(model, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """log p(x_t | x_<t) for t ≥ 1 and the full next-token log-distributions: (N, T−1), (N, T−1, V)."""
    logp = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, input_ids[:, 1:, None])[..., 0], logp


def sequence_logprobs(model, batch: dict[str, Tensor], *, with_dists: bool = False):
    """Σ over response tokens of log π(y_t | x, y_<t) for every response: (B, n) (and the per-token
    distributions (B·n, T−1, V) when `with_dists`)."""
    B, n, T = batch["input_ids"].shape
    flat = {k: batch[k].reshape(B * n, T) for k in ("input_ids", "attention_mask", "response_mask")}
    tok, dists = token_logprobs(model, flat["input_ids"], flat["attention_mask"])  # (B·n, T−1)
    seq = (tok * flat["response_mask"][:, 1:]).sum(-1).reshape(B, n)
    return (seq, dists) if with_dists else seq


def sequential_kl(ref_dists: Tensor, dists: Tensor, mask: Tensor | None = None) -> Tensor:
    """D_SeqKL(x, y; π_ref ‖ π_θ) = Σ_t KL(π_ref(·|x, y_<t) ‖ π_θ(·|x, y_<t)) over the positions `mask` keeps, from
    (N, T, V) log-distributions: (N,) (TDPO's sequential KL; EXPO's KL surrogate on chosen responses)."""
    p = ref_dists.exp()  # Σ_v p·(log p − log q) as two batched dot products: no (N, T, V) product is built
    kl_t = torch.einsum("ntv,ntv->nt", p, ref_dists) - torch.einsum("ntv,ntv->nt", p, dists)  # (N, T)
    return (kl_t if mask is None else kl_t * mask).sum(-1)


def response_kls(ref_dists: Tensor, dists: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """`sequential_kl` over each response's tokens of a padded batch, from `sequence_logprobs`' (B·n, T−1, V)
    distributions: (B, n)."""
    B, n, T = batch["input_ids"].shape
    return sequential_kl(ref_dists, dists, batch["response_mask"].reshape(B * n, T)[:, 1:]).reshape(B, n)


def chosen_token_kl(ref_dists: Tensor, dists: Tensor, batch: dict[str, Tensor]) -> Tensor:
    """Σ_t KL(π_ref(·|prefix) ‖ π_θ(·|prefix)) over the chosen response's tokens: (B,). A surrogate for EXPO's
    regularizer KL(π_ref ‖ π_θ): it equals that KL in expectation only when the responses are drawn from π_ref
    (chain rule); along a preference dataset's chosen responses it under- or over-weights them (the 01 EXPO
    notebook measures the gap; `lab.align.expo.reference_kl` is the unbiased estimator, on π_ref samples)."""
    return response_kls(ref_dists, dists, batch)[:, 0]


def preference_loss(policy, reference, batch: dict[str, Tensor], loss: str, **options) -> Tensor:
    """Mean registry loss of one batch; the reference runs without gradients. EXPO gets `chosen_token_kl` as its
    KL term (a surrogate on the batch's chosen responses, not the unbiased estimator; see that function), TDPO the
    sequential KLs of both responses (`response_kls`)."""
    from lab.align import LOSSES

    pi, dists = sequence_logprobs(policy, batch, with_dists=True)
    with torch.no_grad():
        ref, ref_dists = sequence_logprobs(reference, batch, with_dists=True)
    if loss == "expo":
        options = {**options, "kl": chosen_token_kl(ref_dists, dists, batch)}
    if loss == "hps":
        options = {**options, "r": batch["rewards"]}
    if loss == "tdpo":
        options = {**options, "kl": response_kls(ref_dists, dists, batch)}
    return LOSSES[loss](pi, ref, **options).mean()


def train_preferences(policy, reference, batches: Callable[[torch.Generator], dict[str, Tensor]], loss: str, *,
                      steps: int, lr: float, seed: int = 0, grad_clip: float = 1.0, quiet: bool | None = None,
                      **options) -> list[float]:
    """Adam on `policy` for `steps` batches drawn as `batches(generator)`; returns the per-step loss."""
    gen = torch.Generator().manual_seed(seed)
    reference.eval()
    policy.train()
    losses = optimize(policy.parameters(), lambda _: preference_loss(policy, reference, batches(gen), loss, **options),
                      steps=steps, lr=lr, grad_clip=grad_clip, desc=loss, quiet=quiet)
    policy.eval()
    return losses


def response_dists(model, prompts: Tensor, responses: Tensor) -> Tensor:
    """log π(·| x, y_<t) over the vocabulary at every response position: (n, L, V)."""
    P = prompts.shape[1]
    return model(input_ids=torch.cat([prompts, responses], 1)).logits[:, P - 1:-1].float().log_softmax(-1)


def response_logps(model, prompts: Tensor, responses: Tensor, mask: Tensor | None = None) -> Tensor:
    """log π(y_t | x, y_<t) for every response token, zero where `mask` is False: (n, L)."""
    out = response_dists(model, prompts, responses).gather(-1, responses[..., None])[..., 0]  # t predicts t+1
    return out if mask is None else out * mask


def train_pairs(base, pairs: dict[str, Tensor], loss: Callable[[dict[str, Tensor]], Tensor], *, steps: int, lr: float,
                batch_size: int, seed: int = 0, every: int = 10, desc: str = "pairs", kl: bool = False,
                quiet: bool | None = None) -> tuple[torch.nn.Module, dict]:
    """Train a copy of `base` (kept frozen as the reference) on `pairs` {prompt (n, P), chosen, rejected
    (n, L), optional chosen_mask / rejected_mask (n, L), any per-pair extras}. `loss(batch)` gets the
    batch's extras plus per-token pi_w, ref_w, pi_l, ref_l (B, L), and with `kl` the sequential KLs
    D_SeqKL(π_ref ‖ π_θ) of the chosen and the rejected responses, kl_w and kl_l (B,) (TDPO). Returns the policy
    and the mean chosen / rejected response log-likelihoods every `every` steps (Fig. 4-style dynamics)."""
    policy, ref = copy.deepcopy(base).train(), base.eval()
    g = torch.Generator().manual_seed(seed)
    x, yw, yl = pairs["prompt"], pairs["chosen"], pairs["rejected"]
    mw, ml = pairs.get("chosen_mask"), pairs.get("rejected_mask")
    with torch.no_grad():
        ref_dw, ref_dl = response_dists(ref, x, yw), response_dists(ref, x, yl)
    fixed = ("prompt", "chosen", "rejected", "chosen_mask", "rejected_mask")
    extras = {k: v for k, v in pairs.items() if k not in fixed}
    log = {"step": [], "chosen": [], "rejected": [], "loss": []}

    def token(d: Tensor, y: Tensor, m: Tensor | None) -> Tensor:
        out = d.gather(-1, y[..., None])[..., 0]
        return out if m is None else out * m

    ref_w, ref_l = token(ref_dw, yw, mw), token(ref_dl, yl, ml)
    if not kl:
        del ref_dw, ref_dl  # (n, L, V): kept only for the KL

    @torch.no_grad()
    def record(step: int) -> None:
        log["step"].append(step)
        log["chosen"].append(response_logps(policy, x, yw, mw).sum(-1).mean().item())
        log["rejected"].append(response_logps(policy, x, yl, ml).sum(-1).mean().item())

    def step_loss(step: int) -> Tensor:
        if step % every == 0:
            record(step)
        i = torch.randint(len(x), (batch_size,), generator=g)
        m_w, m_l = (None if m is None else m[i] for m in (mw, ml))
        d_w, d_l = response_dists(policy, x[i], yw[i]), response_dists(policy, x[i], yl[i])
        batch = {k: v[i] for k, v in extras.items()}
        batch.update(pi_w=token(d_w, yw[i], m_w), ref_w=ref_w[i], pi_l=token(d_l, yl[i], m_l), ref_l=ref_l[i])
        if kl:
            batch.update(kl_w=sequential_kl(ref_dw[i], d_w, m_w), kl_l=sequential_kl(ref_dl[i], d_l, m_l))
        return loss(batch)

    log["loss"] = optimize(policy.parameters(), step_loss, steps=steps, lr=lr, grad_clip=1.0, desc=desc, quiet=quiet)
    record(steps)
    return policy.eval(), log
