"""Gather & Aggregate heads — Bick, Xing & Gu, "Understanding the Skill Gap in Recurrent Language
Models: The Role of the Gather-and-Aggregate Mechanism", ICML 2025 (arXiv 2504.18574; code:
goombalab/Gather-and-Aggregate).

In-context retrieval in both Transformers and SSMs runs through two kinds of heads (§3):
a **Gather head** (layer l) makes the last token of each context segment (an MMLU option's "\\n")
attend over its segment, summarising it; an **Aggregate head** (layer l+1) at the prediction
position puts almost all of its weight on the summary of the matching segment and copies its
letter. They are few, so each is a bottleneck: removing one sends letter accuracy to chance while
knowledge that needs no retrieval is intact.

This module is the paper's protocol: the (gather, aggregate) layer pair from the pruning curve, the
layer- and head-level ablations, the four keep-only configurations, the aggregate row's sharpness, the
retrieval-vs-context sweep and the controls. The paper-independent experiments it runs live in
`lab.interp.ablation` (pruning curve, single-head sweep, random heads); the notebook also sets every ablation
against random heads of the same layers there (`versus_random`, `layer_versus_random`), because in a small
model removing *any* heads costs accuracy: what the paper's heads carry is the excess over that. Heads are
removed with the official operator (`lab.models.hooks.ablate_heads`, which restores the exact weights on
exit, so no ablated copy leaks into the next configuration; the official notebook reloads the model instead).
The models under study (the two toys, or a checkpoint) and their prompts are `lab.interp.gather_aggregate_study`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from lab.data.letters import DELIM, LetterRetrieval
from lab.interp import ablation
from lab.interp.ablation import Evaluate
from lab.interp.hidden_attention import attention
from lab.models import hooks
from lab.models.score import choice_accuracy

# the notebook's controls: the substitutions a skeptic would make (`control=` in the notebook)
CONTROLS = {
    "random_heads": "replace the heads under test by random heads of the same layers: the aggregate layer's heads by "
                    "as many drawn from both layers of the minimal model, {G, A} by one head drawn in each of their "
                    "layers; each comparison with random heads then sets random against random (`versus_random`)",
    "cloze_prompts": "score the aggregate layer's heads against random heads on cloze prompts (the knowledge alone, "
                     "no options to retrieve from) instead of letter prompts",
    "shuffled": "measure the aggregate row's mass on a randomly drawn wrong option instead of the answer's option",
    "untrained": "the same three architectures at their random initialisation, never trained",
    "ssm_row": "in each hybrid, mask the answer row of the SSM block next to the attention block (MMA: L1, before it; "
               "MAM: L2, after it) instead of the attention's: the same operator on a mixer that could aggregate",
}

# (gather (layer, head), aggregate (layer, head)) reported in the paper / official notebook
PAPER_HEADS = {"meta-llama/Llama-3.1-8B-Instruct": ((16, 22), (17, 24))}


def paper_heads(model_name: str) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The paper's G and A for a hub id, or for a local folder with the same name; None if unknown."""
    base = model_name.rstrip("/").split("/")[-1].lower()
    return next((h for k, h in PAPER_HEADS.items() if k.split("/")[-1].lower() == base), None)


@dataclass(frozen=True)
class Config:
    """Every size of the notebook at a scale: the mini-MMLU letter task (`LetterRetrieval`, letters drawn
    per prompt from `n_labels`, min..n options per training batch, `eval_options` at evaluation as in
    MMLU), a Llama-style Transformer, a Mamba-2 (SSD heads of `head_dim`) and two hybrids of the two
    (`hybrid_layouts`: M a Mamba-2 block, A an attention block), the held-out prompts."""

    n_questions: int = 4
    n_labels: int = 8
    n_options: int = 6  # also the largest k of the options sweep
    min_options: int = 2
    eval_options: int = 4
    d_model: int = 64
    n_layers: int = 2  # the toys' (gather, aggregate) layer pair is (0, 1)
    n_heads: int = 4
    head_dim: int = 16
    transformer_steps: int = 600
    mamba2_steps: int = 200  # Mamba-2 learns the task in fewer steps (each is slower: the reference scan)
    hybrid_layouts: tuple[str, ...] = ("MMA", "MAM")  # the SSM blocks could aggregate before / after attention
    hybrid_steps: int = 300
    hybrid_batch_size: int = 32  # half the others' batch: as accurate here at 300 steps, in half the time
    batch_size: int = 64
    lr: float = 3e-3
    n_letter: int = 300  # held-out letter prompts; `n_rows` of them for the sharpness
    n_verify: int = 200  # further letter prompts: {G, A} against random heads, scored off the prompts that chose them
    n_draws: int = 10  # random head sets averaged in each comparison with random heads
    n_cloze: int = 100
    n_rows: int = 64
    n_per_k: int = 100  # letter prompts per number of options
    n_explore: int = 100  # prompts the explorer scores; it shows `n_show`
    n_show: int = 8
    n_checkpoint: int = 40  # category MCQs of each kind for a checkpoint
    chance: float = 0.25  # letter chance with four options

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """"full": 3× the training steps and prompts; the `untrained` control trains no step."""
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
        sizes = {} if scale == "smoke" else dict(transformer_steps=1800, mamba2_steps=600, hybrid_steps=900,
                                                   n_letter=1000, n_verify=1000, n_cloze=300, n_rows=256, n_per_k=500,
                                                   n_checkpoint=1000)
        untrained = dict(transformer_steps=0, mamba2_steps=0, hybrid_steps=0)
        return cls(**sizes | (untrained if control == "untrained" else {}))


