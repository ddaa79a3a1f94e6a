"""Head and block ablation experiments on any model the lab builds or loads, built on the operators of
`lab.models.hooks`: the pruning curve (blocks kept from the bottom), the single-head sweep, random head
sets of a given size or shape, and heads under test set against random heads of the same layers — the
skeptic's question "would any heads do?", since in a small model removing *any* heads costs accuracy.
Each experiment takes the heads (`hooks.Heads`: layer -> head indices) and an `Evaluate`, a
zero-argument score of the model in its current (ablated) state, so it serves any paper and metric.

The protocol follows Gather & Aggregate (Bick, Xing & Gu, ICML 2025; code goombalab/Gather-and-Aggregate),
which uses these to find its (gather, aggregate) heads (`lab.interp.gather_aggregate`). `HeadLasso`, a
group-lasso prior that switches heads off during training, is a training aid that is not part of the paper.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from lab.models import hooks

Heads = hooks.Heads  # layer -> head indices
Evaluate = Callable[[], float]  # accuracy of the model in its current (ablated) state


# ------------------------------------------------------------------------------ random head sets

def random_heads(model: nn.Module, layer_ids: Iterable[int], n: int, generator: torch.Generator) -> Heads:
    """`n` heads drawn uniformly without replacement from all heads of `layer_ids`: a random-heads control
    (an ablation of the same size as the one it stands in for, not targeted at any layer)."""
    pool = [(layer, h) for layer in layer_ids for h in range(hooks.head_shape(model, layer)[0])]
    if not 0 <= n <= len(pool):
        raise ValueError(f"cannot draw {n} heads from {len(pool)}.")
    out: dict[int, list[int]] = {}
    for i in torch.randperm(len(pool), generator=generator)[:n].tolist():
        out.setdefault(pool[i][0], []).append(pool[i][1])
    return {layer: sorted(hs) for layer, hs in out.items()}


def random_like(model: nn.Module, heads: Heads, generator: torch.Generator) -> Heads:
    """As many heads in each layer as `heads` lists there, drawn uniformly without replacement from that
    layer's heads (the draw may hit the listed ones): a random stand-in of the same shape."""
    return {layer: sorted(torch.randperm(hooks.head_shape(model, layer)[0], generator=generator)[:len(hs)].tolist())
            for layer, hs in heads.items()}


# ------------------------------------------------------------------------------ the layer level

