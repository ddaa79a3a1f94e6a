r"""RIP — Yu, Yuan, Golovneva, Wu, Sukhbaatar, Weston & Xu, "R.I.P.: Better Models by Survival of the
Fittest Prompts", ICML 2025 (arXiv 2501.18578; no official code; third-party: LumiOpen/rip).

Low-quality prompts show in the *rejected* response of a best-vs-worst pair (§3): sample N responses
per prompt, score them, y_w = argmax r, y_l = argmin r, and compute per prompt

    m1 = r(y_l | x)              rejected reward      keep if ≥ τ1
    m2 = len(y_l)                rejected length      keep if ≥ τ2
    m3 = r(y_w | x) − r(y_l | x)  reward gap           keep if ≤ τ3   (small gaps: Table 10's "> 0.042" is a typo)

with τ the q-th percentiles of each metric over the whole pool, computed once (50/50/50 in the best 8B
run), and a prompt kept only if all three hold. Surviving pairs go unchanged into DPO. Pairs with
r_w = r_l carry no preference and are dropped from the pool before the percentiles (the paper assumes
r_w > r_l; with discrete toy rewards ties are common). Self-RIP post-filters synthetic prompts with the
same thresholds (`keep(..., tau)` on a new pool).

The toy's protocol (`Config.for_scale`, `make_pool`, `filter_sets`, `self_rip_post_filter`, `dpo_on_subsets`)
runs this on `lab.data.instructions.InstructionWorld` for the notebook.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import Tensor

from lab.align import losses
from lab.align.train import train_pairs
from lab.core.params import check_control
from lab.core.stages import stage
from lab.data.instructions import RESPONSE_LEN, InstructionWorld
from lab.models import TinyLM, TrainResult
from lab.models.sample import sample_responses

CONTROLS = {"random_filter": "RIP's filter replaced by a uniformly random subset of the valid pairs of the same size "
                             "(on the pool and in Self-RIP's post-filter)",
            "chosen_metrics": "the chosen response's reward and length in place of the rejected one's (m1 = r_w, "
                              "m2 = |y_w|, their thresholds at the same percentiles; the gap rule unchanged)",
            "large_gap": "the gap condition flipped, as Table 10's typo reads it: keep m3 > τ3 (τ3 unchanged); "
                         "m1 and m2 unchanged"}


@dataclass(frozen=True)
class Config:
    """The instruction-world toy (`lab.data.instructions`): a 2-layer Llama seed model SFT'd on the world, a
    pool of prompts with N samples each, a fresh pool for Self-RIP's post-filter, identical DPO on each
    subset for the same number of epochs (β = 0.1, lr 1e-4, batch 32, reference = the seed model)."""

    base: TinyLM = TinyLM(d_model=64, n_layers=2, n_heads=4, max_len=20, steps=150, batch_size=64, lr=3e-3)
    n_eval: int = 400  # held-out clean prompts scored after each DPO run
    eval_samples: int = 4  # sampled responses per evaluation prompt (T = 1), beside the greedy one
    n_pool: int = 800
    n_samples: int = 8  # N responses per prompt
    n_fresh: int = 400  # Self-RIP's fresh pool
    fresh_bad_frac: float = 0.3  # its share of low-quality prompts
    dpo_epochs: float = 2.0  # equal epochs on every subset: steps = epochs · |subset| / batch
    dpo_lr: float = 1e-4
    dpo_batch: int = 32
    dpo_beta: float = 0.1
    rpo_alpha: float = 1.0  # the RPO arms: DPO + α · per-token NLL of the chosen response

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """Sizes for the scale; the control (see `CONTROLS`) only changes the filter, not a size."""
        check_control(control, CONTROLS)
        return cls() if scale == "smoke" else cls(n_eval=1000, n_pool=3000, n_samples=16, n_fresh=1500, dpo_epochs=3.0)


@dataclass
class Pool:
    """Per-prompt best-vs-worst pairs and their metrics (all (Q,)), and every sample's reward r (Q, N)."""

    w: Tensor  # index of the chosen (best) sample
    l: Tensor  # index of the rejected (worst) sample
    chosen_reward: Tensor
    m1: Tensor  # rejected reward
    m2: Tensor  # rejected length
    m3: Tensor  # reward gap
    valid: Tensor  # r_w > r_l
    r: Tensor | None = None
    chosen_len: Tensor | None = None  # length of the chosen response (the `chosen_metrics` control's m2)


