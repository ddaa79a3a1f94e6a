"""Gather & Aggregate heads — Bick, Xing & Gu, "Understanding the Skill Gap in Recurrent Language
Models: The Role of the Gather-and-Aggregate Mechanism", ICML 2025 (arXiv 2504.18574; code:
goombalab/Gather-and-Aggregate).

In-context retrieval in both Transformers and SSMs runs through two kinds of heads (§3):
a **Gather head** (layer l) makes the last token of each context segment (an MMLU option's "\\n")
attend over its segment, summarising it; an **Aggregate head** (layer l+1) at the prediction
position puts almost all of its weight on the summary of the matching segment and copies its
letter. They are few, so each is a bottleneck: removing one sends letter accuracy to chance while
knowledge that needs no retrieval is intact.

The operator is the official one (`utils.remove_heads` / `keep_heads`): zero the input columns of
the mixer's output projection that belong to a head, W_out (d_model, H·d_head) viewed as
(d_model, H, d_head). That equals zeroing the head's output before o_proj/out_proj (zero ablation,
not mean ablation). Here it is a context manager that restores the exact weights on exit, so no
ablated copy leaks into the next configuration (the official notebook reloads the model instead).
SSM heads: a Mamba-2 value head (H heads of d_head), a Mamba-1 inner channel (d_head = 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

Heads = dict[int, Iterable[int]]  # layer -> head indices

# the notebook's controls: the substitutions a skeptic would make (`control=` in the notebook)
CONTROLS = {
    "random_heads": "remove as many heads as the aggregate layer has, drawn at random from both layers of the "
                    "minimal model, instead of the aggregate layer's heads",
    "shuffled": "measure the aggregate row's mass on a randomly drawn wrong option instead of the answer's option",
    "untrained": "the same two architectures at their random initialisation, never trained",
}

# (gather (layer, head), aggregate (layer, head)) reported in the paper / official notebook
PAPER_HEADS = {"meta-llama/Llama-3.1-8B-Instruct": ((16, 22), (17, 24))}


def paper_heads(model_name: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The paper's G and A for a hub id, or for a local folder with the same name; None if unknown."""
    base = model_name.rstrip("/").split("/")[-1].lower()
    return next((h for k, h in PAPER_HEADS.items() if k.split("/")[-1].lower() == base), None)
Evaluate = Callable[[], float]  # accuracy of the model in its current (ablated) state


# ---------------------------------------------------------------------------- where the heads live

def layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: `model.model.layers` (Llama, Mixtral, Jamba) or `.backbone.layers` (Mamba)."""
    base = getattr(model, "model", None) or getattr(model, "backbone", None) or model
    return base.layers


def mixer(model: nn.Module, layer: int) -> nn.Module:
    """The sequence mixer of a block: self-attention, or the (Mamba-1/2) SSM mixer."""
    block = layers(model)[layer]
    for name in ("self_attn", "mixer", "mamba"):
        if hasattr(block, name):
            return getattr(block, name)
    raise TypeError(f"block {layer} ({type(block).__name__}) has no self_attn/mixer/mamba module.")


def out_proj(model: nn.Module, layer: int) -> nn.Linear:
    m = mixer(model, layer)
    return m.o_proj if hasattr(m, "o_proj") else m.out_proj


def head_shape(model: nn.Module, layer: int) -> tuple[int, int]:
    """(number of heads H, head width d_head) of a layer's mixer input to its output projection."""
    m, cfg = mixer(model, layer), model.config
    if hasattr(m, "o_proj"):  # attention: query heads (with GQA, K/V heads are shared; ablate at o_proj)
        H = cfg.num_attention_heads
        return H, m.o_proj.in_features // H
    if hasattr(m, "num_heads") and hasattr(m, "head_dim"):  # Mamba-2 SSD heads
        return m.num_heads, m.head_dim
    return m.out_proj.in_features, 1  # Mamba-1: every inner channel is a head


# ------------------------------------------------------------------------------------ the operator

def head_mask(H: int, heads: Iterable[int], *, keep: bool) -> torch.Tensor:
    """(H,) of 0/1: zeros on `heads` (remove) or everywhere else (keep)."""
    heads = list(heads)
    if any(not 0 <= h < H for h in heads):
        raise IndexError(f"head indices {heads} out of range for {H} heads.")
    mask = torch.zeros(H) if keep else torch.ones(H)
    mask[heads] = 1.0 if keep else 0.0
    return mask


@contextmanager
def ablate(model: nn.Module, heads: Heads, *, keep: bool = False) -> Iterator[nn.Module]:
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