def pruning_curve(model: nn.Module, evaluate: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each metric with the first k blocks kept, k = 1..L (cumulative pruning from the top, G&A's Fig. 2)."""
    L = len(hooks.layers(model))
    curve = {name: [] for name in evaluate}
    for k in range(1, L + 1):
        with hooks.pruned(model, keep_layers=k):
            for name, f in evaluate.items():
                curve[name].append(f())
    return curve


def collapse_layer(curve: list[float], *, chance: float, margin: float = 0.5) -> int | None:
    """Index of the last block the retrieval metric needs (the aggregate layer in Gather & Aggregate's
    protocol): the smallest k whose curve clears chance + margin·(max - chance); None when the
    curve never rises above chance (nothing to localise)."""
    top = max(curve)
    if top <= chance:
        return None
    bar = chance + margin * (top - chance)
    return next(k for k, v in enumerate(curve) if v >= bar)


# ------------------------------------------------------------------------------- the head level

def head_sweep(model: nn.Module, layer_ids: Iterable[int], evaluate: Evaluate) -> torch.Tensor:
    """Accuracy drop when removing each single head of each listed layer: (len(layers), max H), nan past a layer's
    own heads (a hybrid's attention and SSM blocks have different head counts)."""
    base = evaluate()
    rows = []
    for layer in layer_ids:
        H, _ = hooks.head_shape(model, layer)
        row = []
        for h in range(H):
            with hooks.ablate_heads(model, {layer: [h]}):
                row.append(base - evaluate())
        rows.append(row)
    width = max(map(len, rows))
    return torch.tensor([r + [float("nan")] * (width - len(r)) for r in rows])


# ------------------------------------------------------------------------ against random heads

def versus_random(model: nn.Module, heads: Heads, evaluate: Evaluate, *, n_draws: int, seed: int,
                  control: bool = False, draw: Callable[[torch.Generator], Heads] | None = None,
                  keep: bool = True) -> dict[str, float]:
    """`heads` (G&A's {G, A}) against random heads of the same layers (the skeptic's question: would any do?).

    Accuracy with `heads` removed and with only `heads` kept in their layers (`hooks.ablate_heads`, the
    official out_proj-column operator), beside the mean of `n_draws` same-shape random sets (`random_like`,
    or `draw(generator)`; generator seeded with `seed`); "excess drop" = random removed − removed, "excess
    kept" = kept − random kept (`keep=False`: removals only). With `control` (a random-heads control)
    `heads` is itself replaced by the mean of `n_draws` further random sets, so the excesses measure random
    against random. Score on prompts that did not choose `heads`, or the argmax that picked them inflates
    the excess drop."""
    g = torch.Generator().manual_seed(seed)
    draw = draw or partial(random_like, model, heads)

    def scores(hs: Heads) -> list[float]:
        with hooks.ablate_heads(model, hs):
            out = [evaluate()]
        if keep:
            with hooks.ablate_heads(model, hs, keep=True):
                out.append(evaluate())
        return out

    def mean_random() -> list[float]:
        return torch.tensor([scores(draw(g)) for _ in range(n_draws)]).mean(0).tolist()

    rand = mean_random()
    own = mean_random() if control else scores(heads)
    out = {"removed": own[0], "random removed": rand[0], "excess drop": rand[0] - own[0]}
    if keep:
        out |= {"kept": own[1], "random kept": rand[1], "excess kept": own[1] - rand[1]}
    return out


def layer_versus_random(model: nn.Module, pair: tuple[int, int], evaluate: Evaluate, *, n_draws: int, seed: int,
                        control: bool = False) -> dict[str, float]:
    """Every head of the later layer of `pair` (G&A's aggregate layer) removed against as many heads drawn at
    random from both layers of `pair` (`random_heads`), `versus_random` with removals only: "excess drop" is
    the accuracy that layer's heads carry beyond random heads of the two layers. When the draw is half of the
    pool (two layers of equal size) every other draw is the complement of the one before (antithetic
    pairs: each is still a uniform draw, and a pair's mean no longer depends on how many heads of each
    layer one draw happened to take)."""
    layer_ids, n = sorted(set(pair)), hooks.head_shape(model, pair[1])[0]
    pool = {(layer, h) for layer in layer_ids for h in range(hooks.head_shape(model, layer)[0])}
    pending: list[Heads] = []

    def draw(g: torch.Generator) -> Heads:
        if pending:
            return pending.pop()
        heads = random_heads(model, layer_ids, n, g)
        if 2 * n == len(pool):
            rest = sorted(pool - {(layer, h) for layer, hs in heads.items() for h in hs})
            pending.append({layer: [h for l2, h in rest if l2 == layer] for layer in layer_ids
                            if any(l2 == layer for l2, _ in rest)})
        return heads

    la = pair[1]
    return versus_random(model, hooks.all_heads(model, la), evaluate, n_draws=n_draws, seed=seed,
                         control=control, draw=draw, keep=False)


# ---------------------------------------------------------------------- a training prior on heads

@dataclass(frozen=True)
class HeadLasso:
    """Group-lasso prior on heads, λ Σ_layers Σ_h ||W_out[:, h, :]||_F, applied by its proximal
    operator after each optimizer step from step `start` on: W_h ← W_h · max(0, 1 − lr·λ / ||W_h||).

    Not part of Gather & Aggregate. Pretrained LLMs concentrate G&A in a few heads because heads are scarce
    across many skills; a toy trained on one task instead spreads retrieval over redundant heads.
    The proximal step sets unused heads to exactly zero (a smooth penalty only makes them small, and
    argmax accuracy still reads a small backup head), so the toy's circuits become few-head as in
    the paper's LLMs. Under Adam, a step moves each weight by about lr, so λ is in units of that step.

    Kept, and tested, as the record of that attempt (notebook 09 cites it): it did not make the toy's
    aggregate role single-head, so notebook 09 trains without it."""

    lam: float = 5.0
    start: int = 0  # let the circuit form before pruning

    def __call__(self, model: nn.Module) -> torch.Tensor:
        """The prior's value (not added to the loss: the proximal step applies it)."""
        norms = (hooks.head_norms(model, layer).sum() for layer in range(len(hooks.layers(model))))
        return self.lam * sum(norms).detach()

    @torch.no_grad()
    def prox(self, model: nn.Module, lr: float, step: int) -> None:
        if step < self.start:
            return
        for layer in range(len(hooks.layers(model))):
            W = hooks.out_proj(model, layer).weight
            H, d_head = hooks.head_shape(model, layer)
            shrink = (1 - lr * self.lam / hooks.head_norms(model, layer).clamp_min(1e-12)).clamp_min(0)  # (H,)
            W.view(W.shape[0], H, d_head).mul_(shrink[None, :, None])
