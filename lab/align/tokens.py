"""Token-level tools for a causal LM whose responses cannot be enumerated: the next-token distributions along
given responses, the token-level KL summed along them, and ancestral sampling. `V` restricts every next-token
softmax to the response tokens 0..V−1, as the enumerated toys do (`lab.align.exact.seq_logprobs`), so the same
code runs on a toy and checks against its exact enumeration. EXPO's regularizer beyond enumeration
(`lab.align.expo.reference_kl`) is built on them."""

from __future__ import annotations

import torch
from torch import Tensor


def token_dists(model, prompts: Tensor, responses: Tensor, V: int | None = None) -> Tensor:
    """log π(· | x, y_<t) at every response position: prompts (N, P), responses (N, T) -> (N, T, V). `V`
    restricts the next-token softmax to ids 0..V−1, as the enumerated toy does (`lab.align.exact.seq_logprobs`)."""
    logits = model(input_ids=torch.cat([prompts, responses], 1)).logits[:, prompts.shape[1] - 1:-1]  # (N, T, ·)
    return (logits if V is None else logits[..., :V]).float().log_softmax(-1)


def token_kl(ref_dists: Tensor, dists: Tensor) -> Tensor:
    """Σ_t KL(π_ref(·|x, y_<t) ‖ π_θ(·|x, y_<t)) along each response: (N, T, V) log-distributions -> (N,)."""
    return (ref_dists.exp() * (ref_dists - dists)).sum((-1, -2))


@torch.no_grad()
def sample_responses(model, prompts: Tensor, length: int, generator: torch.Generator, V: int | None = None) -> Tensor:
    """Ancestral samples y ~ π(·|x) of `length` tokens, one per prompt row: (N, P) -> (N, length)."""
    y = prompts[:, :0]
    for _ in range(length):
        logits = model(input_ids=torch.cat([prompts, y], 1)).logits[:, -1]  # (N, vocab)
        probs = (logits if V is None else logits[:, :V]).float().softmax(-1)
        y = torch.cat([y, torch.multinomial(probs, 1, generator=generator)], 1)
    return y
