"""Sampling from causal LMs for tiny, fixed-length responses (no KV cache: prompts are short); `cached_step`, one
forward with a KV cache on any transformers 5.x."""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from torch import Tensor


@torch.no_grad()
def sample(model, prefix: Tensor, steps: int, *, generator: torch.Generator, temperature: float = 1.0,
           ban: Tensor | None = None) -> Tensor:
    """`steps` tokens after each prefix row (n, P) -> (n, steps). temperature 0 is greedy; `ban` (n,)
    is a token id excluded at the first sampled position (−1: none), for the replacement test."""
    x, out = prefix, []
    for i in range(steps):
        logits = model(input_ids=x).logits[:, -1].float().cpu()  # (n, V)
        if i == 0 and ban is not None:
            ban = ban.cpu()  # the logits are on the host; ban may come from responses on the model's device
            rows = (ban >= 0).nonzero()[:, 0]
            logits[rows, ban[rows]] = -math.inf
        if temperature == 0:
            tok = logits.argmax(-1)
        else:
            tok = torch.multinomial(F.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        out.append(tok)
        x = torch.cat([x, tok[:, None].to(x.device)], 1)
    return torch.stack(out, 1) if out else prefix.new_zeros(len(prefix), 0).cpu()


def sample_responses(model, prompts: Tensor, k: int, length: int, **kw) -> Tensor:
    """k sampled responses per prompt: (n, k, length)."""
    return sample(model, prompts.repeat_interleave(k, 0), length, **kw).view(len(prompts), k, length)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from n samples with c correct (Chen et al., 2021): 1 − C(n−c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(ok: Tensor, ks) -> list[float]:
    """Mean over rows of the unbiased Pass@k of each row's K outcomes `ok` (m, K) bool, for each k in ks."""
    K = ok.shape[1]
    return [sum(pass_at_k(K, int(n), k) for n in ok.sum(1)) / len(ok) for k in ks]


__all__ = ["sample", "sample_responses", "pass_at_k", "mean_pass_at_k"]


def cached_step(model, input_ids: Tensor, past=None):
    """One forward with a KV cache: `(output, cache)`. transformers 5.2x names the cache `cache` (argument and output
    field; `past_key_values` deprecated), earlier 5.x releases `past_key_values` (only); the one this model's
    forward takes is used, so the lab runs on either (e.g. the 5.17 of a lent GPU machine's image)."""
    if "cache" in inspect.signature(model.forward).parameters:
        out = model(input_ids=input_ids, cache=past, use_cache=True)
        return out, out.cache
    out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
    return out, out.past_key_values
