"""HC-SMoE (Chen et al., ICML 2025): retraining-free merging of sparse-MoE experts by hierarchical clustering.

arXiv 2410.08589, official code `wazenmai/HC-SMoE` (`hcsmoe/merging/grouping_mixtral.py`, `clustering.py`).
An SMoE layer is y = Σ_i P(x)_i E_i(x), E(x) = (SiLU(x W_gate) ⊙ x W_up) W_down, P the renormalised top-k
router softmax (Sec. 2). HC-SMoE reduces the n experts of every layer to r, per layer:

1. usage frequency f_j: how often expert j is among a token's top-k on calibration text, normalised to sum 1
   (official `compute_all_usages`, mode "frequency");
2. expert-output feature o_j = E_{x∼D_cal}[E_j(x)] ∈ R^H, the mean over ALL tokens entering the layer, not only
   those routed to j (Sec. 3.2; one pass of the unmerged model);
3. agglomerative clustering of {o_j} with Euclidean distances and average linkage
   d(A, B) = Σ_{a∈A, b∈B} ||o_a − o_b|| / (|A||B|) until r clusters remain (Sec. 3.2) — scipy `linkage` +
   `fcluster`. The official `hierarchical_clustering` is a hand-written loop; its "complete" branch merges the
   pair of largest distance (argmax), which is not complete linkage — scipy's correct one is used here. The
   shipped scripts pass `--cluster hirarchical` (sic), which falls through to the official k-means (its own
   k-means++ seeding, assignment by per-centre z-scored distances, at most 100 iterations, no guard against empty
   clusters); `cluster(..., method="kmeans")` is scikit-learn's k-means++ on Euclidean distances, a stand-in for
   that path, not a port of it;
4. frequency-weighted merging inside each cluster C, for W_gate, W_up, W_down alike (Sec. 3.3):
   Ŵ_C = Σ_{j∈C} f_j W_j / Σ_{j∈C} f_j (the official code adds ε to the denominator; a cluster whose members are
   never routed is averaged uniformly here instead of being zeroed).

The merged model as published keeps the router: every original index j ∈ C points to Ŵ_C, so the gates of two
top-k picks in one cluster add (`aliased`, the official module aliasing). `smaller` builds a really smaller
model of the same class: fused expert tensors with r experts, router rows merged (frequency-weighted like the
experts), `num_local_experts`/`num_experts` = r, top-k = min(k, r). Qwen-MoE shared experts are left untouched.
Baselines: router-logit and weight features, single/complete linkage, k-means (random and fixed init), random
groups, F-/S-/O-prune, and neuron alignment before merging (weight matching, `linear_sum_assignment`).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from scipy.cluster.hierarchy import cut_tree, fcluster, linkage
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from lab.core import params
from lab.models import hooks
from lab.moe.blocks import expert, moe_blocks, route, weights

FEATURES = ("output", "router", "weight")
CONTROLS = {  # the substitutions a skeptic would make; the notebook declares which claims each must break
    "random_groups": "HC-SMoE's clusters replaced by random groups of near-equal sizes (the merge is unchanged)",
    "weight_features": "expert-output features o_j replaced by the experts' flattened weights (W_gate, W_up, W_down)",
    "random_alignment": "scenario C's alignment step permutes each member's neurons at random instead of matching them "
                        "to the most used member's (Hungarian): the same merge with the matching left out",
}


def check_control(control: str) -> str:
    """`""` or one of HC-SMoE's `CONTROLS` (else one `ParamError` sentence naming them)."""
    return params.check_control(control, CONTROLS)


