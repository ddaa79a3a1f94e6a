"""FloE (Zhou et al., ICML 2025): contextual sparsity, ultra-low-bit W_up and dual predictors for MoE experts.

A Mixtral expert is a_E(x) = (SiLU(x W_gate) ⊙ (x W_up)) W_down (Eq. 1), with a_gate = SiLU(x W_gate),
a_up = x W_up, a_down = a_gate ⊙ a_up (Eqs. 3–4). The magnitude sparsifier S_t(a) = a·[|a| ≥ t] (Eq. 5)
uses a threshold per (layer, expert): t = min{t' : F(t') ≥ k}, F the empirical CDF of |a| over the
calibration tokens routed to that expert, k the target sparsity (Eq. 6). Theorem 3.1 orders the
output error of sparsifying each activation at equal kept fraction: L_down ≤ L_up < L_gate.

The FloE expert (Eq. 11) sparsifies the *up* output, a^S(x) = (SiLU(x W_gate) ⊙ S_t(x W_up)) W_down,
so only the kept rows of W_gate and W_downᵀ are needed per token, while W_up (needed whole, to find
the mask) is stored INT2 (HQQ, group 64). Its thresholds are calibrated on the activation that mask
thresholds, |x W_up| with the INT2 W_up (`floe_thresholds`), so it keeps about 1 − k of the up neurons
on new tokens (`kept_fraction`); calibrated on the full-precision up projection instead, the noisier
INT2 activations cross them more often (the `fp_thresholds` control). Predictors (Sec. 3.3): the next
layer's experts from the current MoE input through the next layer's router (inter-expert), and the
next layer's neurons as the top-|x W_up^{i+1,e}| with the resident INT2 W_up (intra-expert).

The MoE plumbing (expert weights, router, block inputs, experts swapped for an `ExpertFn`) is
`lab.moe.blocks`; the predictors' measurements are `lab.moe.floe_predictors`; the offload engine of Sec. 3.4 is
`lab.moe.offload`; the toy's measurements and
`python -m lab bench floe` are `lab.moe.floe_bench`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F_
from torch import Tensor, nn

from lab.compress.quant import QTensor, fake_quantize, quantize
from lab.core import params
from lab.moe.blocks import ExpertFn, moe_blocks, route, weights

MATRICES = ("gate", "up", "down")
SILU_MIN = 0.2784645  # −min SiLU(z), the shift c of Theorem 3.1's exponential model

CONTROLS = {  # the substitutions a skeptic would make; the notebook declares which claims each must break
    "random_mask": "every magnitude mask S_t (Eq. 5) replaced by a random mask keeping as many entries per token",
    "gate_for_up": "the mask taken from |a_gate| where FloE takes |a_up| (and from |a_up| where it takes |a_gate|)",
    "fp_thresholds": "FloE's thresholds calibrated on the full-precision W_up's |a_up| while its mask thresholds the "
                     "INT2 W_up's (Eq. 6 on another activation than the one Eq. 11 masks)",
    "random_predictor": "the inter- and intra-expert predictors replaced by random experts and random neurons",
    "whole_experts": "FloE without its sparse transfer: every up neuron kept (thresholds 0) and every row of each "
                     "predicted expert's W_gate and W_downᵀ moved by the offload engine (keep 1)",
    "untrained": "the same model untrained (its random initialisation): sensitivities a trained MoE learns vanish",
}


def check_control(control: str) -> str:
    """`""` or one of FloE's `CONTROLS` (else one `ParamError` sentence naming them)."""
    return params.check_control(control, CONTROLS)


