"""Olica: orthogonal neuron decomposition + linear calibration, structured pruning without retraining.

He & Lin, "Olica: Efficient Structured Pruning of Large Language Models without Retraining", ICML 2025
(arXiv 2506.08436); official code BetterTMrR/LLM-Olica (`model_pruning.py`, `utils/llama_utils.py`, `utils/utils.py`).
Conventions follow the official code where it is more specific than the paper's text:

- **Fast OND** (Sec. 3.2, `fast_OND`): per head h, A = diag(√e_out)·W_o^h with e_out the o_proj output energies;
  SVD(A) = U S Qᵀ; W_v^h ← Qᵀ W_v^h and W_o^h ← diag(1/√e_out)·U S. The product W_o^h W_v^h is unchanged (an exact
  re-parameterisation); the new value neurons are orthogonal in the output-energy norm and sorted by S.
  **Full OND** (the paper's PCA of the d×d product): SVD of diag(√e_out) W_o^h W_v^h diag(√e_in), kept at rank d_h.
- **V/O pruning**: neuron j scored I_j = ‖Ŵ_v[j]⊙√s_vin‖ + ‖Ŵ_o[:, j]‖·√s_oin_j; every head keeps the same count.
- **Q/K under RoPE**: activation-weighted truncated SVD, min ‖(W − W2 W1) D‖_F with D = diag(√s_in), rank
  r = ⌈(1 − s_qk)·d/2⌉ per projection.
- **FFN** (`thinner_mlp`): ‖W_up[j]⊙√s_in‖ + ‖W_gate[j]⊙√s_in‖ + ‖W_down[:, j]‖·√s_mid_j, ascending; the official
  quirk keeps the lowest 1 % and prunes the next ones.
- **Linear calibration** (Sec. 3.3, `solve`): ridge Ŵ = (XᵀX + λI)⁻¹XᵀE of the residual E = f(X) − f̂(X) of the
  pruned MLP, λ = percdamp·mean diag(XᵀX)/((n/128)(L/128)); columns weighted by w_j = sigmoid((ρ_j − ρ̄)/0.05)
  (ρ_j: Pearson correlation of (XŴ)_j with E_j; clamped from below), Ŵ·diag(w) = U S Vᵀ, W1 = U_r S_r,
  W2 = V_rᵀ diag(1/w), r = ⌊ratio·d⌋.
- **Layer selection**: on the dense model, ridge-fit each MLP's output from its input, score 1 − mean over output
  columns of the Pearson correlation of fit and output; the `mlp_num` lowest are calibrated, never the last layer.
- **sr_allocation** (k = 3): s_qk = 2s, s_vp = 2s/(1+k) for s ≤ 0.4; the FFN takes the rest of the budget.
  Here the budget also pays for the LC terms, so every method has the same parameter count (the official code adds
  them on top, ≈ 0.1 % at its defaults).
- **Biases** (a Llama config with `attention_bias`; the paper's models have none): v_proj's bias folds into o_proj's
  before any rotation or pruning (exact; every recipe), rank-r Q/K keep their biases, pruned FFN channels drop theirs.
- **Two passes**: pass 1 rotates every layer and scores it on the dense stream; pass 2 prunes layer by layer, each
  layer seeing the already pruned upstream layers.

The notebook's measurements, toy and checkpoint path live in `lab.compress.olica_study`; what the passes capture
from the model (block inputs, module taps, energies) in `lab.compress.olica_capture`; the scores and the in-place
edits of one module (bias folding, V/O and FFN pruning, FLAP's compensation, rank-r Q/K) in `lab.compress.olica_ops`.
The result is an `OlicaLlamaForCausalLM` (`lab.compress.pruned_llama`): a `LlamaForCausalLM` subclass, because a
plain Llama cannot hold value heads narrower than Q/K heads, rank-r Q/K or the LC term. Baselines at the same sizes:
random structured pruning, Wanda-sp (|W|·‖X‖ group sums on the raw neurons, unweighted SVD for Q/K), FLAP (An et al.,
AAAI 2024; official CASIA-IVA-Lab/FLAP: the WIFV score Var[x_j]·‖W[:, j]‖² on the input channels of o_proj and
down_proj, its uniform "UL-UM" widths, and the bias compensation W[:, pruned]·E[x_pruned] added to o_proj /
down_proj; in Olica's structure — value channels within every head where FLAP drops whole heads, unweighted SVD for
Q/K — and on the pruned upstream stream, as every method here), plain unweighted SVD everywhere
in attention, Fast OND without LC, full OND.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from lab.compress import olica_ops as ops
from lab.compress import pruned_llama as om
from lab.compress.olica_capture import block_inputs, energy, run_block, stats, taps
from lab.compress.pruned_llama import OlicaLlamaConfig, OlicaLlamaForCausalLM, param_table  # noqa: F401 (registers)
from lab.models.spec import TinyLM

CONTROLS = ("random", "shuffled_lc")


@dataclass(frozen=True)
class Recipe:
    """How one method prunes: rotation ("fast" | "full" | "plain" | "none"), Q/K ("weighted" | "plain" | "random"),
    V/O scores ("olica" | "singular" | "wanda" | "flap" | "random"), FFN scores ("olica" | "wanda" | "flap" |
    "random"), LC on/off, FLAP's bias compensation on/off."""

    rotate: str = "fast"
    qk: str = "weighted"
    vo: str = "olica"
    ffn: str = "olica"
    lc: bool = True
    compensate: bool = False
    lc_pairs: str = "matched"  # "shuffled" (control `shuffled_lc`): the LC fit sees E's rows permuted against X's


