"""Hooks on any `transformers` model: capture activations, ablate heads, skip blocks, swap modules.

The one place where the lab reaches inside a model (TransformerLens-style, but on the unmodified
Hugging Face classes). Every operation is a context manager that puts the model back exactly as it
was on exit, also after an exception, so no ablated or patched copy leaks into the next measurement:

    with hooks.capture(hooks.layers(model)) as xs:      # inputs of every decoder block
        model(input_ids=ids)
    with hooks.ablate_heads(model, {17: [24]}):         # one attention head removed
        ...
    with hooks.zero_rows(model, [2]):                   # block 2's mixer silent at the last position
        ...
    with hooks.pruned(model, keep_layers=4):            # the first four blocks only
        ...
    with hooks.swap(model, {"model.layers.0.mlp.experts": new}):
        ...

Heads are ablated with the official Gather & Aggregate operator (Bick, Xing & Gu, ICML 2025; code
goombalab/Gather-and-Aggregate, `utils.remove_heads` / `keep_heads`): zero the input columns of the
mixer's output projection that belong to a head, W_out (d_model, H·d_head) viewed as (d_model, H,
d_head). That equals zeroing the head's output before o_proj/out_proj (zero ablation, not mean
ablation). SSM heads: a Mamba-2 value head (H heads of d_head), a Mamba-1 inner channel (d_head = 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

Heads = dict[int, Iterable[int]]  # layer -> head indices


# ------------------------------------------------------------------------------ where things live

def layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: `model.model.layers` (Llama, Mixtral, Qwen, Jamba) or `.backbone.layers` (Mamba)."""
    base = getattr(model, "model", None) or getattr(model, "backbone", None) or model
    if not hasattr(base, "layers"):
        raise TypeError(f"{type(model).__name__} has no decoder blocks at .model.layers or .backbone.layers.")
    return base.layers


def mixer(model: nn.Module, layer: int) -> nn.Module:
    """The sequence mixer of a block: self-attention, or the (Mamba-1/2) SSM mixer."""
    block = layers(model)[layer]
    for name in ("self_attn", "mixer", "mamba"):
        if getattr(block, name, None) is not None:  # Granite-4 hybrids keep the other kind's attribute as None
            return getattr(block, name)
    raise TypeError(f"block {layer} ({type(block).__name__}) has no self_attn/mixer/mamba module.")


def out_proj(model: nn.Module, layer: int) -> nn.Linear:
    """The mixer's output projection (o_proj of attention, out_proj of an SSM)."""
    m = mixer(model, layer)
    return m.o_proj if hasattr(m, "o_proj") else m.out_proj


def is_attention(model: nn.Module, layer: int) -> bool:
    """Whether a block's mixer is attention (it has an o_proj), not an SSM."""
    return hasattr(mixer(model, layer), "o_proj")


def head_shape(model: nn.Module, layer: int) -> tuple[int, int]:
    """(number of heads H, head width d_head) of a layer's mixer input to its output projection."""
    m, cfg = mixer(model, layer), model.config
    if hasattr(m, "o_proj"):  # attention: query heads (with GQA, K/V heads are shared; ablate at o_proj)
        H = cfg.num_attention_heads
        return H, m.o_proj.in_features // H
    if hasattr(m, "num_heads") and hasattr(m, "head_dim"):  # Mamba-2 SSD heads
        return m.num_heads, m.head_dim
    return m.out_proj.in_features, 1  # Mamba-1: every inner channel is a head


def name_of(model: nn.Module, module: nn.Module) -> str:
    """The dotted name of `module` inside `model` (what `swap` and `get_submodule` take)."""
    for name, m in model.named_modules():
        if m is module:
            return name
    raise ValueError(f"{type(module).__name__} is not a submodule of {type(model).__name__}.")


# -------------------------------------------------------------------------------------- capture

def _first_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """A module's input activation: its first positional argument, else `hidden_states=`."""
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def capture(modules: Sequence[nn.Module], *, output: bool = False) -> Iterator[list[list]]:
    """Within the block, every forward of `modules[i]` appends its input (or with `output=True` its
    output, the first element when it returns a tuple) to the i-th list yielded. Nothing is changed
    in the computation; the hooks are removed on exit."""
    store: list[list] = [[] for _ in modules]
    handles = []
    try:
        for i, m in enumerate(modules):
            if output:
                handles.append(m.register_forward_hook(
                    lambda _m, _a, out, i=i: store[i].append(out[0] if isinstance(out, tuple) else out)))
            else:
                handles.append(m.register_forward_pre_hook(
                    lambda _m, args, kwargs, i=i: store[i].append(_first_input(args, kwargs)), with_kwargs=True))
        yield store
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def run_with_cache(model: nn.Module, modules: Sequence[nn.Module], *, output: bool = False, **inputs):
    """One forward `model(**inputs)`; returns (its output, [the activation of each module]) — the last
    call's when a module runs more than once."""
    with capture(modules, output=output) as store:
        out = model(**inputs)
    return out, [s[-1] if s else None for s in store]


# -------------------------------------------------------------------------------- ablate heads

