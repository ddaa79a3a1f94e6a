"""Text rows to token batches for a `transformers` causal LM: the padded (B, n, T) layout of the checkpoint paths.

`tokenize` turns preference rows (`lab.data.load`: `{prompt, chosen, rejected}` or `{prompt, responses, rewards}`,
ranked best first) into the padded batch `lab.align.train.preference_loss` reads, as TRL's DPO trainer builds it:
the prompt (its chat template applied when it is a message list) and each response tokenized apart, the response
closed by EOS, concatenated, right-padded to the batch's longest; truncation keeps the prompt's *end* and the
response's start:

    input_ids, attention_mask, response_mask: (B, n, T)   rewards: (B, n) (plain pairs: (1, 0))

Its parts (`render_prompt`, `encode_prompt`, `encode_response`, `pad_batch`, `pad_id`) serve the other checkpoint
paths too: `lab.align.hf_prefs` (LoRA arms and their evaluation), cDPO's and TLM's checkpoint paths.
"""

from __future__ import annotations

import torch
from torch import Tensor


def render_prompt(tokenizer, prompt) -> str:
    """A message list through the tokenizer's chat template (generation prompt added); text as it is."""
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return "".join(f"{m['role']}: {m['content']}\n" for m in prompt) + "assistant: "


def encode_prompt(tokenizer, prompt, max_prompt_len: int) -> list[int]:
    """Prompt ids, its last `max_prompt_len` kept (a chat template already holds its special tokens)."""
    ids = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=isinstance(prompt, str))["input_ids"]
    return ids[-max_prompt_len:]


def encode_response(tokenizer, text: str) -> list[int]:
    """Response ids closed by EOS (when the tokenizer has one)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return tokenizer(text, add_special_tokens=False)["input_ids"] + eos


def pad_id(tokenizer) -> int:
    return next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)


def pad_batch(seqs: list[list[tuple[list[int], list[int]]]], pad: int) -> dict[str, Tensor]:
    """B examples × n (prompt ids, response ids) -> right-padded (B, n, T) input_ids, attention_mask, response_mask."""
    B, n = len(seqs), len(seqs[0])
    if any(len(ex) != n for ex in seqs):
        raise ValueError("every row of a batch needs the same number of responses.")
    T = max(len(p) + len(r) for ex in seqs for p, r in ex)
    out = {"input_ids": torch.full((B, n, T), pad), "attention_mask": torch.zeros(B, n, T, dtype=torch.long),
           "response_mask": torch.zeros(B, n, T)}
    for b, ex in enumerate(seqs):
        for k, (p, r) in enumerate(ex):
            out["input_ids"][b, k, :len(p) + len(r)] = torch.tensor(p + r)
            out["attention_mask"][b, k, :len(p) + len(r)] = 1
            out["response_mask"][b, k, len(p):len(p) + len(r)] = 1.0
    return out


def tokenize(tokenizer, rows: list[dict], *, max_len: int = 256, max_prompt_len: int = 128) -> dict[str, Tensor]:
    """Rows -> the padded (B, n, T) batch and rewards (B, n); pairs are (chosen, rejected) with rewards (1, 0)."""
    if max_prompt_len >= max_len:
        raise ValueError(f"max_prompt_len={max_prompt_len} must be below max_len={max_len}.")
    seqs, rewards = [], []
    for row in rows:
        responses = row["responses"] if "responses" in row else [row["chosen"], row["rejected"]]
        p = encode_prompt(tokenizer, row["prompt"], max_prompt_len)
        seqs.append([(p, encode_response(tokenizer, y)[:max_len - len(p)]) for y in responses])
        rewards.append(row.get("rewards", [1.0, 0.0]))
    return pad_batch(seqs, pad_id(tokenizer)) | {"rewards": torch.tensor(rewards, dtype=torch.float32)}