@dataclass(frozen=True)
class Config:
    """Every size of the notebook's toy: a 3-layer Mixtral (d = 64, experts of width 128, top-2) on permutation
    chains — 4 experts trained, upcycled to 8 by duplication with noise, fine-tuned — and the merge sweeps."""

    d_model: int = 64
    n_layers: int = 3
    n_heads: int = 4
    d_ff: int = 128
    n_base: int = 4  # experts of the densely trained MoE that is upcycled
    n_experts: int = 8  # after upcycling (each expert + router row duplicated)
    top_k: int = 2
    steps: int = 150  # training of the 4-expert model (and of scenario A's 8-expert model)
    ft_steps: int = 40  # fine-tuning after upcycling
    batch_size: int = 32
    lr: float = 3e-3
    ft_lr: float = 1e-3
    noise: float = 0.02  # duplicate = expert + noise · std(W) · N(0, 1), router rows alike
    seq_len: int = 32  # permutation-chain sequence length
    n_seq: int = 48  # calibration sequences (and as many held-out evaluation sequences)
    rs: tuple[int, ...] = (4, 6)  # target expert counts shown (8 -> 4 and 8 -> 6)
    n_random: int = 20  # random groupings / k-means++ runs averaged (5 left the random-groups mean noisy)
    feature: str = "output"  # "weight" under the `weight_features` control
    method: str = "hierarchical"  # "random" under the `random_groups` control
    align: str = "matched"  # neuron alignment in "HC-SMoE + neuron alignment"; "random" under `random_alignment`

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """Sizes for `scale` ("smoke" | "full"); `control` switches HC-SMoE's features or clustering."""
        if scale not in params.SCALES:
            raise ValueError(f"scale={scale!r} is unknown; use one of {', '.join(params.SCALES)}.")
        control = check_control(control)
        sizes = {} if scale == "smoke" else dict(steps=1000, ft_steps=200, n_seq=128)
        return cls(**sizes, feature="weight" if control == "weight_features" else "output",
                   method="random" if control == "random_groups" else "hierarchical",
                   align="random" if control == "random_alignment" else "matched")


# ------------------------------------------------------------------------ step 1-2: frequencies and features

@torch.no_grad()
def usage_frequencies(mlp: nn.Module, x: Tensor) -> Tensor:
    """f_j (E,): share of top-k slots that go to expert j over the tokens x (N, H); sums to 1."""
    _, _, idx = route(mlp, x)
    counts = torch.bincount(idx.flatten(), minlength=mlp.gate.weight.shape[0]).double()
    return counts / counts.sum()


@torch.no_grad()
def router_scores(mlp: nn.Module, x: Tensor) -> Tensor:
    """Mean softmax router probability of each expert over x (E,) — S-prune's score."""
    return torch.softmax(mlp.gate.weight.float() @ x.float().T, 0).mean(1).double()


@torch.no_grad()
def features(mlp: nn.Module, x: Tensor, kind: str = "output") -> Tensor:
    """One row per expert (E, ·): "output" o_j = mean_x E_j(x) over all x (N, H) (HC-SMoE); "router" the
    router logit of j on every token (N,) (M-SMoE's similarity); "weight" W_gate, W_up, W_down flattened."""
    E = mlp.gate.weight.shape[0]
    if kind == "output":
        return torch.stack([expert(x.float(), *(w.float() for w in weights(mlp, e))).mean(0) for e in range(E)])
    if kind == "router":
        return (x.float() @ mlp.gate.weight.float().T).T.contiguous()
    if kind == "weight":
        return torch.stack([torch.cat([w.float().flatten() for w in weights(mlp, e)]) for e in range(E)])
    raise ValueError(f"kind={kind!r} is not a feature; use one of {FEATURES}.")


# ------------------------------------------------------------------------ step 3: grouping

def canonical(labels) -> np.ndarray:
    """Labels renumbered 0, 1, ... in order of first appearance (so equal partitions compare equal)."""
    first = {}
    return np.array([first.setdefault(int(v), len(first)) for v in np.asarray(labels)])


