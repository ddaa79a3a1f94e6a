"""Scoring a causal LM on multiple-choice continuations, for any tokenizer."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch


@torch.no_grad()
def choice_logprobs(model, tokenizer, prompts: Sequence[str], choices: Sequence[str], *,
                    batch_size: int = 256) -> torch.Tensor:
    """log p(choice | prompt) summed over the choice's tokens, for every prompt and choice: (N, C).

    A choice is the text after the prompt and one space. When every choice is a single token this is
    one forward pass per batch of prompts (gathering the next-token log-probs); otherwise each
    prompt+choice sequence is scored. Sequences are batched by length, so no padding is needed.
    """
    device = next(model.parameters()).device
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]
    p_ids = [enc(p) for p in prompts]
    c_ids = [enc(f"{prompts[0]} {c}")[len(p_ids[0]):] for c in choices]
    out = torch.empty(len(prompts), len(choices))
    if all(len(c) == 1 for c in c_ids):  # fast path: one next-token distribution per prompt
        cols = torch.tensor([c[0] for c in c_ids])
        for idx, seqs in _by_length(p_ids):
            for s in range(0, len(idx), batch_size):
                x = torch.tensor(seqs[s:s + batch_size], device=device)
                logp = model(input_ids=x).logits[:, -1].float().log_softmax(-1).cpu()  # (B, V)
                out[idx[s:s + batch_size]] = logp[:, cols]
        return out
    seqs = [(i, j, p + enc(f"{prompts[i]} {c}")[len(p):]) for i, p in enumerate(p_ids) for j, c in enumerate(choices)]
    for length, group in _group(seqs).items():
        for s in range(0, len(group), batch_size):
            chunk = group[s:s + batch_size]
            x = torch.tensor([g[2] for g in chunk], device=device)  # (B, T)
            logp = model(input_ids=x).logits.float().log_softmax(-1).cpu()  # (B, T, V)
            for b, (i, j, ids) in enumerate(chunk):
                n_p = len(p_ids[i])
                tgt = torch.tensor(ids[n_p:])
                out[i, j] = logp[b, n_p - 1:length - 1].gather(1, tgt[:, None]).sum()
    return out


def choice_accuracy(model, tokenizer, examples: list[dict], choices: Sequence[str] | None = None) -> float:
    """Share of examples whose `answer` has the highest log-prob among the choices (lm-eval style).

    `choices` shared by all examples (one batched pass), or each example's own `choices`."""
    if choices is not None:
        logp = choice_logprobs(model, tokenizer, [e["prompt"] for e in examples], choices)  # (N, C)
        target = torch.tensor([choices.index(e["answer"]) for e in examples])
        return (logp.argmax(-1) == target).float().mean().item()
    hits = [choice_logprobs(model, tokenizer, [e["prompt"]], e["choices"])[0].argmax().item()
            == e["choices"].index(e["answer"]) for e in examples]
    return sum(hits) / len(hits)


def _by_length(seqs: list[list[int]]) -> list[tuple[torch.Tensor, list[list[int]]]]:
    """(indices, sequences) for each group of equal-length sequences."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, ids in enumerate(seqs):
        groups[len(ids)].append(i)
    return [(torch.tensor(idx), [seqs[i] for i in idx]) for idx in groups.values()]


def _group(seqs: list) -> dict[int, list]:
    groups: dict[int, list] = defaultdict(list)
    for item in seqs:
        groups[len(item[2])].append(item)
    return groups
