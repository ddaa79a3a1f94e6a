"""RoSTE's theory toy (Wei et al., ICML 2025, Sec. 4): STE SGD on over-parameterised least squares with quantized
weights and inputs, with and without a random Hadamard rotation; the quantities of Theorem 4.3 and the bounds of
Prop. 4.4. Sizes in `lab.compress.roste.Config` (the `ls_*` fields)."""

from __future__ import annotations

import torch

from lab.compress import rotate
from lab.compress.quant import fake_quant
from lab.compress.roste import Config


def least_squares(cfg: Config, scale: float, rotated: bool, seed: int = 0) -> dict:
    """Over-parameterised least squares (d > n, interpolation) trained by STE SGD on o = ⟨Q_x(Rx), Q_w(Rw)⟩/√d
    (symmetric per-vector quantizers, b_w, b_x bits), y = ⟨x, w*⟩/√d, w* Gaussian with `ls_outliers` coordinates
    scaled by `scale`. Returns the final training loss, ||e||² and ||e||²_G with e = Q_w(Rw) − Rw,
    G = E[Q_x(Rx)Q_x(Rx)ᵀ]/d — the quantities of Theorem 4.3 — and Prop. 4.4's two bounds on ||e||²."""
    g = torch.Generator().manual_seed(seed)
    d, n = cfg.ls_d, cfg.ls_n
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_star = torch.randn(d, generator=g, dtype=torch.float64)
    w_star[torch.randperm(d, generator=g)[: cfg.ls_outliers]] *= scale if cfg.ls_plant else 1.0
    y = X @ w_star / d**0.5
    R = rotate.matrix(rotate.random_signs(d, g)) if rotated else torch.eye(d, dtype=torch.float64)
    Xq = fake_quant(X @ R, cfg.ls_xbits, sym=True)  # fixed: quantized rotated inputs
    w = torch.zeros(d, dtype=torch.float64)
    for _ in range(cfg.ls_steps):  # STE: the gradient w.r.t. Q_w(Rw) is passed to Rw unaltered
        b = torch.randint(0, n, (cfg.ls_batch,), generator=g)
        r = Xq[b] @ fake_quant(w @ R, cfg.ls_wbits, sym=True) / d**0.5 - y[b]
        w -= cfg.ls_lr * (Xq[b].T @ r / (cfg.ls_batch * d**0.5)) @ R.T
    wr = w @ R
    e = fake_quant(wr, cfg.ls_wbits, sym=True) - wr
    G = Xq.T @ Xq / (n * d)
    loss = 0.5 * ((Xq @ (wr + e) / d**0.5 - y) ** 2).mean()
    qmax = 2 ** (cfg.ls_wbits - 1) - 1
    return {"loss": loss.item(), "e2": (e @ e).item(), "e2_G": (e @ G @ e).item(),
            "bound_I": d * w.abs().max().item() ** 2 / (4 * qmax**2),
            "bound_H": torch.log(torch.tensor(4 * d / 0.1)).item() * (w @ w).item() / (2 * qmax**2)}


def theory(cfg: Config, seed: int = 0) -> list[dict]:
    """`least_squares` for every outlier scale × R ∈ {I, H} (R = I only under `no_rotation`), one draw per seed."""
    return [{"scale": s, "R": "H" if rot else "I", **least_squares(cfg, s, rot and cfg.rotate, seed)}
            for s in cfg.ls_scales for rot in (False, True)]