def cluster(feats: Tensor, r: int, *, method: str = "hierarchical", link: str = "average", seed: int = 0,
            init: list[int] | None = None) -> np.ndarray:
    """Partition the E rows of `feats` into r groups; labels (E,) in 0..r−1.

    "hierarchical": scipy agglomerative clustering, Euclidean, `link` ∈ average (HC-SMoE) | single | complete,
    cut at r clusters (`fcluster` maxclust; `cut_tree` when ties leave fewer); deterministic.
    "kmeans": sklearn k-means++ seeded by `seed`, one init (the official fallthrough under the misspelling).
    "kmeans_fixed": k-means from the rows `init` (default the first r) — the paper's fixed-init k-means.
    "random": a random permutation split into r groups of near-equal size (`seed`)."""
    X = feats.double().cpu().numpy()
    E = len(X)
    if not 1 <= r <= E:
        raise params.ParamError(f"r={r} experts per layer: it must be between 1 and the model's {E} experts.")
    if method == "hierarchical":
        Z = linkage(X, method=link, metric="euclidean")
        labels = fcluster(Z, r, criterion="maxclust")
        if len(set(labels)) != r:
            labels = cut_tree(Z, n_clusters=r).ravel()
        return canonical(labels)
    if method in ("kmeans", "kmeans_fixed"):
        from sklearn.cluster import KMeans

        if method == "kmeans":
            km = KMeans(r, init="k-means++", n_init=1, random_state=seed)
        else:
            km = KMeans(r, init=X[list(range(r)) if init is None else list(init)], n_init=1)
        return canonical(km.fit(X).labels_)
    if method == "random":
        perm = np.random.default_rng(seed).permutation(E)
        labels = np.empty(E, dtype=int)
        for c, part in enumerate(np.array_split(perm, r)):
            labels[part] = c
        return canonical(labels)
    raise ValueError(f"method={method!r} is unknown; use hierarchical, kmeans, kmeans_fixed or random.")


def dominant_groups(router_feats: Tensor, f: Tensor, r: int) -> np.ndarray:
    """M-SMoE's grouping (Li et al., ICLR 2024), as the HC-SMoE paper's baseline: the r most used experts (usage
    `f`) are dominant, every other expert joins the dominant one whose router logits (`features(..., "router")`,
    (E, N)) have the largest cosine similarity with its own; labels (E,). Single-shot, no iteration; r per layer
    here, where M-SMoE ranks the dominant experts over all layers at once."""
    E = len(f)
    if not 1 <= r <= E:
        raise params.ParamError(f"r={r} experts per layer: it must be between 1 and the model's {E} experts.")
    dom = f.argsort(descending=True)[:r]
    sim = torch.nn.functional.normalize(router_feats.double(), dim=1)
    sim = sim @ sim[dom].T  # (E, r)
    labels = sim.argmax(1)
    labels[dom] = torch.arange(r)
    return canonical(labels.numpy())


# ------------------------------------------------------------------------ step 4: merging