@dataclass(frozen=True)
class Config:
    """Every size of the notebook's toy: a Mixtral (4 layers, d = 64, 8 experts of width 192, top-2) trained on
    permutation chains, its calibration and evaluation sequences, the sweeps, and the offload runs."""

    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 192
    n_experts: int = 8
    top_k: int = 2
    steps: int = 200  # training
    batch_size: int = 32
    lr: float = 3e-3
    trained: bool = True  # False under the `untrained` control: the same model at its random initialisation
    n_seq: int = 64  # calibration sequences, and as many evaluation sequences
    shown: tuple[tuple[int, ...], tuple[int, ...]] = ((1, 2, 3), (0, 1, 2, 3))  # (layers, experts) of the histograms
    ks: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9)  # sparsities of the sensitivity sweep (Table 5)
    pooled_k: float = 0.8  # sparsity of the one-threshold-per-layer comparison
    lam_grid: tuple[float, ...] = (1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 10.5, 15.0)  # Theorem 3.1's Monte Carlo over λ
    paper_lam: float = 10.5  # the paper's fitted λ ≈ 10–11
    paper_etas: tuple[float, ...] = (0.1, 0.2, 0.3)  # kept fractions at the paper's λ
    quant_bits: tuple[int, ...] = (4, 3, 2, 1)  # Table 7
    nbits: int = 2  # FloE's W_up
    group_size: int = 64  # HQQ group
    offloaded: tuple[int, ...] = (1, 2, 3)  # layers whose experts FloE replaces (layer 0 stays dense)
    gather_tokens: int = 64  # tokens of the gathered-rows = masked-dense check
    predictor_epochs: int = 10  # the trained inter-expert predictor of zju-stu-lizheng/On-the-Fly_MoE
    predictor_lr: float = 5e-4
    predictor_batch: int = 256
    predictor: str = "router"  # the offload engine's predictors; "random" under the `random_predictor` control
    whole_experts: bool = False  # True under the `whole_experts` control: the engine's FloE moves every row (keep 1)
    n_decode: int = 1  # sequences decoded by the offload engine
    bandwidths: tuple[float, ...] = (6, 25, 100)  # GB/s of the bandwidth sweep
    host_gbps: tuple[float, ...] = (5, 10, 25, 50)  # GB/s of the host row-gather sweep (simulator default 25)
    budgets_kb: tuple[float, ...] = (70, 140, 280, 700, 1400)  # device memory for experts beyond layer 0

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """Sizes for `scale` ("smoke" | "full"); `control` switches what the `untrained`, `random_predictor` and
        `whole_experts` controls change in the build (the others act on the masks, through `control=` arguments)."""
        if scale not in params.SCALES:
            raise ValueError(f"scale={scale!r} is unknown; use one of {', '.join(params.SCALES)}.")
        sizes = {} if scale == "smoke" else dict(steps=1500, n_seq=256, predictor_epochs=20, n_decode=8)
        return cls(**sizes, trained=check_control(control) != "untrained",
                   predictor="random" if control == "random_predictor" else "router",
                   whole_experts=control == "whole_experts")

    def arch(self, vocab_size: int) -> dict:
        """`lab.models.zoo.tiny_mixtral` arguments."""
        return dict(vocab_size=vocab_size, d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                    d_ff=self.d_ff, n_experts=self.n_experts, top_k=self.top_k)


def mask_source(on: str, control: str = "") -> str:
    """The activation whose magnitude sets the mask: `on`, with gate and up exchanged under `gate_for_up`."""
    if check_control(control) == "gate_for_up" and on in ("gate", "up"):
        return "up" if on == "gate" else "gate"
    return on


def random_like(mask: Tensor, generator: torch.Generator) -> Tensor:
    """A random mask with as many kept entries per row as `mask` (the `random_mask` control)."""
    r = torch.rand(mask.shape, generator=generator, device=generator.device).to(mask.device)
    return r.argsort(-1).argsort(-1) < mask.sum(-1, keepdim=True)


def activations(x: Tensor, Wg: Tensor, Wu: Tensor, Wd: Tensor | None = None) -> dict[str, Tensor]:
    """a_gate, a_up, a_down (each (n, F)) for inputs x (n, H) — Eqs. 3–4 — in x's dtype."""
    a_gate, a_up = F_.silu(x @ Wg.to(x.dtype).T), x @ Wu.to(x.dtype).T
    return {"gate": a_gate, "up": a_up, "down": a_gate * a_up}


