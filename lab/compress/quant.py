"""Group-wise low-bit weight quantization: round-to-nearest (RTN) and HQQ's half-quadratic solver.

A weight W (N, K) is cut into groups of `group_size` consecutive inputs along K (the `hqq` package's `axis=1` on a
row-major W); each group g gets a scale s_g and a zero z_g, and codes q = clamp(round(W / s + z), 0, 2^b − 1), so
that W ≈ (q − z) · s. We store the *forward* scale s (HQQ optimises with its inverse 1/s and inverts it at the
end; `quantize` follows that internally), both as float32 (N, G).

HQQ (Badri & Shaji 2023, "Half-Quadratic Quantization of Large Machine Learning Models"; the `hqq` package's
`Quantizer.quantize(..., optimize=True)`, whose solver `optimize_weights_proximal` is
`optimize_weights_proximal_legacy`) keeps the min-max scale and solves for the zero point by alternating (i) W_e =
shrink_p(W − W_r, β), a generalised soft-threshold (the proximal operator of the ℓ_p "norm" with p < 1, robust to
outliers), (ii) z = mean(q − (W − W_e)/s) per group, with β ← κβ. The early stop is the package's: iteration i
measures the mean |W − W_r| of the zero it starts from, updates the zero, and stops as soon as that error is not
below the best so far — keeping the zero it has just computed (the package's `_v2` solver instead rolls back to the
best iterate). Defaults lp=0.7, β=10, κ=1.01, 20 iterations, as in the HQQ paper and hqq ≤ 0.2.6 (FloE's
configuration is `hqq.BaseQuantizeConfig(nbits=2, group_size=64)`); hqq 0.2.7 and later no longer multiply β by κ
(their legacy loop lost that line), which is `kappa=1` here. With `kappa=1`, `tests/compress/test_quant.py` finds
scale, zero and dequantized weights equal to hqq 0.2.8.post1's at 1–4 bits. (One difference left: a group whose
range is at most 1e-4 gets inverse scale 1 in the package, the 2e4 clamp here.)

Packing (`pack`/`unpack`) is this lab's own, not the package's: each row of codes is packed along K, 8/b
consecutive codes per byte for b ∈ {1, 2, 4} (code i of a byte in bits b·i … b·i + b − 1, lowest first), ten
3-bit codes per int32 for b = 3, plain uint8 for b = 8; the INT2 rows are what the Triton kernel
`lab.kernels.floe.int2_gemv` reads. (The `hqq` package's `BitPack` packs across groups instead: it splits the
(groups, group_size) code matrix into 8/b blocks of rows and puts the first block in the highest bits.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

BITS = (1, 2, 3, 4, 8)


@dataclass
class QTensor:
    """A quantized (N, K) weight: packed codes, per-group scale and zero (float32, (N, G))."""

    packed: Tensor
    scale: Tensor
    zero: Tensor
    nbits: int
    group_size: int
    shape: tuple[int, int]

    def codes(self) -> Tensor:
        return unpack(self.packed, self.nbits, self.shape[1])  # (N, K) uint8

    def dequantize(self) -> Tensor:
        n, k = self.shape
        idx = torch.arange(k, device=self.packed.device) // self.group_size
        q = self.codes().float()
        return (q - self.zero[:, idx]) * self.scale[:, idx]  # (N, K)

    def nbytes(self, meta_bits: int = 16) -> int:
        """Storage in bytes: packed codes plus scale and zero at `meta_bits` each (fp16 by default)."""
        return self.packed.numel() * self.packed.element_size() + 2 * self.scale.numel() * meta_bits // 8

    def bits_per_weight(self, meta_bits: int = 16) -> float:
        return 8 * self.nbytes(meta_bits) / (self.shape[0] * self.shape[1])


def _groups(W: Tensor, group_size: int) -> Tensor:
    """(N, K) -> (N, G, group_size), padding the last group by repeating its final column."""
    n, k = W.shape
    g = math.ceil(k / group_size)
    pad = g * group_size - k
    if pad:
        W = torch.cat([W, W[:, -1:].expand(n, pad)], dim=1)
    return W.reshape(n, g, group_size)


def shrink_lp(x: Tensor, beta: float, p: float) -> Tensor:
    """Generalised soft-thresholding, the proximal step of (β/2)||x − ·||² + ||·||_p^p (HQQ Eq. 4)."""
    if p == 1:
        return torch.sign(x) * torch.relu(x.abs() - 1.0 / beta)
    return torch.sign(x) * torch.relu(x.abs() - (1.0 / beta) * x.abs().clamp_min(1e-12).pow(p - 1))


def quantize(W: Tensor, nbits: int = 2, group_size: int = 64, method: str = "hqq", *, lp: float = 0.7,
             beta: float = 10.0, kappa: float = 1.01, iters: int = 20) -> QTensor:
    """Quantize W (N, K) group-wise along K with `method` "rtn" (min-max) or "hqq" (proximal zero solve)."""
    if nbits not in BITS:
        raise ValueError(f"nbits={nbits} is not supported; use one of {BITS}.")
    if method not in ("rtn", "hqq"):
        raise ValueError(f"method={method!r} is unknown; use 'rtn' or 'hqq'.")
    if W.dim() != 2 or group_size < 1:
        raise ValueError(f"quantize needs a 2-D weight and group_size ≥ 1, got shape {tuple(W.shape)}.")
    n, k = W.shape
    Wg = _groups(W.detach().float(), group_size)  # (N, G, gs)
    qmax = 2**nbits - 1
    lo, hi = Wg.amin(-1, keepdim=True), Wg.amax(-1, keepdim=True)
    inv = qmax / (hi - lo).clamp_min(1e-8)  # HQQ's inverse scale 1/s, (N, G, 1)
    inv = inv.clamp(max=2e4)
    zero = -lo * inv
    if method == "hqq":
        best = float("inf")
        for _ in range(iters):
            q = torch.round(Wg * inv + zero).clamp(0, qmax)
            Wr = (q - zero) / inv  # W_r of the zero this iteration starts from
            We = shrink_lp(Wg - Wr, beta, lp)
            zero = torch.mean(q - (Wg - We) * inv, dim=-1, keepdim=True)
            beta *= kappa
            err = float((Wg - Wr).abs().mean())
            if err >= best:  # early stop as the package's solver: keep the zero just computed (module docstring)
                break
            best = err
    q = torch.round(Wg * inv + zero).clamp(0, qmax).to(torch.uint8).reshape(n, -1)[:, :k]
    return QTensor(pack(q, nbits), (1.0 / inv).squeeze(-1), zero.squeeze(-1), nbits, group_size, (n, k))


def fake_quantize(W: Tensor, nbits: int, group_size: int = 64, method: str = "hqq", **kw) -> Tensor:
    """quantize -> dequantize, in W's dtype and shape (for sensitivity sweeps)."""
    return quantize(W, nbits, group_size, method, **kw).dequantize().to(W.dtype)