METHODS = {"Olica (Fast-OND + LC)": Recipe(), "Fast-OND (no LC)": Recipe(lc=False),
           "full OND + LC": Recipe(rotate="full"), "plain SVD": Recipe("plain", "plain", "singular", "olica", False),
           "Wanda-sp": Recipe("none", "plain", "wanda", "wanda", False),
           "FLAP": Recipe("none", "plain", "flap", "flap", False, True),
           "random": Recipe("none", "random", "random", "random", False)}


@dataclass(frozen=True)
class Config:
    model: TinyLM = TinyLM("llama", d_model=64, n_layers=4, n_heads=4, max_len=128, d_ff=192, steps=400,
                         batch_size=24)
    n_calib: int = 32  # calibration sequences (the 4-sample variant: n_small)
    n_small: int = 4
    n_eval: int = 128  # held-out sequences for perplexity
    s: float = 0.33  # target sparsity of all parameters
    sparsities: tuple[float, ...] = (0.2, 0.25, 0.33)
    k: float = 3.0  # sr_allocation
    mlp_num: int = 3  # calibrated FFN layers (all but the last; official default 6 of 32)
    lc_ratio: float = 0.1  # LC rank r = ⌊ratio·d⌋ (official default 0.03; the paper also reports 0.15)
    # The official λ = percdamp·mean diag(XᵀX)/((n/128)(L/128)) is a fixed multiple of the mean per-token energy: its
    # default 0.5 at the official 256 × 128 calibration tokens gives λ = 0.25·mean diag(XᵀX). At the toy's 32 × 64 the
    # same 0.5 would damp 16× as hard relative to XᵀX (4·mean diag), so `for_scale` sets percdamp = 0.5·nL/(256·128):
    # the official relative strength at `n_calib` sequences; the 4-sequence variant keeps that λ (relative 2.0), as the
    # official formula does when calibration shrinks.
    percdamp: float = 0.5 * 32 * 64 / (256 * 128)
    vo_keep: float = 0.5  # per-head keep ratio of the V/O error comparison
    method: str = "Olica (Fast-OND + LC)"  # what the claims call Olica (control `random`: the random baseline)
    ond: str = "fast"  # rotation of the V/O error comparison (control `random`: none, random neurons)
    ond_score: str = "olica"
    lc_pairs: str = "matched"  # control `shuffled_lc`: Olica's LC fitted with E's rows permuted against X's
    seqlen: int = 64

    @classmethod
    def for_scale(cls, scale: str = "smoke", control: str = "") -> Config:
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; use one of {', '.join(CONTROLS)}.")
        cfg = cls() if scale == "smoke" else cls(model=replace(cls().model, steps=2000), n_calib=128, n_eval=512,
                                                 percdamp=0.5 * 128 * 64 / (256 * 128))
        if control == "random":
            cfg = replace(cfg, method="random", ond="none", ond_score="random")
        return replace(cfg, lc_pairs="shuffled" if control == "shuffled_lc" else "matched")

    def recipe(self, name: str) -> Recipe:
        r = METHODS[name]
        return replace(r, lc_pairs=self.lc_pairs) if name == self.method else r