def head_mask(H: int, heads: Iterable[int], *, keep: bool) -> torch.Tensor:
    """(H,) of 0/1: zeros on `heads` (remove) or everywhere else (keep)."""
    heads = list(heads)
    if any(not 0 <= h < H for h in heads):
        raise IndexError(f"head indices {heads} out of range for {H} heads.")
    mask = torch.zeros(H) if keep else torch.ones(H)
    mask[heads] = 1.0 if keep else 0.0
    return mask


@contextmanager
def ablate_heads(model: nn.Module, heads: Heads, *, keep: bool = False) -> Iterator[nn.Module]:
    """Within the block, the listed heads are removed (`keep=False`) or are the only ones kept in
    their layers (`keep=True`): W_out[:, h, :] = 0 for the zeroed heads. Weights are restored
    bit-for-bit on exit, also after an exception."""
    saved = {}
    try:
        for layer, hs in heads.items():
            W = out_proj(model, layer).weight  # (d_model, H·d_head)
            H, d_head = head_shape(model, layer)
            saved[layer] = W.detach().clone()
            mask = head_mask(H, hs, keep=keep).to(W)
            with torch.no_grad():
                W.view(W.shape[0], H, d_head).mul_(mask[None, :, None])
        yield model
    finally:
        with torch.no_grad():
            for layer, W0 in saved.items():
                out_proj(model, layer).weight.copy_(W0)


@contextmanager
def zero_rows(model: nn.Module, layer_ids: Iterable[int], positions: Sequence[int] = (-1,)) -> Iterator[nn.Module]:
    """Within the block, the mixers of `layer_ids` output zero at the query `positions` (the input of their output
    projection is zeroed there, in every head). For attention this is the paper's hybrid operator: those rows of
    every head's attention matrix set to zero after the softmax, since a row's output is A[t] V (Bick, Xing & Gu
    zero the last row of every attention matrix of Zamba2). For an SSM it zeroes the same rows of its hidden
    attention. The hooks are removed on exit."""
    def zero(_m, args, kwargs):
        x = _first_input(args, kwargs).clone()
        x[:, list(positions)] = 0
        return ((x, *args[1:]), kwargs) if args else (args, kwargs | {"hidden_states": x})

    handles = [out_proj(model, layer).register_forward_pre_hook(zero, with_kwargs=True) for layer in layer_ids]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()


def head_norms(model: nn.Module, layer: int) -> torch.Tensor:
    """||W_out[:, h, :]||_F of every head of a layer: (H,). Zero means the head is switched off."""
    W = out_proj(model, layer).weight  # (d_model, H·d_head)
    H, d_head = head_shape(model, layer)
    return W.view(W.shape[0], H, d_head).pow(2).sum((0, 2)).sqrt()


def all_heads(model: nn.Module, layer: int) -> Heads:
    """Every head of one layer, as an `ablate_heads` argument (removing them all silences the mixer)."""
    return {layer: list(range(head_shape(model, layer)[0]))}


# ------------------------------------------------------------------------- skip or swap modules

class Skip(nn.Module):
    """A decoder block that passes the residual stream through unchanged, in the structure its model's loop
    unpacks: a tensor (Llama, Mamba-2, Jamba) or a tuple led by the hidden states (Bamba's blocks return
    (hidden states, attention weights)). The structure is learned once per block class, by running the original
    block on its first call (a tensor that a tuple-unpacking loop received would be split along the batch)."""

    n_out: dict[type, int] = {}  # block class -> 0 (a tensor) or the tuple's length

    def __init__(self, block: nn.Module | None = None):
        super().__init__()
        self._block = [block]  # in a list, so the original's weights are not registered here

    def forward(self, hidden_states, *args, **kwargs):
        block = self._block[0]
        if block is not None and type(block) not in Skip.n_out:
            out = block(hidden_states, *args, **kwargs)
            Skip.n_out[type(block)] = len(out) if isinstance(out, tuple) else 0
        n = Skip.n_out.get(type(block), 0)
        return (hidden_states, *[None] * (n - 1)) if n else hidden_states


@contextmanager
def pruned(model: nn.Module, *, keep_layers: int | None = None, skip: int | None = None) -> Iterator[nn.Module]:
    """Keep only the first `keep_layers` blocks (the later ones pass the residual through), or replace
    block `skip` by the identity. The original blocks come back on exit."""
    mods = layers(model)
    original = list(mods)
    try:
        if keep_layers is not None:
            for i in range(keep_layers, len(original)):
                mods[i] = Skip(original[i])
        if skip is not None:
            mods[skip] = Skip(original[skip])
        yield model
    finally:
        for i, block in enumerate(original):
            mods[i] = block


@contextmanager
def swap(model: nn.Module, replacements: dict[str, nn.Module]) -> Iterator[nn.Module]:
    """Within the block, each submodule named in `replacements` (dotted, as `named_modules` gives) is
    the module given; the originals come back on exit."""
    saved = {}
    try:
        for name, new in replacements.items():
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            saved[name] = (parent, child, getattr(parent, child))
            setattr(parent, child, new)
        yield model
    finally:
        for parent, child, old in saved.values():
            setattr(parent, child, old)
