r"""EXPO on a tiny transformer — the companion of `lab.align.expo` (Hu, Kong, He & Wipf, ICML 2025, arXiv
2506.07492): the §5 preservation and interpolation tests with parameter sharing. A 2-layer Llama scores every
response of length L over V tokens (V^L per prompt, `lab.align.exact`); π_ref comes from exact SFT onto random
targets, prompt 0 is *good* (π* = π_ref) and prompt 1 *bad* (π* a random log-linear tilt of π_ref). Each training
step draws pairs from π_ref with soft BT(π*) labels; EXPO's KL term is exact over all responses. Also the
measurement behind `expo.reference_kl`: the token KL's expectation along π_ref samples against along a preference
dataset's chosen responses, exactly (`token_kl_expectations`). Kept apart from the paper module for its size.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor

from lab.align.exact import all_sequences, fit_exact, seq_logprobs
from lab.align.expo import Config, kl_exact, pair_loss
from lab.align.tokens import token_dists, token_kl
from lab.align.train import optimize
from lab.core.stages import stage


def tilt(logp: Tensor, target_kl: float, generator: torch.Generator) -> Tensor:
    """A random log-linear tilt of a distribution, π ∝ exp(logp + τ·z), with τ set by bisection so
    that KL(π ‖ exp(logp)) = target_kl: the toy's π* for the *bad* prompt."""
    z = torch.randn(logp.shape, generator=generator, dtype=logp.dtype)
    lo, hi = 0.0, 50.0
    for _ in range(60):
        tau = (lo + hi) / 2
        q = (logp + tau * z).log_softmax(-1)
        lo, hi = (tau, hi) if (q.exp() * (q - logp)).sum() < target_kl else (lo, tau)
    return (logp + tau * z).log_softmax(-1)


def train_lm(method: str, policy, prompts: Tensor, seqs: Tensor, ref_logp: Tensor, star_logp: Tensor, lam: float, *,
             V: int, steps: int, lr: float, batch: int, generator: torch.Generator,
             quiet: bool | None = None) -> Tensor:
    """Preference training of a tiny LM: each step draws `batch` pairs per prompt from π_ref with soft
    BT labels from π* (the expected loss over labels), applies the method's pairwise loss, and for
    EXPO adds λ·KL(π_ref ‖ π_θ) computed exactly over all responses. Returns log π_θ (C, S)."""
    C = len(prompts)

    def step_loss(_: int) -> Tensor:
        logp = seq_logprobs(policy, prompts, seqs, V)  # (C, S)
        i = torch.multinomial(ref_logp.exp(), batch, replacement=True, generator=generator)  # (C, batch)
        j = torch.multinomial(ref_logp.exp(), batch, replacement=True, generator=generator)
        p_ij = torch.sigmoid(star_logp.gather(1, i) - star_logp.gather(1, j)).flatten()  # P(y_i ≻ y_j)
        a, b = logp.gather(1, i).flatten(), logp.gather(1, j).flatten()
        ra, rb = ref_logp.gather(1, i).flatten(), ref_logp.gather(1, j).flatten()
        fwd, bwd = torch.stack([a, b], 1), torch.stack([b, a], 1)
        rfwd, rbwd = torch.stack([ra, rb], 1), torch.stack([rb, ra], 1)
        kl_ = kl_exact(ref_logp, logp).repeat_interleave(batch) if method == "expo" else None  # (C·batch,)
        loss = p_ij * pair_loss(method, fwd, rfwd, lam, kl_) + (1 - p_ij) * pair_loss(method, bwd, rbwd, lam, kl_)
        return loss.sum() / C / batch

    optimize(policy.parameters(), step_loss, steps=steps, lr=lr, desc=f"LM {method}", quiet=quiet)
    with torch.no_grad():
        return seq_logprobs(policy, prompts, seqs, V)


@dataclass
class LMToy:
    """The tiny-transformer preservation/interpolation setting: prompt 0 is *good* (π* = π_ref),
    prompt 1 *bad* (π* a tilt of π_ref with KL(π*‖π_ref) = cfg.bad_kl)."""

    reference: torch.nn.Module
    prompts: Tensor  # (2,) prompt token ids
    seqs: Tensor  # (S, L) every response
    ref_logp: Tensor  # (2, S) log π_ref
    star_logp: Tensor  # (2, S) log π*
    sft_kl: float  # KL(SFT target ‖ π_ref) reached by the exact SFT