# ------------------------------------------------------------------------------------------ the decompositions

def fast_ond(w_v: torch.Tensor, w_o: torch.Tensor, e_out: torch.Tensor, H: int):
    """Fast OND of one layer: W_v (H·d_h, d), W_o (d, H·d_h), e_out (d,) -> rotated (W_v, W_o) and S (H, d_h)."""
    w_v, w_o = w_v.float().clone(), w_o.float().clone()
    dh, g = w_v.shape[0] // H, e_out.float().clamp_min(1e-12).sqrt()[:, None]  # (d, 1) √e_out
    S = []
    for h in range(H):
        rows = slice(h * dh, (h + 1) * dh)
        U, s, Qt = torch.linalg.svd(g * w_o[:, rows], full_matrices=False)  # (d, d_h), (d_h,), (d_h, d_h)
        w_v[rows], w_o[:, rows] = Qt @ w_v[rows], U * s / g
        S.append(s)
    return w_v, w_o, torch.stack(S)


def full_ond(w_v: torch.Tensor, w_o: torch.Tensor, e_out: torch.Tensor, e_in: torch.Tensor, H: int):
    """OND by the SVD of each weighted d×d product diag(√e_out) W_o^h W_v^h diag(√e_in), kept at rank d_h."""
    w_v, w_o = w_v.float().clone(), w_o.float().clone()
    dh = w_v.shape[0] // H
    g, c = e_out.float().clamp_min(1e-12).sqrt()[:, None], e_in.float().clamp_min(1e-12).sqrt()[None]
    S = []
    for h in range(H):
        rows = slice(h * dh, (h + 1) * dh)
        U, s, Vt = torch.linalg.svd(g * (w_o[:, rows] @ w_v[rows]) * c)  # (d, d), (d,), (d, d)
        w_v[rows], w_o[:, rows] = Vt[:dh] / c, U[:, :dh] * s[:dh] / g
        S.append(s[:dh])
    return w_v, w_o, torch.stack(S)


def weighted_svd(w: torch.Tensor, s_in: torch.Tensor | None, r: int):
    """min ‖(W − W2 W1) D‖_F, D = diag(√s_in) (None: unweighted) -> W1 (r, d), W2 (out, r)."""
    D = torch.ones(w.shape[1]) if s_in is None else s_in.float().sqrt()
    D = D.to(w.device).clamp_min(1e-6 * D.max())
    U, S, Vt = torch.linalg.svd(w.float() * D, full_matrices=False)
    return Vt[:r] / D, U[:, :r] * S[:r]


def ridge(X: torch.Tensor, E: torch.Tensor, percdamp: float, n_samples: int, seqlen: int) -> torch.Tensor:
    """Ŵ = (XᵀX + λI)⁻¹ XᵀE with the official damping λ = percdamp·mean diag(XᵀX)/((n/128)(L/128))."""
    X, E = X.double(), E.double()
    G = X.T @ X
    lam = percdamp * G.diagonal().mean() / ((n_samples / 128) * (seqlen / 128))
    L = torch.linalg.cholesky(G + (lam + 1e-10 * G.diagonal().mean()) * torch.eye(len(G), dtype=G.dtype,
                                                                                 device=G.device))
    return torch.cholesky_solve(X.T @ E, L).float()


def lc_factors(X: torch.Tensor, E: torch.Tensor, W: torch.Tensor, r: int, tau: float = 0.05, w_min: float = 0.05):
    """Low-rank LC: column weights w from the per-column correlations, W·diag(w) = U S Vᵀ -> W1 (d, r), W2 (r, d)."""
    P = X.float() @ W
    Pc, Ec = P - P.mean(0), E.float() - E.float().mean(0)
    rho = (Pc * Ec).sum(0) / (Pc.norm(dim=0) * Ec.norm(dim=0)).clamp_min(1e-12)  # Pearson ρ_j
    w = torch.sigmoid((rho - rho.mean()) / tau).clamp_min(w_min)
    U, S, Vt = torch.linalg.svd(W * w, full_matrices=False)
    return U[:, :r] * S[:r], Vt[:r] / w, w