def best_vs_worst(r: Tensor, length: Tensor) -> Pool:
    """From rewards r (Q, N) and response lengths (Q, N): the pairs and the three RIP metrics. Ties are broken
    as the public re-implementation (LumiOpen/rip `score_generation_output`) does by sorting the samples by
    reward, descending, with Python's stable sort: the chosen is the first best sample in generation order,
    the rejected the last worst one. Neither depends on length, so m2 is not inflated by the tie-break."""
    Q = torch.arange(len(r))
    w = r.argmax(1)  # the first maximal index (torch's documented tie rule): the sorted list's head
    l = r.shape[1] - 1 - r.flip(1).argmin(1)  # the last minimal index: the sorted list's tail
    rw, rl = r[Q, w], r[Q, l]
    return Pool(w, l, rw, rl, length[Q, l].float(), rw - rl, rw > rl, r, length[Q, w].float())


def best_vs_bottom_quartile(pool: Pool, length: Tensor, generator: torch.Generator) -> Pool:
    """Table 17's re-pairing, no filter: the same chosen (best) response against one drawn uniformly from its
    prompt's bottom 25 % of samples by reward (the ⌊N/4⌋ lowest, at least one; ties in generation order)."""
    Q, (n, N) = torch.arange(len(pool.r)), pool.r.shape
    k = max(1, N // 4)
    bottom = pool.r.argsort(dim=1, stable=True)[:, :k]
    l = bottom[Q, torch.randint(k, (n,), generator=generator)]
    rw, rl = pool.r[Q, pool.w], pool.r[Q, l]
    return Pool(pool.w, l, rw, rl, length[Q, l].float(), rw - rl, rw > rl, pool.r, length[Q, pool.w].float())


def chosen_side(pool: Pool) -> Pool:
    """The pool as the `chosen_metrics` control reads it: m1 = r_w, m2 = |y_w| (the gap and the rest unchanged)."""
    return replace(pool, m1=pool.chosen_reward, m2=pool.chosen_len)


def thresholds(pool: Pool, q: tuple[float, float, float] = (0.5, 0.5, 0.5), control: str = "") -> tuple[float, ...]:
    """τ1, τ2, τ3: the q-quantiles of m1, m2, m3 over the valid pairs of the whole pool (of the chosen side's m1
    and m2 under the `chosen_metrics` control; every other control filters with RIP's thresholds)."""
    if check_control(control, CONTROLS) == "chosen_metrics":
        pool = chosen_side(pool)
    v = pool.valid
    if not v.any():
        raise ValueError("no valid pair (r_w > r_l) in the pool: nothing to filter.")
    return tuple(torch.quantile(m[v], qq).item() for m, qq in zip((pool.m1, pool.m2, pool.m3), q))


def keep(pool: Pool, tau: tuple[float, float, float]) -> Tensor:
    """The RIP filter (Q,) bool: m1 ≥ τ1 AND m2 ≥ τ2 AND m3 ≤ τ3, valid pairs only."""
    t1, t2, t3 = tau
    return pool.valid & (pool.m1 >= t1) & (pool.m2 >= t2) & (pool.m3 <= t3)


def rip_filter(pool: Pool, tau: tuple[float, float, float], control: str = "",
               generator: torch.Generator | None = None) -> Tensor:
    """The filter the notebook applies as RIP: `keep(pool, tau)`, or a control's substitute: `random_filter`, a
    random subset of the valid pairs with as many members as RIP keeps (needs `generator`); `chosen_metrics`,
    `keep` on `chosen_side(pool)` (give it `thresholds(..., control)`); `large_gap`, m3 > τ3 in place of m3 ≤ τ3."""
    control = check_control(control, CONTROLS)
    if control == "chosen_metrics":
        return keep(chosen_side(pool), tau)
    if control == "large_gap":
        return pool.valid & (pool.m1 >= tau[0]) & (pool.m2 >= tau[1]) & (pool.m3 > tau[2])
    kept = keep(pool, tau)
    if control == "random_filter":
        return random_subset(pool.valid, int(kept.sum()), generator)
    return kept


def single_filters(pool: Pool, q: float = 0.5) -> dict[str, Tensor]:
    """The coordinate-wise filters of Table 20 and the chosen-based baseline, each at its own
    q-quantile over the valid pool; `large gap` keeps the other half of the gap condition."""
    v = pool.valid

    def at(m):
        return torch.quantile(m[v], q).item()

    return {"rejected reward only": v & (pool.m1 >= at(pool.m1)),
            "rejected length only": v & (pool.m2 >= at(pool.m2)),
            "small gap only": v & (pool.m3 <= at(pool.m3)),
            "chosen reward only": v & (pool.chosen_reward >= at(pool.chosen_reward)),
            "large gap": v & (pool.m3 > at(pool.m3))}


def jaccard(a: Tensor, b: Tensor) -> float:
    """|A ∩ B| / |A ∪ B| of two token sequences' token sets (1 when both are empty)."""
    A, B = set(a.tolist()), set(b.tolist())
    return len(A & B) / len(A | B) if A | B else 1.0


@torch.no_grad()
def cheap_filters(world: InstructionWorld, model, prompts: dict[str, Tensor], Y: Tensor, pool: Pool, q: float,
                  device: str = "cpu") -> dict[str, Tensor]:
    """The paper's cheaper baselines (Table 2), on the valid pool: a prompt-only judge (here: the prompt is
    well-formed, all six digits shown — what a judge of the instruction alone can see), IFD = s(A|Q)/s(A) and
    ppl(chosen) under the seed model, each keeping its 25–100 percentile range (s = mean NLL of the chosen
    answer with / without the prompt), and the Jaccard token overlap of chosen and rejected at q."""
    from lab.align.train import response_logps

    v, Q = pool.valid, torch.arange(len(Y))
    yw, yl = Y[Q, pool.w], Y[Q, pool.l]
    mw, ml = world.response_mask(yw), world.response_mask(yl)
    x = prompts["prompt"].to(device)

    def s(context: Tensor) -> Tensor:  # mean NLL of the chosen answer's tokens
        return -response_logps(model, context, yw.to(device), mw.to(device)).sum(-1).cpu() / mw.sum(-1)

    with_q, alone = s(x), s(x[:, :1])  # alone: after <bos> only
    ifd, ppl = with_q / alone, with_q.exp()
    overlap = torch.tensor([jaccard(a[ma], b[mb]) for a, ma, b, mb in zip(yw, mw, yl, ml)])

    def at(m, qq):
        return torch.quantile(m[v], qq).item()

    well_formed = (prompts["prompt"] != world.ids(["_"])[0]).all(-1)
    return {"prompt-only judge": v & well_formed, "IFD (25–100 %)": v & (ifd >= at(ifd, 0.25)),
            "ppl(chosen) (25–100 %)": v & (ppl >= at(ppl, 0.25)),
            "chosen–rejected overlap": v & (overlap >= at(overlap, q))}


def random_subset(valid: Tensor, size: int, generator: torch.Generator) -> Tensor:
    """A uniformly random subset of the valid pairs with `size` members (the equal-size control)."""
    idx = valid.nonzero()[:, 0]
    out = torch.zeros_like(valid)
    out[idx[torch.randperm(len(idx), generator=generator)[:size]]] = True
    return out


def bad_fraction(mask: Tensor, bad: Tensor) -> float:
    """Share of low-quality prompts in a kept set (nan when the set is empty)."""
    return bad[mask].float().mean().item() if mask.any() else float("nan")


# ---------------------------------------------------------------------------------- the toy's protocol

def seed_model(world: InstructionWorld, cfg: Config, *, seed: int, device: str) -> TrainResult:
    """The seed model: a tiny Llama SFT'd on the world's clean and truncated prompts (cached by config)."""
    return cfg.base.fit(world, len(world.tokenizer), seed=seed, device=device)


@stage
def make_pool(world: InstructionWorld, model, n: int, bad_frac: float, N: int, *, generator: torch.Generator,
              device: str = "cpu") -> tuple[dict[str, Tensor], Tensor, Pool]:
    """§3's pool: n prompts (a `bad_frac` share low-quality), N responses each sampled at T = 1, judged, and
    paired best vs worst: (prompts, responses Y (n, N, L), the `Pool`). A cached stage (controls filter it)."""
    p = world.prompts(n, generator, bad_frac=bad_frac)
    Y = sample_responses(model, p["prompt"].to(device), N, RESPONSE_LEN, generator=generator, temperature=1.0)
    return p, Y, best_vs_worst(world.reward(p, Y, generator), world.length(Y))


def filter_sets(pool: Pool, tau: tuple[float, float, float], q: float, control: str = "",
                generator: torch.Generator | None = None) -> dict[str, Tensor]:
    """Table 7's rows: the valid pool, RIP (`rip_filter`: a control substitutes it), a random subset of RIP's
    size, the single-metric, chosen-based and large-gap filters of `single_filters` at q, and two variants of
    RIP at q whatever the control: without m2 (m1 and m3 only) and on the chosen side (`chosen_side`)."""
    sets = {"full (valid pairs)": pool.valid, "RIP": rip_filter(pool, tau, control, generator)}
    sets["random, RIP's size"] = random_subset(pool.valid, int(sets["RIP"].sum()), generator)
    sets.update(single_filters(pool, q))
    t1, _, t3 = thresholds(pool, (q, q, q))
    sets["RIP without m2"] = pool.valid & (pool.m1 >= t1) & (pool.m3 <= t3)
    sets["RIP on the chosen side"] = keep(chosen_side(pool), thresholds(pool, (q, q, q), "chosen_metrics"))
    return sets


def removed_by_kind(kept: Tensor, valid: Tensor, kind: Tensor, names) -> dict[str, float]:
    """Per prompt kind, the share of its valid pairs that a filter removes: 1 − |kept ∩ k| / |valid ∩ k|."""
    return {name: 1 - (kept & (kind == k)).sum().item() / max(1, (valid & (kind == k)).sum().item())
            for k, name in enumerate(names)}


def self_rip_post_filter(world: InstructionWorld, model, tau: tuple[float, float, float], cfg: Config,
                         control: str = "", *, generator: torch.Generator, device: str = "cpu") -> dict:
    """Self-RIP's post-filter (its step 3; Table 6): a fresh pool filtered with the first pool's thresholds,
    unchanged; the low-quality share before (`pool`) and after (`kept`) and the kept size."""
    p, _, pool = make_pool(world, model, cfg.n_fresh, cfg.fresh_bad_frac, cfg.n_samples, generator=generator,
                           device=device)
    kept = rip_filter(pool, tau, control, generator)
    return {"pool": bad_fraction(pool.valid, p["kind"] > 0), "kept": bad_fraction(kept, p["kind"] > 0),
            "size": int(kept.sum())}


def dpo_loss(batch: dict[str, Tensor], *, beta: float) -> Tensor:
    """Mean DPO loss of a `train_pairs` batch: sequence log-probs are the sums of the per-token ones."""
    pi = torch.stack([batch["pi_w"].sum(-1), batch["pi_l"].sum(-1)], 1)
    ref = torch.stack([batch["ref_w"].sum(-1), batch["ref_l"].sum(-1)], 1)
    return losses.dpo(pi, ref, beta=beta).mean()


def rpo_loss(batch: dict[str, Tensor], *, beta: float, alpha: float) -> Tensor:
    """Mean RPO loss (`losses.rpo`: DPO + α · NLL of the chosen response per token) of a `train_pairs` batch."""
    pi = torch.stack([batch["pi_w"].sum(-1), batch["pi_l"].sum(-1)], 1)
    ref = torch.stack([batch["ref_w"].sum(-1), batch["ref_l"].sum(-1)], 1)
    return losses.rpo(pi, ref, beta=beta, alpha=alpha, chosen_len=batch["chosen_len"]).mean()


def subset_pairs(world: InstructionWorld, prompts: dict[str, Tensor], Y: Tensor, pool: Pool, mask: Tensor,
                 device: str = "cpu") -> dict[str, Tensor]:
    """The best-vs-worst pairs of the prompts in `mask`, unchanged, as `train_pairs` takes them (with the chosen
    response's token count, for RPO's per-token NLL)."""
    Q = torch.arange(len(Y))
    yw, yl = Y[Q, pool.w][mask], Y[Q, pool.l][mask]
    pairs = {"prompt": prompts["prompt"][mask], "chosen": yw, "rejected": yl,
             "chosen_mask": world.response_mask(yw), "rejected_mask": world.response_mask(yl)}
    pairs["chosen_len"] = pairs["chosen_mask"].sum(-1).float()
    return {k: v.to(device) for k, v in pairs.items()}


def epoch_steps(cfg: Config, mask: Tensor) -> int:
    """DPO steps for `cfg.dpo_epochs` epochs over the subset `mask` (at least one)."""
    return max(1, round(cfg.dpo_epochs * int(mask.sum()) / cfg.dpo_batch))


def dpo_on_subsets(world: InstructionWorld, model, prompts: dict[str, Tensor], Y: Tensor, pool: Pool,
                   subsets: dict[str, Tensor], cfg: Config, *, seed: int, eval_prompts: dict[str, Tensor],
                   generator: torch.Generator, device: str = "cpu", loss: str = "dpo",
                   steps: int | None = None) -> dict[str, dict[str, float]]:
    """Identical DPO (or RPO, `loss="rpo"`) from `model` (also the reference) on each subset of the pool for
    `cfg.dpo_epochs` epochs, or for `steps` steps on every subset when given (Fig. 1, Tables 2 and 20);
    {subset: the result's judge reward on `eval_prompts`, greedy and sampled}."""
    fn = (partial(dpo_loss, beta=cfg.dpo_beta) if loss == "dpo" else
          partial(rpo_loss, beta=cfg.dpo_beta, alpha=cfg.rpo_alpha))
    out = {}
    for name, mask in subsets.items():
        n = steps or epoch_steps(cfg, mask)
        policy, _ = train_pairs(model, subset_pairs(world, prompts, Y, pool, mask, device), fn, steps=n,
                                lr=cfg.dpo_lr, batch_size=cfg.dpo_batch, seed=seed, desc=f"{loss} {name}")
        out[name] = world.model_reward(policy, eval_prompts, generator, samples=cfg.eval_samples, device=device)
    return out