# ------------------------------------------------------------------------ step 1: the layer level

def locate(model: nn.Module, letter: Evaluate, cloze: Evaluate, heads=None, *, chance: float
           ) -> tuple[tuple[int, int], dict[str, list[float]]]:
    """The (gather, aggregate) layer pair of a checkpoint and its pruning curve: the aggregate layer is
    the last block letter accuracy needs (or the layer of the given A), the gather layer the one before."""
    curve = ablation.pruning_curve(model, {"letter": letter, "cloze": cloze})
    la = heads[1][0] if heads else ablation.collapse_layer(curve["letter"], chance=chance)
    if la is None:
        la = len(curve["letter"]) - 1
        warnings.warn("letter accuracy never rises above chance; no retrieval to localise, using the last layers",
                      stacklevel=2)
    return (max(la - 1, 0), max(la, 1)), curve


def layer_level(model: nn.Module, letter: Evaluate, cloze: Evaluate, pair: tuple[int, int], *,
                random_seed: int | None = None) -> dict[str, tuple[float, float]]:
    """(letter, cloze) accuracy of the minimal model (the blocks up to the aggregate layer), of the blocks
    up to the gather layer, and without every head of the gather / aggregate layer (the MLPs stay).
    With `random_seed` (the random_heads control) each layer's removal is replaced by as many heads
    drawn at random from both layers (a fresh generator seeded with it for each)."""
    lg, la = pair
    with hooks.pruned(model, keep_layers=la + 1):
        row = {"minimal model": (letter(), cloze())}
        with hooks.pruned(model, keep_layers=lg + 1):
            row["up to the gather layer"] = (letter(), cloze())
        for what, layer in (("gather", lg), ("aggregate", la)):
            heads = hooks.all_heads(model, layer)
            if random_seed is not None:
                heads = ablation.random_heads(model, (lg, la), len(heads[layer]),
                                              torch.Generator().manual_seed(random_seed))
            with hooks.ablate_heads(model, heads):
                row[f"no {what}-layer heads"] = (letter(), cloze())
    return row


def share_lost(row: dict[str, tuple[float, float]], *, chance: float) -> float:
    """The part of the above-chance letter accuracy that removing the aggregate layer's heads takes
    away, (full − cut) / (full − chance), of a `layer_level` row; nan when the full model is at chance."""
    full, cut = row["minimal model"][0], row["no aggregate-layer heads"][0]
    return (full - cut) / (full - chance) if full > chance else float("nan")


# ------------------------------------------------------------------------- step 2: the head level

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
        with hooks.ablate_heads(model, keep, keep=True):
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

    @property
    def heads(self) -> hooks.Heads:
        """{G, A} as `hooks.ablate_heads` takes them: layer -> head indices."""
        out: dict[int, list[int]] = {}
        for layer, h in (self.gather, self.aggregate):
            out.setdefault(layer, []).append(h)
        return out

    def summary(self) -> dict:
        """The measurements a run records."""
        return {"layers": self.layer_ids, "gather": self.gather, "aggregate": self.aggregate, "removed": self.removed,
                "other_max": self.other_max, "keep_only": self.table, "drop": self.drop}


def discover(model: nn.Module, letter: Evaluate, cloze: Evaluate, layer_ids: tuple[int, int], *,
             heads: tuple[tuple[int, int], tuple[int, int]] | None = None) -> Discovery:
    """The head-level protocol on the (gather layer, aggregate layer) pair (§3, notebook steps 2-3):
    sweep single-head removals, take the top head of each layer as G and A (or use the given
    `heads`, e.g. the paper's L16H22 / L17H24 for Llama-3.1-8B), then measure removing each and the
    four keep-only configurations."""
    lg, la = layer_ids
    drop = ablation.head_sweep(model, [lg, la], letter)
    cloze_drop = ablation.head_sweep(model, [lg, la], cloze)
    if heads is None:  # nan: past a layer's own heads
        top = drop.nan_to_num(float("-inf"))
        heads = ((lg, int(top[0].argmax())), (la, int(top[1].argmax())))
    gather, aggregate = heads
    removed = {}
    for name, (layer, h) in (("gather", gather), ("aggregate", aggregate)):
        with hooks.ablate_heads(model, {layer: [h]}):
            removed[name] = (letter(), cloze())
    others = drop.nan_to_num(float("-inf"))
    others[0, gather[1]] = others[1, aggregate[1]] = float("-inf")
    return Discovery(letter(), cloze(), [lg, la], drop, cloze_drop, gather, aggregate, removed,
                     float(others.max()), four_configurations(model, gather, aggregate, letter))