def sr_allocation(s: float, k: float = 3.0) -> tuple[float, float]:
    """(s_qk, s_vp): Q/K low-rank and V/O neuron sparsities of the official `sr_allocation`."""
    s_vp = 2 * s / (1 + k)
    return (2 * s if s <= 0.4 else k * s_vp), s_vp


@dataclass(frozen=True)
class Plan:
    r_qk: int
    d_v: int
    d_ff: int
    lc_layers: tuple[int, ...]
    r_lc: int


def make_plan(model: nn.Module, s: float, k: float, lc_layers=(), lc_ratio: float = 0.03) -> Plan:
    """Sizes that remove the fraction s of *all* parameters (embeddings included), LC terms paid by the FFN."""
    c = model.config
    d, H, L, F = c.hidden_size, c.num_attention_heads, c.num_hidden_layers, c.intermediate_size
    dh = d // H
    s_qk, s_vp = sr_allocation(s, k)
    r, dv, r_lc = math.ceil((1 - s_qk) * d / 2), dh - int(s_vp * dh), int(lc_ratio * d)  # d_v: official rounding
    if r < 1 or dv < 1:
        from lab.core.params import ParamError

        raise ParamError(f"s={s:g}, k={k:g} leave {'no Q/K rank' if r < 1 else 'no V/O neuron per head'} at this "
                         f"model's hidden {d} and head dim {dh} (Q/K sparsity {s_qk:.3f}, V/O {s_vp:.3f}); lower s "
                         "or change k.")
    total = om.n_params(model)
    fixed = total - L * (4 * d * d + 3 * d * F)  # embeddings, head, norms
    mlp = (1 - s) * total - fixed - L * (4 * r * d + 2 * d * H * dv) - 2 * d * r_lc * len(lc_layers)
    return Plan(r, dv, max(1, min(F, round(mlp / (3 * d * L)))), tuple(lc_layers), r_lc)


# ---------------------------------------------------------------------------------------------- the passes

def rotate(attn: nn.Module, how: str, e_out: torch.Tensor, e_in: torch.Tensor, H: int) -> None:
    """Re-parameterise V/O of one attention module in place (exact: the function is unchanged)."""
    ops.fold_value_bias(attn)  # every recipe: exact, and a baseline that drops value channels keeps their bias's share
    if how == "none":
        return
    wv, wo = attn.v_proj.weight, attn.o_proj.weight
    new = full_ond(wv, wo, e_out, e_in, H) if how == "full" else fast_ond(wv, wo, torch.ones_like(e_out)
                                                                          if how == "plain" else e_out, H)
    with torch.no_grad():
        wv.copy_(new[0]), wo.copy_(new[1])


def mlp_predictability(X: torch.Tensor, Y: torch.Tensor, percdamp: float, n: int, seqlen: int) -> float:
    """The official layer score (`fast_OND`): 1 − mean over output columns j of the Pearson correlation ρ_j between
    the ridge fit of Y from X and Y (low: linear). Not the per-token cosine `solve` also returns (unused there)."""
    P = X.float() @ ridge(X, Y, percdamp, n, seqlen)
    Pc, Yc = P - P.mean(0), Y.float() - Y.float().mean(0)
    rho = (Pc * Yc).sum(0) / (Pc.norm(dim=0) * Yc.norm(dim=0)).clamp_min(1e-12)
    return 1 - rho.mean().item()