class _Skip(nn.Module):
    """A block that passes the residual stream through unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


@contextmanager
def pruned(model: nn.Module, *, keep_layers: int | None = None, skip: int | None = None) -> Iterator[nn.Module]:
    """Keep only the first `keep_layers` blocks (cumulative pruning from the top, §3), or replace
    block `skip` by the identity. The original blocks come back on exit."""
    mods = layers(model)
    original = list(mods)
    try:
        if keep_layers is not None:
            for i in range(keep_layers, len(original)):
                mods[i] = _Skip()
        if skip is not None:
            mods[skip] = _Skip()
        yield model
    finally:
        for i, block in enumerate(original):
            mods[i] = block


def all_heads(model: nn.Module, layer: int) -> Heads:
    """Every head of one layer, as an `ablate` argument (removing them all silences the layer's mixer)."""
    return {layer: list(range(head_shape(model, layer)[0]))}


def random_heads(model: nn.Module, layer_ids: Iterable[int], n: int, generator: torch.Generator) -> Heads:
    """`n` heads drawn uniformly without replacement from all heads of `layer_ids`: the random-heads control
    (an ablation of the same size as the one it stands in for, not targeted at any layer)."""
    pool = [(layer, h) for layer in layer_ids for h in range(head_shape(model, layer)[0])]
    if not 0 <= n <= len(pool):
        raise ValueError(f"cannot draw {n} heads from {len(pool)}.")
    out: dict[int, list[int]] = {}
    for i in torch.randperm(len(pool), generator=generator)[:n].tolist():
        out.setdefault(pool[i][0], []).append(pool[i][1])
    return {layer: sorted(hs) for layer, hs in out.items()}


# ------------------------------------------------------------------------------------ the protocol

def pruning_curve(model: nn.Module, evaluate: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each metric with the first k blocks kept, k = 1..L (the paper's Fig. 2 curve)."""
    L = len(layers(model))
    curve = {name: [] for name in evaluate}
    for k in range(1, L + 1):
        with pruned(model, keep_layers=k):
            for name, f in evaluate.items():
                curve[name].append(f())
    return curve


def collapse_layer(curve: list[float], *, chance: float, margin: float = 0.5) -> int | None:
    """Index of the last block the retrieval metric needs (the aggregate layer in the paper's
    protocol): the smallest k whose curve clears chance + margin·(max - chance); None when the
    curve never rises above chance (nothing to localise)."""
    top = max(curve)
    if top <= chance:
        return None
    bar = chance + margin * (top - chance)
    return next(k for k, v in enumerate(curve) if v >= bar)


def head_sweep(model: nn.Module, layer_ids: Iterable[int], evaluate: Evaluate) -> torch.Tensor:
    """Accuracy drop when removing each single head of each listed layer: (len(layers), H)."""
    base = evaluate()
    rows = []
    for layer in layer_ids:
        H, _ = head_shape(model, layer)
        row = []
        for h in range(H):
            with ablate(model, {layer: [h]}):
                row.append(base - evaluate())
        rows.append(row)
    return torch.tensor(rows)


def four_configurations(model: nn.Module, gather: tuple[int, int], aggregate: tuple[int, int],
                        evaluate: Evaluate) -> dict[str, float]:
    """The official keep/remove table: in the gather and aggregate layers keep only {G, A}, then
    also drop G, A or both (`none`)."""
    (lg, g), (la, a) = gather, aggregate
    configs = {"gather + aggregate": ([g], [a]), "only aggregate": ([], [a]),
               "only gather": ([g], []), "none": ([], [])}
    out = {}
    for name, (keep_g, keep_a) in configs.items():
        keep = {lg: keep_g, la: keep_a} if lg != la else {lg: keep_g + keep_a}
        with ablate(model, keep, keep=True):
            out[name] = evaluate()
    return out


@dataclass
class Discovery:
    """What `discover` measured: accuracies, per-head drops, the G&A heads and their ablations."""

    letter: float
    cloze: float
    layer_ids: list[int]
    drop: torch.Tensor  # (len(layer_ids), H) letter-accuracy drop per removed head
    cloze_drop: torch.Tensor  # (len(layer_ids), H)
    gather: tuple[int, int]  # (layer, head)
    aggregate: tuple[int, int]
    removed: dict[str, tuple[float, float]]  # "gather"/"aggregate" -> (letter, cloze) without it
    other_max: float  # largest letter drop of any other single head in those layers
    table: dict[str, float]  # the four keep-only configurations


def discover(model: nn.Module, letter: Evaluate, cloze: Evaluate, layer_ids: tuple[int, int], *,
             heads: tuple[tuple[int, int], tuple[int, int]] | None = None) -> Discovery:
    """The head-level protocol on the (gather layer, aggregate layer) pair (§3, notebook steps 2-3):
    sweep single-head removals, take the top head of each layer as G and A (or use the given
    `heads`, e.g. the paper's L16H22 / L17H24 for Llama-3.1-8B), then measure removing each and the
    four keep-only configurations."""
    lg, la = layer_ids
    drop = head_sweep(model, [lg, la], letter)
    cloze_drop = head_sweep(model, [lg, la], cloze)
    if heads is None:
        heads = ((lg, int(drop[0].argmax())), (la, int(drop[1].argmax())))
    gather, aggregate = heads
    removed = {}
    for name, (layer, h) in (("gather", gather), ("aggregate", aggregate)):
        with ablate(model, {layer: [h]}):
            removed[name] = (letter(), cloze())
    others = drop.clone()
    others[0, gather[1]] = others[1, aggregate[1]] = float("-inf")
    return Discovery(letter(), cloze(), [lg, la], drop, cloze_drop, gather, aggregate, removed,
                     float(others.max()), four_configurations(model, gather, aggregate, letter))


# -------------------------------------------------------------------------------- attention maps

@torch.no_grad()
def attention(model: nn.Module, input_ids: torch.Tensor, layer: int) -> torch.Tensor:
    """Every head's (hidden-)attention matrix of one layer: (B, H, T, T).

    Softmax attention for attention layers (eager attention); for Mamba-1/2 the SSM's hidden
    attention (`lab.interp.hidden_attention`), which reproduces the layer's scan output."""
    m = mixer(model, layer)
    if hasattr(m, "o_proj"):
        out = model(input_ids=input_ids, output_attentions=True, use_cache=False)
        return out.attentions[layer].float()
    from lab.interp.hidden_attention import hidden_attention

    return hidden_attention(model, input_ids, layer)


def sharpness(row: torch.Tensor, target: int | Sequence[int]) -> tuple[float, float]:
    """An aggregate row's focus: mass on the target position(s) Σ_t |a_t| / Σ_j |a_j| and the entropy
    (nats) of |a| normalised. |·| because SSM matrices can be negative and do not sum to 1."""
    p = row.abs().float()
    p = p / p.sum()
    entropy = -(p * p.clamp_min(1e-12).log()).sum().item()
    return p[torch.as_tensor(target)].sum().item(), entropy


def decoy_positions(ids: torch.Tensor, target: torch.Tensor, delim_id: int, generator: torch.Generator
                    ) -> torch.Tensor:
    """For each row of `ids` (n, T), the position of a delimiter drawn uniformly among those that are not
    `target` (n,), the answer's: the shuffled-labels control of the sharpness measurement."""
    out = []
    for row, t in zip(ids, target.tolist()):
        others = [p for p in (row == delim_id).nonzero().flatten().tolist() if p != t]
        if not others:
            raise ValueError("a prompt has no delimiter besides the answer's.")
        out.append(others[int(torch.randint(len(others), (), generator=generator))])
    return torch.tensor(out)


def max_entropy(T: int) -> float:
    return math.log(T)


# ------------------------------------------------------------------------- toy training prior

def head_norms(model: nn.Module, layer: int) -> torch.Tensor:
    """||W_out[:, h, :]||_F of every head of a layer: (H,). Zero means the head is switched off."""
    W = out_proj(model, layer).weight  # (d_model, H·d_head)
    H, d_head = head_shape(model, layer)
    return W.view(W.shape[0], H, d_head).pow(2).sum((0, 2)).sqrt()


@dataclass(frozen=True)
class HeadLasso:
    """Group-lasso prior on heads, λ Σ_layers Σ_h ||W_out[:, h, :]||_F, applied by its proximal
    operator after each optimizer step from step `start` on: W_h ← W_h · max(0, 1 − lr·λ / ||W_h||).

    Not part of the paper. Pretrained LLMs concentrate G&A in a few heads because heads are scarce
    across many skills; a toy trained on one task instead spreads retrieval over redundant heads.
    The proximal step sets unused heads to exactly zero (a smooth penalty only makes them small, and
    argmax accuracy still reads a small backup head), so the toy's circuits become few-head as in
    the paper. Under Adam, a step moves each weight by about lr, so λ is in units of that step."""

    lam: float = 5.0
    start: int = 0  # let the circuit form before pruning

    def __call__(self, model: nn.Module) -> torch.Tensor:
        """The prior's value (not added to the loss: the proximal step applies it)."""
        return self.lam * sum(head_norms(model, layer).sum() for layer in range(len(layers(model)))).detach()

    @torch.no_grad()
    def prox(self, model: nn.Module, lr: float, step: int) -> None:
        if step < self.start:
            return
        for layer in range(len(layers(model))):
            W = out_proj(model, layer).weight
            H, d_head = head_shape(model, layer)
            shrink = (1 - lr * self.lam / head_norms(model, layer).clamp_min(1e-12)).clamp_min(0)  # (H,)
            W.view(W.shape[0], H, d_head).mul_(shrink[None, :, None])


# ------------------------------------------------------------------------------------- scoring

def accuracy(model: nn.Module, tokenizer, examples: list[dict], choices: list[str] | None = None) -> float:
    """Share of examples whose answer has the highest log-prob among the choices (lm-eval style).

    `choices` shared by all examples (one batched pass), or each example's own `choices`."""
    from lab.models.score import choice_logprobs

    if choices is not None:
        logp = choice_logprobs(model, tokenizer, [e["prompt"] for e in examples], choices)  # (N, C)
        target = torch.tensor([choices.index(e["answer"]) for e in examples])
        return (logp.argmax(-1) == target).float().mean().item()
    hits = [choice_logprobs(model, tokenizer, [e["prompt"]], e["choices"])[0].argmax().item()
            == e["choices"].index(e["answer"]) for e in examples]
    return sum(hits) / len(hits)