def lm_toy(cfg: Config, seed: int) -> LMToy:
    """Build π_ref by exact SFT of a tiny Llama onto random targets, then π* for both prompts."""
    from lab.models import tiny_llama

    seqs, prompts = all_sequences(cfg.V, cfg.L), torch.tensor([cfg.V, cfg.V + 1])
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    model = tiny_llama(vocab_size=cfg.V + 2, d_model=cfg.d_model, n_layers=2, n_heads=2, d_ff=2 * cfg.d_model,
                       max_len=cfg.L + 1)
    target = torch.randn(2, len(seqs), generator=g).log_softmax(-1)
    kls = fit_exact(model, prompts, seqs, target, cfg.V, steps=cfg.sft_steps, lr=3e-3)
    with torch.no_grad():
        ref = seq_logprobs(model, prompts, seqs, cfg.V)
    star = torch.stack([ref[0], tilt(ref[1].double(), cfg.bad_kl, g).float()])
    return LMToy(model.eval(), prompts, seqs, ref, star, kls[-1])


def lm_sweep(toy: LMToy, cfg: Config, seed: int, methods: tuple[str, ...] = ("dpo", "expo")
             ) -> tuple[dict[tuple[str, float], Tensor], dict[tuple[str, float], torch.nn.Module]]:
    """Train a copy of the toy's π_ref with each method at each λ of `cfg.lm_lams` (`train_lm`; pairs drawn
    from a generator seeded with seed + 1, the same for every run). Returns {(method, λ): KL(π* ‖ π_θ) on the
    (good, bad) prompts (2,)} and {(method, λ): the trained policy}."""
    kls, policies = {}, {}
    for method in methods:
        for lam in cfg.lm_lams:
            kls[method, lam], policies[method, lam] = lm_run(toy, cfg.loss(method), lam, V=cfg.V, steps=cfg.lm_steps,
                                                             lr=cfg.lm_lr, batch=cfg.lm_batch, seed=seed)
    return kls, policies


@stage
def lm_run(toy: LMToy, loss: str, lam: float, *, V: int, steps: int, lr: float, batch: int,
           seed: int) -> tuple[Tensor, torch.nn.Module]:
    """One run of `lm_sweep`, keyed by the loss it trains (a control that substitutes EXPO's loss reuses the
    substitute's own runs): KL(π* ‖ π_θ) on the (good, bad) prompts and the trained policy."""
    policy = copy.deepcopy(toy.reference)
    logp = train_lm(loss, policy, toy.prompts, toy.seqs, toy.ref_logp, toy.star_logp, lam, V=V, steps=steps, lr=lr,
                    batch=batch, generator=torch.Generator().manual_seed(seed + 1))
    return (toy.star_logp.exp() * (toy.star_logp - logp)).sum(-1), policy


# ------------------------------------- the regularizer beyond enumeration, measured exactly on the toy

def token_kl_expectations(toy: LMToy, policy, V: int) -> dict[str, Tensor]:
    """Exactly, on the toy's enumerated responses, per prompt (C,): KL(π_ref ‖ π_θ); the expectation of the
    summed token KL along responses drawn from π_ref (`reference_kl`'s); and along the *chosen* response of a
    pair drawn from π_ref and labelled by BT(π*), i.e. a preference dataset's chosen responses, whose law is
    q(y) = 2 π_ref(y) Σ_j π_ref(j) σ(log π*(y) − log π*(j))."""
    C, S = toy.ref_logp.shape
    x, y = toy.prompts[:, None].repeat_interleave(S, 0), toy.seqs.repeat(C, 1)  # (C·S, 1), (C·S, L)
    with torch.no_grad():
        tk = token_kl(token_dists(toy.reference, x, y, V), token_dists(policy, x, y, V)).reshape(C, S)
        logp = seq_logprobs(policy, toy.prompts, toy.seqs, V)
    p_ref, star = toy.ref_logp.exp(), toy.star_logp
    chosen = 2 * p_ref * (torch.sigmoid(star[:, :, None] - star[:, None, :]) * p_ref[:, None, :]).sum(-1)  # (C, S)
    return {"exact KL(π_ref‖π_θ)": kl_exact(toy.ref_logp, logp), "token KL along π_ref samples": (p_ref * tk).sum(-1),
            "token KL along chosen responses": (chosen * tk).sum(-1)}