def sparsify(a: Tensor, t: Tensor | float) -> Tensor:
    """S_t(a) = a where |a| ≥ t else 0 (Eq. 5)."""
    return a * (a.abs() >= t)


def expert_out(x: Tensor, Wg: Tensor, Wu: Tensor, Wd: Tensor, on: str | None = None, t: float = 0.0,
               generator: torch.Generator | None = None) -> Tensor:
    """Expert output (n, H), dense (`on=None`) or with S_t applied to a_gate (CATS), a_up (FloE) or a_down;
    with a `generator`, S_t's mask is replaced by a random one of the same size per token (`random_mask`)."""
    a = activations(x, Wg, Wu)
    Wd = Wd.to(x.dtype)
    if on is None:
        return a["down"] @ Wd.T
    if on not in MATRICES:
        raise ValueError(f"on={on!r} is not an activation; use one of {MATRICES}.")
    keep = a[on].abs() >= t
    if generator is not None:
        keep = random_like(keep, generator)
    h = {"gate": a["gate"] * keep * a["up"], "up": a["gate"] * (a["up"] * keep), "down": a["down"] * keep}[on]
    return h @ Wd.T


@torch.no_grad()
def thresholds(model: nn.Module, xs: list[Tensor], k: float | list[float], on: str = "up",
               per_expert: bool = True, nbits: int | None = None, group_size: int = 64) -> Tensor:
    """t (L, E) for sparsity k — the k-quantile of |a_on| over the tokens routed to each expert (Eq. 6);
    (len(k), L, E) for a list of k. `per_expert=False` pools a layer's experts into one threshold. With `nbits`,
    a_up (and so a_down) come from W_up HQQ-quantized to `nbits` (group `group_size`), exactly the weight a
    `FloEExpert` masks with; a_gate does not depend on W_up."""
    ks = torch.tensor([k] if isinstance(k, float | int) else list(k), dtype=torch.float32)
    t = torch.zeros(len(ks), len(xs), moe_blocks(model)[0].experts.down_proj.shape[0])
    quant = nbits is not None and on != "gate"
    for l, (mlp, x) in enumerate(zip(moe_blocks(model), xs)):
        _, _, idx = route(mlp, x)
        mags = []
        for e in range(t.shape[2]):
            Wg, Wu, Wd = weights(mlp, e)
            Wu = fake_quantize(Wu.detach().float(), nbits, group_size) if quant else Wu
            mags.append(activations(x[(idx == e).any(-1)], Wg, Wu, Wd)[on].abs().flatten().float())
        if per_expert:
            for e, m in enumerate(mags):
                t[:, l, e] = _quantile(m, ks) if m.numel() else float("inf")
        else:
            t[:, l] = _quantile(torch.cat(mags), ks)[:, None]
    return t[0] if isinstance(k, float | int) else t


def _quantile(m: Tensor, ks: Tensor) -> Tensor:
    """min{t : F(t) ≥ k} of the empirical CDF F of m, for each k (Eq. 6's definition, no interpolation)."""
    s = m.sort().values
    return s[(ks * len(s)).ceil().long().clamp(1, len(s)) - 1]


def floe_thresholds(model: nn.Module, xs: list[Tensor], k: float, nbits: int = 2, group_size: int = 64,
                    control: str = "") -> Tensor:
    """FloE's per-expert thresholds t (L, E) at sparsity k, calibrated (Eq. 6) on the activation the FloE expert
    masks: |x W_up| with W_up in INT2 (HQQ, `nbits`, `group_size`), since Eq. 11 thresholds the up output of the
    stored weight. Under `fp_thresholds` on the full-precision W_up's |x W_up| instead (the INT2 one, noisier,
    then crosses them more often); under `gate_for_up` on |a_gate|, the mask `floe_experts` then takes; under
    `whole_experts` all zero (every neuron kept)."""
    control = check_control(control)
    if control == "whole_experts":
        return torch.zeros(len(xs), moe_blocks(model)[0].experts.down_proj.shape[0])
    return thresholds(model, xs, k, mask_source("up", control), nbits=None if control == "fp_thresholds" else nbits,
                      group_size=group_size)