def align_neurons(anchor: tuple[Tensor, ...], other: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """`other`'s intermediate neurons permuted to match `anchor`'s (weight matching, as M-SMoE / ZipIt before
    averaging): the permutation π maximising Σ_i ⟨w_i^anchor, w_π(i)^other⟩ over each neuron's stacked
    (W_gate row, W_up row, W_down column), by the Hungarian algorithm (`linear_sum_assignment`)."""
    def rows(Wg, Wu, Wd):
        return torch.cat([Wg, Wu, Wd.T], 1).double().cpu().numpy()  # (F, 3H)

    _, perm = linear_sum_assignment(rows(*anchor) @ rows(*other).T, maximize=True)
    return permuted(other, torch.as_tensor(perm))


def permuted(w: tuple[Tensor, ...], perm: Tensor) -> tuple[Tensor, ...]:
    """An expert's (W_gate, W_up, W_down) with its intermediate neurons reordered: rows of W_gate, W_up, columns of
    W_down."""
    Wg, Wu, Wd = w
    perm = perm.to(Wg.device)
    return Wg[perm], Wu[perm], Wd[:, perm]


def merge_cluster(ws: list[tuple[Tensor, ...]], f: Tensor, *, align: bool | str = False
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """Ŵ = Σ_j f_j W_j / Σ_j f_j for W_gate, W_up, W_down of the members `ws` with frequencies f (|C|,);
    uniform weights when no member is ever routed; `align` (True or "matched"): members' neurons matched to the most
    used one first; "random" (a control): the other members' neurons permuted at random instead (a fixed seed)."""
    f = f.double()
    a = (f / f.sum()) if f.sum() > 0 else torch.full_like(f, 1 / len(f))
    if align:
        j0, g = int(f.argmax()), torch.Generator().manual_seed(0)
        ws = [w if j == j0 else permuted(w, torch.randperm(w[0].shape[0], generator=g)) if align == "random"
              else align_neurons(ws[j0], w) for j, w in enumerate(ws)]
    return tuple(sum(a_j.item() * w[i].double() for a_j, w in zip(a, ws)).to(ws[0][i].dtype) for i in range(3))


@torch.no_grad()
def merged_experts(mlp: nn.Module, labels, f: Tensor, *, align: bool | str = False) -> tuple[Tensor, Tensor]:
    """The r merged experts of one block as fused tensors: gate_up (r, 2F, H), down (r, H, F)."""
    labels = np.asarray(labels)
    out = []
    for c in range(labels.max() + 1):
        members = np.flatnonzero(labels == c).tolist()
        out.append(merge_cluster([weights(mlp, e) for e in members], f[members], align=align))
    return torch.stack([torch.cat([g, u]) for g, u, _ in out]), torch.stack([d for _, _, d in out])


def merged_router(W: Tensor, labels, f: Tensor) -> Tensor:
    """Router rows (r, H) of the smaller model: each cluster's rows of W (E, H), frequency-weighted like its
    experts (uniform when never routed). A design choice of this lab: the paper keeps all n rows."""
    labels, rows = np.asarray(labels), []
    for c in range(labels.max() + 1):
        m = np.flatnonzero(labels == c).tolist()
        fc = f[m].double()
        a = fc / fc.sum() if fc.sum() > 0 else torch.full_like(fc, 1 / len(m))
        rows.append((a[:, None].to(W.device) * W[m].double()).sum(0))
    return torch.stack(rows).to(W.dtype)


# ------------------------------------------------------------------------ the merged and the pruned models

def n_experts_key(config) -> str:
    """The config field holding the number of routed experts (Mixtral `num_local_experts`, Qwen-MoE `num_experts`)."""
    return "num_local_experts" if hasattr(config, "num_local_experts") else "num_experts"


@torch.no_grad()
def aliased(model: nn.Module, labels: list, freqs: list[Tensor], *, align: bool | str = False) -> nn.Module:
    """The merged model as published (official module aliasing): a copy whose every expert slot j ∈ C holds Ŵ_C,
    router unchanged — gates of top-k picks in one cluster add. Same size as `model`; r unique experts a layer."""
    new = copy.deepcopy(model)
    for mlp, lab, f in zip(moe_blocks(new), labels, freqs):
        gu, d = merged_experts(mlp, lab, f, align=align)
        idx = torch.as_tensor(np.asarray(lab), device=gu.device)
        mlp.experts.gate_up_proj.copy_(gu[idx])
        mlp.experts.down_proj.copy_(d[idx])
    return new


@torch.no_grad()
def shrink(model: nn.Module, gate_up: list[Tensor], down: list[Tensor], router: list[Tensor]) -> nn.Module:
    """A new model of `model`'s class with r experts a layer: these fused tensors and router rows, every other
    weight (attention, norms, embeddings, Qwen-MoE shared experts) copied; config experts = r, top-k = min(k, r)."""
    r = gate_up[0].shape[0]
    cfg = copy.deepcopy(model.config)
    setattr(cfg, n_experts_key(cfg), r)
    cfg.num_experts_per_tok = min(cfg.num_experts_per_tok, r)
    sd = model.state_dict()
    for mlp, gu, d, w in zip(moe_blocks(model), gate_up, down, router):
        name = hooks.name_of(model, mlp)
        sd.update({f"{name}.experts.gate_up_proj": gu, f"{name}.experts.down_proj": d, f"{name}.gate.weight": w})
    p = next(model.parameters())
    with torch.device(p.device):  # built where the model is, in its dtype; `.to(dtype)` would also round the
        new = type(model)._from_config(cfg, dtype=p.dtype)  # float32 rotary frequencies of a bf16 checkpoint
    new.load_state_dict(sd)
    return new.eval()


def smaller(model: nn.Module, labels: list, freqs: list[Tensor], *, align: bool | str = False) -> nn.Module:
    """The really smaller merged model: r merged experts and r frequency-weighted router rows per layer."""
    mlps = moe_blocks(model)
    ex = [merged_experts(m, lab, f, align=align) for m, lab, f in zip(mlps, labels, freqs)]
    rw = [merged_router(m.gate.weight, lab, f) for m, lab, f in zip(mlps, labels, freqs)]
    return shrink(model, [g for g, _ in ex], [d for _, d in ex], rw)


def pruned(model: nn.Module, keep: list) -> nn.Module:
    """Pruning: only the experts `keep[l]` of every layer and their router rows (the router renormalises over
    the survivors, which for a top-k softmax router is what dropping their rows does)."""
    mlps = moe_blocks(model)
    ks = [torch.as_tensor(sorted(k), device=m.gate.weight.device) for m, k in zip(mlps, keep)]
    return shrink(model, [m.experts.gate_up_proj[k] for m, k in zip(mlps, ks)],
                  [m.experts.down_proj[k] for m, k in zip(mlps, ks)], [m.gate.weight[k] for m, k in zip(mlps, ks)])


# ------------------------------------------------------------------------ pruning baselines

@torch.no_grad()
def routed_out(mlp: nn.Module, x: Tensor, outs: Tensor, keep: list[int] | None = None) -> Tensor:
    """The block's routed output (N, H) from precomputed expert outputs `outs` (E, N, H), the router restricted
    to `keep` (softmax over the survivors, top-k, renormalised)."""
    logits = x.float() @ mlp.gate.weight.float().T  # (N, E)
    if keep is not None:
        mask = torch.full_like(logits, float("-inf"))
        mask[:, keep] = 0
        logits = logits + mask
    k = min(mlp.gate.top_k, logits.shape[1] if keep is None else len(keep))
    w, idx = torch.softmax(logits, -1).topk(k, -1)
    w = w / w.sum(-1, keepdim=True)
    return (outs[idx, torch.arange(len(x), device=x.device)[:, None]] * w[..., None]).sum(1)


@torch.no_grad()
def o_prune(mlp: nn.Module, x: Tensor, r: int, max_subsets: int = 5000, seed: int = 0) -> list[int]:
    """O-prune (Lu et al., 2024): the r-subset of experts whose pruned block output is closest to the full one
    on x — every C(E, r) subset (sampled `max_subsets` when there are more)."""
    E = mlp.gate.weight.shape[0]
    outs = torch.stack([expert(x.float(), *(w.float() for w in weights(mlp, e))) for e in range(E)])  # (E, N, H)
    y = routed_out(mlp, x, outs)
    subsets = list(itertools.combinations(range(E), r)) if _ncr(E, r) <= max_subsets else \
        [tuple(sorted(np.random.default_rng(seed + i).choice(E, r, replace=False))) for i in range(max_subsets)]
    errs = [(routed_out(mlp, x, outs, list(s)) - y).pow(2).sum().item() for s in subsets]
    return list(subsets[int(np.argmin(errs))])


def _ncr(n: int, k: int) -> int:
    from math import comb
    return comb(n, k)


def prune_keep(mlp: nn.Module, x: Tensor, r: int, how: str) -> list[int]:
    """Experts kept by F-prune (top-r usage frequency), S-prune (top-r mean router probability) or O-prune."""
    if how == "F":
        return sorted(usage_frequencies(mlp, x).argsort(descending=True)[:r].tolist())
    if how == "S":
        return sorted(router_scores(mlp, x).argsort(descending=True)[:r].tolist())
    if how == "O":
        return o_prune(mlp, x, r)
    raise ValueError(f"how={how!r} is not a pruning baseline; use F, S or O.")