@torch.no_grad()
def prune(model: nn.Module, calib: torch.Tensor, s: float, recipe: Recipe, cfg: Config, *, held_out=None, seed=0):
    """Olica (or a baseline recipe) on a copy of `model` -> (OlicaLlamaForCausalLM, info)."""
    t0, g = time.perf_counter(), torch.Generator().manual_seed(seed)
    m = om.from_llama(model) if not isinstance(model, OlicaLlamaForCausalLM) else copy.deepcopy(model)
    c, blocks = m.config, m.model.layers
    H, n, T = c.num_attention_heads, calib.shape[0], calib.shape[1]
    x, kw = block_inputs(m, calib)
    scores = []
    for b in blocks:  # pass 1: dense stream, rotation + layer scores
        with taps({"v": b.self_attn.v_proj, "o": b.self_attn.o_proj, "mlp": b.mlp}) as t:
            x = run_block(b, x, kw)
        X, Y = t["mlp"][0].flatten(0, -2), t["mlp"][1].flatten(0, -2)
        scores.append(mlp_predictability(X, Y, cfg.percdamp, n, T))
        rotate(b.self_attn, recipe.rotate, energy(t["o"][1]), energy(t["v"][0]), H)
    order = sorted(range(len(blocks) - 1), key=lambda j: scores[j])
    plan = make_plan(model, s, cfg.k, sorted(order[:cfg.mlp_num]) if recipe.lc else (), cfg.lc_ratio)
    x, kw = block_inputs(m, calib)
    xe, kwe = block_inputs(m, held_out) if held_out is not None else (None, None)
    lc_res, lc_var = {}, {}
    for i, b in enumerate(blocks):  # pass 2: the pruned upstream stream
        a, f = b.self_attn, b.mlp
        with taps({"v": a.v_proj, "o": a.o_proj, "mlp": f, "mid": f.down_proj}) as t:
            run_block(b, x, kw)
        s_vin, s_oin, X = energy(t["v"][0]), energy(t["o"][0]), t["mlp"][0].flatten(0, -2)
        # FLAP's statistics of o_proj's and down_proj's inputs (captured, like every method's energies, on this block
        # before any of it is pruned), only for a recipe that reads them
        flap = "flap" in (recipe.vo, recipe.ffn) or recipe.compensate
        st = {k: stats(t[k][0]) if flap else (None, None) for k in ("o", "mid")}  # name -> (mean, variance)
        for name in ("q_proj", "k_proj"):
            w = getattr(a, name).weight
            if recipe.qk == "random":
                P = torch.linalg.qr(torch.randn(w.shape[1], plan.r_qk, generator=g))[0].to(w.device)
                setattr(a, name, ops.low_rank_linear(getattr(a, name), P.T, w.float() @ P))
            else:
                w1, w2 = weighted_svd(w, s_vin if recipe.qk == "weighted" else None, plan.r_qk)
                setattr(a, name, ops.low_rank_linear(getattr(a, name), w1, w2))
        ops.prune_vo(a, ops.vo_scores(a, recipe.vo, s_vin, s_oin, g, st["o"][1]), H, plan.d_v,
                     st["o"][0] if recipe.compensate else None)
        dense = copy.deepcopy(f)
        scores_ffn = ops.ffn_scores(f, recipe.ffn, energy(X), energy(t["mid"][0]), g, st["mid"][1])
        keep = ops.ffn_keep(scores_ffn, plan.d_ff, 0.01 if recipe.ffn == "olica" else 0.0)
        ops.prune_ffn(f, keep, st["mid"][0] if recipe.compensate else None)
        if i in plan.lc_layers:
            E = dense(X) - f(X)
            if recipe.lc_pairs == "shuffled":  # control: the same fit with nothing of E's pairing with X left
                E = E[torch.randperm(len(E), generator=g, device="cpu").to(E.device)]
            W = ridge(X, E, cfg.percdamp, n, T)
            w1, w2, _ = lc_factors(X, E, W, plan.r_lc)
            f.lc = om.low_rank(X.shape[1], plan.r_lc, X.shape[1]).to(X.device, X.dtype)
            f.lc[0].weight.copy_(w1.T), f.lc[1].weight.copy_(w2.T)
            if xe is not None:
                with taps({"mlp": f}) as te:
                    run_block(b, xe, kwe)
                Xe = te["mlp"][0].flatten(0, -2)
                E = dense(Xe) - (te["mlp"][1].flatten(0, -2) - f.lc(Xe))
                R = E - f.lc(Xe)  # what LC leaves; centred: the share of E's variation (beyond its mean) left
                lc_res[i] = (R.norm() / E.norm()).item()
                lc_var[i] = ((R - R.mean(0)).norm() / (E - E.mean(0)).norm()).item()
        x = run_block(b, x, kw)
        xe = run_block(b, xe, kwe) if xe is not None else None
    om.sync_config(m)
    return m.eval(), {"plan": plan, "layer_scores": scores, "lc_residual": lc_res, "lc_residual_centred": lc_var,
                       "seconds": time.perf_counter() - t0}
