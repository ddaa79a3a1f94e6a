"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
ICLR 2023, Algorithm 1), as QuaRot runs it for its W4A4KV4 results (spcl/QuaRot `fake_quant/gptq_utils.py`), the
post-training baseline RoSTE compares against (RoSTE Table 1: "GPTQ", and QuaRot's rotation with GPTQ weights).

For one linear layer with weight W (out, in) and calibration inputs X (n, in), GPTQ minimises ‖(Ŵ − W)Xᵀ‖² with Ŵ
on the quantizer's grid, one input column at a time: column i is rounded to the grid and the not yet quantized
columns absorb its error through the inverse Hessian, W[:, i+1:] −= (w_i − q_i)/[H⁻¹]_ii · [H⁻¹]_{i, i+1:}, with
H = 2XᵀX/n + λI (λ = percdamp · mean diag, dead inputs set to 1), H⁻¹ through its upper Cholesky factor and lazy
updates in blocks of 128 columns. QuaRot's settings for its W4A4KV4 command (`main.py ... --w_bits 4 --w_clip`):
per output channel, the grid fixed from the weights before any update, with its clip found by QuaRot's MSE search
(`WeightQuantizer.find_params(mse=True)`: the range shrunk by p = 1, 0.99, …, 0.21, the p of least Σ|Q(w) − w|^2.4
per row), no groups, no act-order, percdamp 0.01, 128 calibration samples; the model is quantized block by block
and, within a block, in the order (q, k, v), o, (gate, up), down, each group's Hessian taken from inputs that the
already quantized groups and blocks produced, with activations still in full precision (QuaRot sets the activation
quantizers after GPTQ). Not QuaRot's: the grid is RoSTE's asymmetric min-max per row (`lab.compress.quant.fake_quant`'s
rule; QuaRot's default is symmetric, and its asymmetric range always includes 0, the same for any row that has both
signs). Computed in float64 (the tiny models here; QuaRot uses float32 on the GPU).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lab.compress.rotate import QuantSpec, linears, online

SEQUENTIAL = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # QuaRot's order within a block


def grid(W: Tensor, bits: int, *, clip: float = 1.0, sym: bool = False, mse: bool = False,
         norm: float = 2.4, steps: int = 80) -> tuple[Tensor, Tensor, int, int]:
    """Per-row scale s (out, 1), zero z (out, 1) and code range of `fake_quant`'s rounding rule on W at `clip`; with
    `mse`, each row's clip is instead the p ∈ {1, 0.99, …, 1 − (steps − 1)/100} of least Σ|Q_p(w) − w|^norm (QuaRot)."""
    Wd = W.detach().double()
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if sym else (0, 2**bits - 1)

    def at(c):  # (out, 1) clip ratios -> (s, z)
        if sym:
            s = (c * Wd.abs().amax(1, keepdim=True) / qmax).clamp_min(1e-8)
            return s, torch.zeros_like(s)
        hi, lo = c * Wd.amax(1, keepdim=True), c * Wd.amin(1, keepdim=True)
        s = ((hi - lo) / qmax).clamp_min(1e-8)
        return s, torch.round(-lo / s)

    if not mse:
        return *at(torch.full_like(Wd[:, :1], clip)), qmin, qmax
    best, s, z = torch.full_like(Wd[:, 0], float("inf")), None, None
    for i in range(steps):
        s1, z1 = at(torch.full_like(Wd[:, :1], 1 - i / 100))
        err = (round_to(Wd, s1, z1, qmin, qmax) - Wd).abs().pow(norm).sum(1)
        better = err < best
        best = torch.where(better, err, best)
        s, z = (s1, z1) if s is None else (torch.where(better[:, None], s1, s), torch.where(better[:, None], z1, z))
    return s, z, qmin, qmax


def round_to(w: Tensor, s: Tensor, z: Tensor, qmin: int, qmax: int) -> Tensor:
    """w (out,) or (out, k) rounded onto the grid (s, z)."""
    s, z = (s, z) if w.dim() == 2 else (s[:, 0], z[:, 0])
    return ((torch.round(w / s) + z).clamp(qmin, qmax) - z) * s


def hessian(X: Tensor) -> Tensor:
    """H = 2 XᵀX / n from inputs X (..., in), in float64."""
    X = X.reshape(-1, X.shape[-1]).double()
    return 2 * X.T @ X / X.shape[0]


def gptq(W: Tensor, H: Tensor, bits: int, *, clip: float = 1.0, sym: bool = False, mse: bool = False,
         percdamp: float = 0.01, blocksize: int = 128) -> Tensor:
    """Algorithm 1 on W (out, in) with Hessian H (in, in) -> Ŵ (out, in), float64, on W's per-row `grid`."""
    s, z, qmin, qmax = grid(W, bits, clip=clip, sym=sym, mse=mse)
    W, H = W.detach().double().clone(), H.double().clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += percdamp * H.diagonal().mean() * torch.eye(len(H), dtype=H.dtype, device=H.device)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # H⁻¹ = UᵀU
    Q = torch.zeros_like(W)
    for i1 in range(0, W.shape[1], blocksize):
        i2 = min(i1 + blocksize, W.shape[1])
        W1, E1, U1 = W[:, i1:i2].clone(), torch.zeros_like(W[:, i1:i2]), U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q = round_to(W1[:, i], s, z, qmin, qmax)
            Q[:, i1 + i], E1[:, i] = q, (W1[:, i] - q) / U1[i, i]
            W1[:, i:] -= E1[:, i:i + 1] @ U1[i:i + 1, i:]
        W[:, i2:] -= E1 @ U[i1:i2, i2:]  # the lazy batch update of the columns after the block
    return Q


class _Stop(Exception):
    pass


@torch.no_grad()
def hessians(model: nn.Module, layer: nn.Module, lins: dict[str, nn.Linear], ids: Tensor,
             batch: int = 64) -> dict[str, Tensor]:
    """H = 2XᵀX/n of what each of `lins` (QuantLinear, inside `layer`) multiplies its weight with on `ids`, R4's
    online Hadamard applied; summed batch by batch, each forward stopped once `layer` has run."""
    H, n = {name: 0.0 for name in lins}, {name: 0 for name in lins}

    def grab(name):
        def hook(mod, args):
            x = args[0] if mod.had is None else online(args[0], mod.had)
            x = x.detach().reshape(-1, x.shape[-1]).double()
            H[name], n[name] = H[name] + 2 * x.T @ x, n[name] + len(x)
        return hook

    def stop(mod, args, out):
        raise _Stop

    hooks = [lin.register_forward_pre_hook(grab(name)) for name, lin in lins.items()]
    hooks.append(layer.register_forward_hook(stop))
    try:
        for i in range(0, len(ids), batch):
            try:
                model(input_ids=ids[i:i + batch], use_cache=False)
            except _Stop:
                pass
    finally:
        for h in hooks:
            h.remove()
    return {name: H[name] / n[name] for name in lins}


@torch.no_grad()
def gptq_model(model: nn.Module, ids: Tensor, qs: QuantSpec, *, mse: bool = True, percdamp: float = 0.01) -> nn.Module:
    """GPTQ on the weights of a rotated model built by `rotate.quantize_model(..., qs.off(), ...)`, in place; then its
    quantizers quantize activations and the KV cache as `qs` says and leave the weights as GPTQ set them (already on
    the `qs.w_bits` grid). Block by block, group by group (`SEQUENTIAL`), each group's Hessian taken anew by forward
    passes stopped after its block (QuaRot caches each block's inputs instead: the same inputs). `mse`: QuaRot's
    clip search (its W4A4KV4 command's `--w_clip`); without it the grid's clip is `qs.clip_w`."""
    for layer in model.model.layers:
        lins = linears(layer)
        for group in SEQUENTIAL:
            H = hessians(model, layer, {name: lins[name] for name in group}, ids)
            for name in group:
                W = gptq(lins[name].weight, H[name], qs.w_bits, clip=qs.clip_w, sym=qs.sym, mse=mse, percdamp=percdamp)
                lins[name].weight.copy_(W.to(lins[name].weight.dtype))
    weights_done = QuantSpec(16, qs.a_bits, qs.kv_bits, qs.clip_w, qs.clip_a, qs.clip_kv, qs.sym)
    for layer in model.model.layers:  # the rotations (R4 signs, R3) stay as `quantize_model` set them
        for lin in linears(layer).values():
            lin.qs = weights_done
        layer.self_attn.roste["qs"] = weights_done
    clip = "MSE-searched clip" if mse else f"clip {qs.clip_w:g}"
    model.config.roste.update(quant=vars(weights_done), weights=f"GPTQ, {qs.w_bits}-bit per output channel, {clip}")
    return model
