"""A tiny multimodal LM in the LLaVA layout: image patches -> a linear projector -> a prefix of
`inputs_embeds` before the text tokens of a Llama-style decoder. Small enough to train on a CPU; the
same interface (patches, token ids) is what a real MLLM pipeline would feed through its own
vision tower and projector.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.modeling_outputs import CausalLMOutput

from lab.models.zoo import tiny_llama

IGNORE = -100


class TinyMLLM(nn.Module):
    """`lm` (a causal LM with `get_input_embeddings`) and `projector`: (patch_dim -> d_model)."""

    def __init__(self, lm: nn.Module, patch_dim: int):
        super().__init__()
        self.lm = lm
        self.projector = nn.Linear(patch_dim, lm.config.hidden_size)
        self.config = lm.config  # keys the training cache (`lab.models.fit`), with the patch size
        self.config.patch_dim = patch_dim

    def embed(self, patches: Tensor, input_ids: Tensor) -> Tensor:
        """(B, P, patch_dim), (B, T) -> (B, P + T, d): the visual prefix, then the token embeddings."""
        return torch.cat([self.projector(patches), self.lm.get_input_embeddings()(input_ids)], 1)

    def forward(self, patches: Tensor, input_ids: Tensor, labels: Tensor | None = None) -> CausalLMOutput:
        """`.logits` at the text positions (B, T, V) and, with `labels` (B, T; −100 = no loss), `.loss`:
        the mean next-token loss (position t predicts token t+1). Trains with `lab.models.fit`."""
        P = patches.shape[1]
        logits = self.lm(inputs_embeds=self.embed(patches, input_ids)).logits[:, P:]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                                   ignore_index=IGNORE)
        return CausalLMOutput(loss=loss, logits=logits)

    @torch.no_grad()
    def generate(self, patches: Tensor, input_ids: Tensor, steps: int) -> Tensor:
        """Greedy continuation (B, steps) of each (image, prompt)."""
        x, out = input_ids, []
        for _ in range(steps):
            nxt = self(patches, x).logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            x = torch.cat([x, nxt], 1)
        return torch.cat(out, 1)


def tiny_mllm(*, vocab_size: int, patch_dim: int = 48, d_model: int = 64, n_layers: int = 2, n_heads: int = 4,
              max_len: int = 32) -> TinyMLLM:
    """A `tiny_llama` decoder with a patch projector (LLaVA-style prefix)."""
    return TinyMLLM(tiny_llama(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                               max_len=max_len), patch_dim)