def pack(q: Tensor, nbits: int) -> Tensor:
    """Codes (N, K) uint8 in [0, 2^b) -> packed (N, ceil(K/c)), c codes per byte (per int32 for b = 3)."""
    if nbits == 8:
        return q.to(torch.uint8).clone()
    per, dtype = (10, torch.int32) if nbits == 3 else (8 // nbits, torch.uint8)
    n, k = q.shape
    cols = math.ceil(k / per)
    qp = torch.zeros(n, cols * per, dtype=torch.int32, device=q.device)
    qp[:, :k] = q.to(torch.int32)
    qp = qp.reshape(n, cols, per)
    shifts = torch.arange(per, device=q.device, dtype=torch.int32) * nbits
    return (qp << shifts).sum(-1).to(dtype)  # disjoint bit fields: the sum is a bitwise or


def unpack(packed: Tensor, nbits: int, k: int) -> Tensor:
    """Inverse of `pack`: (N, ceil(K/c)) -> codes (N, K) uint8."""
    if nbits == 8:
        return packed[:, :k].to(torch.uint8)
    per = 10 if nbits == 3 else 8 // nbits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * nbits
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**nbits - 1)  # (N, cols, per)
    return q.reshape(packed.shape[0], -1)[:, :k].to(torch.uint8)


# ------------------------------------------------------------------------ fake quantization with the STE (RoSTE)

def fake_quant(x: Tensor, bits: int, *, clip: float = 1.0, sym: bool = False, ste: str = "identity") -> Tensor:
    """Q(x) = (clamp(round(x/s) + z) − z)·s over the last dim (one scale per row: per output channel for a
    weight (out, in), per token for activations, per token and head for K/V), in x's dtype; `bits` ≥ 16 is the
    identity. Asymmetric (RoSTE's experiments): x_max = c·max x, x_min = c·min x, s = (x_max − x_min)/(2^b − 1),
    z = round(−x_min/s), codes in [0, 2^b − 1]; symmetric: s = c·max|x|/(2^(b−1) − 1), z = 0, codes in
    [−2^(b−1), 2^(b−1) − 1] (RoSTE Sec. 2, official `quant_utils/quant_linear.py`; the scale is clamped at 1e-8
    here so a constant row does not divide by zero). `ste`: the backward — "identity" passes the gradient
    unaltered (the official autograd Functions), "clipped" passes it only where x lies inside the clip range
    [s·(0 − z), s·(2^b − 1 − z)] and gives 0 outside (the clipped STE of LSQ/PACT-style QAT)."""
    if bits >= 16:
        return x
    if ste not in ("identity", "clipped"):
        raise ValueError(f"ste={ste!r} is unknown; use 'identity' or 'clipped'.")
    xd = x.detach().float()
    if sym:
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        s = (clip * xd.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-8)
        z = torch.zeros_like(s)
    else:
        qmin, qmax = 0, 2**bits - 1
        hi, lo = clip * xd.amax(-1, keepdim=True), clip * xd.amin(-1, keepdim=True)
        s = ((hi - lo) / qmax).clamp_min(1e-8)
        z = torch.round(-lo / s)
    raw = torch.round(xd / s) + z
    xq = ((raw.clamp(qmin, qmax) - z) * s).to(x.dtype)
    if ste == "identity":
        return x + (xq - x).detach()
    inside = ((raw >= qmin) & (raw <= qmax)).to(x.dtype)
    return x * inside + (xq - x * inside).detach()


def quant_codes(x: Tensor, bits: int, *, clip: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """The asymmetric codes (uint8), scale and zero (float32, one per row) that `fake_quant` dequantizes:
    (codes − zero)·scale == fake_quant(x, bits, clip=clip) (for storing a fake-quantized weight packed)."""
    xd = x.detach().float()
    qmax = 2**bits - 1
    hi, lo = clip * xd.amax(-1, keepdim=True), clip * xd.amin(-1, keepdim=True)
    s = ((hi - lo) / qmax).clamp_min(1e-8)
    z = torch.round(-lo / s)
    return (torch.round(xd / s) + z).clamp(0, qmax).to(torch.uint8), s, z