# ------------------------------------------------------------- step 3: how sharp is the aggregate row

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


def answer_segments(tokenizer, examples: list[dict], *, decoy_seed: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (n, T) of letter prompts (all one length) and the positions (n, 3) of the answer's
    option: its letter, content and ⏎. With `decoy_seed` (the shuffled control) a randomly drawn wrong
    option's instead (`decoy_positions`)."""
    ids = torch.stack([tokenizer(e["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"][0]
                       for e in examples])  # (n, T)
    target = torch.tensor([e["delim_pos"] for e in examples])  # (n,): the answer's delimiter
    if decoy_seed is not None:
        target = decoy_positions(ids, target, tokenizer.convert_tokens_to_ids(DELIM),
                                 torch.Generator().manual_seed(decoy_seed))
    return ids, target[:, None] - torch.arange(3)


def _row_stats(model: nn.Module, ids: torch.Tensor, segment: torch.Tensor, layer: int) -> torch.Tensor:
    """(H, 2): per head of `layer`, the answer-position row's mass on `segment` and its entropy, over prompts."""
    A = attention(model, ids.to(next(model.parameters()).device), layer).cpu()  # (n, H, T, T)
    return torch.tensor([[sharpness(A[i, h, -1], segment[i]) for i in range(len(ids))]
                         for h in range(A.shape[1])]).mean(1)


def aggregate_focus(model: nn.Module, ids: torch.Tensor, segment: torch.Tensor, aggregate: tuple[int, int], *,
                    pick: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, float]:
    """The aggregate layer's rows at the answer position, averaged over prompts: the mass on `segment`
    and the entropy of head A and of the layer's head with the most mass ("best"). With `pick` = (ids, segment)
    of other prompts, "best" is chosen there and scored here (an argmax over heads scored on the prompts that
    chose it would be biased upward)."""
    layer, a = aggregate
    stats = _row_stats(model, ids, segment, layer)
    best = int((stats if pick is None else _row_stats(model, *pick, layer))[:, 0].argmax())
    return {"A mass": stats[a, 0].item(), "A entropy": stats[a, 1].item(),
            "best head": best, "best mass": stats[best, 0].item(), "best entropy": stats[best, 1].item()}


def max_entropy(T: int) -> float:  # of a uniform row over T tokens
    return math.log(T)


# ------------------------------------------------------------- step 4: retrieval as the context grows

def retrieval_vs_options(model: nn.Module, tokenizer, task: LetterRetrieval, aggregate: tuple[int, int],
                         ks: Iterable[int], n: int, seed: int) -> dict[str, list[float]]:
    """Letter accuracy with k options (the paper's KV-retrieval sweep over the number of pairs): intact,
    without A, and without every head of A's layer, on `n` prompts per k (the same for every model)."""
    la, a = aggregate
    out = {"intact": [], "without A": [], "without L1 heads": []}
    for k in ks:
        ex = task.examples(n, torch.Generator().manual_seed(20_000 + 100 * seed + k), "letter", n_options=k)
        acc = partial(choice_accuracy, model, tokenizer, ex, task.letters)
        out["intact"].append(acc())
        with hooks.ablate_heads(model, {la: [a]}):
            out["without A"].append(acc())
        with hooks.ablate_heads(model, {la: []}, keep=True):
            out["without L1 heads"].append(acc())
    return out



# --------------------------------------------------- step 5: a hybrid hands aggregation to attention

def answer_rows_masked(model: nn.Module, letter: Evaluate, cloze: Evaluate | None = None
                       ) -> dict[str, tuple[float, float]]:
    """(letter, cloze) accuracy of the intact model, with the answer-position row masked in every attention block
    at once (the paper's hybrid test), and in each block alone (`hooks.zero_rows` at position −1: prompts are scored
    at their last token, unpadded, so single-token choices only; without `cloze` its entries are nan). In Zamba2-7B
    masking the last row of every attention matrix drops MMLU 64.3 % → 34.9 % with knowledge stable: attention does
    the aggregating although every Mamba layer is intact."""
    n = len(hooks.layers(model))
    attention = [i for i in range(n) if hooks.is_attention(model, i)]
    groups = {"every attention block": attention} if attention else {}
    groups |= {f"L{i} {'attention' if i in attention else 'SSM'}": [i] for i in range(n)}
    score = lambda: (letter(), cloze() if cloze else float("nan"))
    out = {"intact": score()}
    for name, ids in groups.items():
        with hooks.zero_rows(model, ids):
            out[name] = score()
    return out