def sparse_fn(model: nn.Module, t: Tensor, on: str, control: str = "", seed: int = 0) -> ExpertFn:
    """Expert function that applies S_t to `on` with the per-(layer, expert) thresholds t (L, E); under the
    `random_mask` control each token keeps as many entries, chosen at random (seeded)."""
    blocks = moe_blocks(model)
    g = None
    if check_control(control) == "random_mask":
        g = torch.Generator(blocks[0].experts.down_proj.device).manual_seed(seed)
    return lambda l, e, x: expert_out(x, *weights(blocks[l], e), on=on, t=float(t[l, e]), generator=g)


def quant_fn(model: nn.Module, matrix: str | tuple[str, ...], nbits: int, group_size: int = 64) -> ExpertFn:
    """Expert function with `matrix` (or several) of every expert fake-quantized with HQQ to `nbits`."""
    blocks = moe_blocks(model)
    pos = [MATRICES.index(m) for m in ((matrix,) if isinstance(matrix, str) else matrix)]
    held = {}  # one layer's quantized experts at a time (a forward pass visits the layers in order): a model's
    # worth of dequantized copies would double its memory

    def fn(l: int, e: int, x: Tensor) -> Tensor:
        if (l, e) not in held:
            if any(key[0] != l for key in held):
                held.clear()
            W = [w.detach().float() for w in weights(blocks[l], e)]  # a float32 model's own tensors (no copy)
            for p in pos:
                W[p] = fake_quantize(W[p], nbits, group_size)
            held[l, e] = W
        return expert_out(x, *held[l, e])

    fn.release = held.clear  # for a caller that keeps several of these alive (`floe_bench.variant_quality`)
    return fn


