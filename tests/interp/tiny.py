"""Tiny Llama and Mamba-2 models for the head-ablation tests, and a reader of which heads are switched on."""

import torch

from lab.models import hooks, tiny_llama, tiny_mamba2

V = 20


def models() -> dict:
    """A fresh 2-layer Llama (4 heads of 8) and Mamba-2 (2 heads of 16), seeded alike every call."""
    torch.manual_seed(0)
    return {"llama": tiny_llama(vocab_size=V, d_model=32, n_layers=2, n_heads=4),
            "mamba2": tiny_mamba2(vocab_size=V, d_model=32, n_layers=2, head_dim=16)}


def alive(m, l, h):
    """Whether head h of layer l is switched on (read off the live output-projection weights)."""
    return bool(hooks.out_proj(m, l).weight.view(32, 4, 8)[:, h].abs().sum() > 0)
