"""The tiny Llama the adaptation tests adapt."""

import torch

from lab.models import tiny_llama

V = 16


def model(seed=0):
    """A fresh 1-layer Llama (vocabulary V), seeded, in eval mode."""
    torch.manual_seed(seed)
    return tiny_llama(vocab_size=V, d_model=32, n_layers=1, n_heads=2, max_len=32).eval()