class FloEExpert:
    """One compressed expert (Eq. 11): INT2 W_up (resident), FP rows of W_gate and W_downᵀ, threshold t."""

    def __init__(self, Wg: Tensor, Wu: Tensor, Wd: Tensor, t: float, nbits: int = 2, group_size: int = 64,
                 on: str = "up", random_seed: int | None = None):
        self.Wg = Wg.detach()  # (F, H), row j = gate neuron j (a view of the model's weight: no copy)
        self.Wd_t = Wd.detach().T  # (F, H), row j = down column j (a view; the engine's `rows` form co-locates them)
        self.Wq_up: QTensor = quantize(Wu.detach(), nbits, group_size)  # the only copy an expert holds: packed codes
        self.t = t
        # controls: the mask from |a_gate| (gate_for_up); a random mask of the same size (random_mask), drawn
        # from `random_seed` afresh at each call, so the same x gets the same mask in every form (dense, gathered)
        self.on, self.random_seed = on, random_seed

    @property
    def Wu(self) -> Tensor:
        """The INT2 W_up (F, H) dequantized in float32, on each use (a model's experts in FloE form hold their packed
        codes, not a second full-precision W_up)."""
        return self.Wq_up.dequantize()

    def mask(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """a_up = x W_upᵀ (n, F) with the INT2 W_up, and the kept-neuron mask |a_up| ≥ t (n, F); in x's dtype."""
        a_up = x @ self.Wu.to(x.dtype).T
        keep = (a_up if self.on == "up" else F_.silu(x @ self.Wg.to(x.dtype).T)).abs() >= self.t
        if self.random_seed is None:
            return a_up, keep
        return a_up, random_like(keep, torch.Generator().manual_seed(self.random_seed))

    def __call__(self, x: Tensor) -> Tensor:
        """Masked-dense form for a batch x (n, H) -> (n, H)."""
        a_up, m = self.mask(x)
        return (F_.silu(x @ self.Wg.to(x.dtype).T) * a_up * m) @ self.Wd_t.to(x.dtype)

    def gathered(self, x: Tensor) -> Tensor:
        """Per token, only the kept rows: y = (SiLU(W_gate[idx] x) ⊙ a_up[idx]) W_downᵀ[idx] (n, H)."""
        a_up, m = self.mask(x)
        out = []
        for xi, ai, mi in zip(x, a_up, m):
            idx = mi.nonzero().squeeze(-1)  # (kept,)
            out.append((F_.silu(self.Wg[idx].to(x.dtype) @ xi) * ai[idx]) @ self.Wd_t[idx].to(x.dtype))
        return torch.stack(out) if out else x.new_zeros(0, x.shape[-1])


def floe_experts(model: nn.Module, t: Tensor, nbits: int = 2, group_size: int = 64, control: str = "",
                 seed: int = 0) -> dict[tuple[int, int], FloEExpert]:
    """A FloEExpert for every (layer, expert) with thresholds t (L, E) on its INT2 |a_up| (`floe_thresholds`; on
    |a_gate| under the `gate_for_up` control: t must then be a_gate's; a random mask of the same size under
    `random_mask`)."""
    rnd = check_control(control) == "random_mask"
    return {(l, e): FloEExpert(*weights(mlp, e), float(t[l, e]), nbits, group_size, mask_source("up", control),
                               seed * 10_007 + l * 101 + e if rnd else None)
            for l, mlp in enumerate(moe_blocks(model)) for e in range(t.shape[1])}


def floe_fn(experts: dict[tuple[int, int], FloEExpert]) -> ExpertFn:
    """The FloE experts (masked-dense form) as an `ExpertFn`."""
    return lambda l, e, x: experts[l, e](x)


@torch.no_grad()
def kept_fraction(experts: dict[tuple[int, int], FloEExpert], model: nn.Module, xs: list[Tensor],
                  layers: tuple[int, ...] | None = None, t: Tensor | None = None) -> float:
    """The share of up neurons the FloE masks keep on the tokens routed to each expert of `layers` (all but layer
    0 by default), averaged over routed (token, expert) pairs: the sparsity FloE actually runs at is 1 − this.
    With thresholds t (L, E), the share the same masks would keep with t in place of each expert's own."""
    kept = total = 0
    for l, (mlp, x) in enumerate(zip(moe_blocks(model), xs)):
        if l not in (layers if layers is not None else range(1, len(xs))):
            continue
        _, _, idx = route(mlp, x)
        for e in idx.unique().tolist():
            ex = experts[l, e]
            if t is not None:
                ex = copy.copy(ex)  # shares the weights; only the threshold differs
                ex.t = float(t[l, e])
            _, m = ex.mask(x[(idx == e).any(-1)])
            kept, total = kept + m.sum().item(), total + m.numel()
    return kept / max(1, total)


def fit_shifted_exponential(a_gate: Tensor) -> tuple[float, float]:
    """(λ, c) of Theorem 3.1's model a_gate = z − c, z ~ Exp(λ): c = −min SiLU, λ = 1 / mean(a_gate + c) (MLE)."""
    return 1.0 / float((a_gate.float() + SILU_MIN).mean()), SILU_MIN


def theorem_errors(eta: float, lam: float, c: float = SILU_MIN, sigma: float = 1.0, n: int = 400_000,
                   seed: int = 0) -> dict[str, float]:
    """Monte Carlo of Theorem 3.1's L_x / E‖a_down W_down‖² at kept fraction η, under the theorem's model:
    a_up ~ N(0, σ²), a_gate = z − c with z ~ Exp(λ), independent; W_down iid Gaussian, so L_x ∝ E(a_down − x)².
    The closed form for up is 1 − η − 2 z_η φ(z_η), z_η = Φ⁻¹(1 − η/2) (App. A)."""
    g = torch.Generator().manual_seed(seed)
    a_gate = -torch.log(torch.rand(n, generator=g)) / lam - c  # (n,)
    a_up = sigma * torch.randn(n, generator=g)
    a_down = a_gate * a_up
    total = a_down.pow(2).mean()
    out = {}
    for name, a in (("gate", a_gate), ("up", a_up), ("down", a_down)):
        dropped = a.abs() < _quantile(a.abs(), torch.tensor([1 - eta]))[0]
        out[name] = float((a_down.pow(2) * dropped).mean() / total)
    return out
