"""Whole INT2 experts in Triton without dequantizing them: the baselines' decode path on CUDA (HQQ INT2 experts on
demand or in an LRU cache, Mixtral-offloading's group-16 experts), beside a pure-torch reference.

An expert held as three INT2 matrices (N = F rows, K = H columns, codes packed along K, scale/zero per group of K)
computes y = (SiLU(W_gate x) ⊙ W_up x) W_down with W_downᵀ the third matrix:

- gate and up: `lab.kernels.floe.int2_gemv` (a = W x, codes unpacked in registers);
- down: `int2_down`, y = Σ_j h_j · W_downᵀ[j] = hᵀ W_downᵀ, the same packed rows read as a vector-matrix product:
  a grid over (groups of ITERS_N row blocks, K blocks), each program reading its rows' packed bytes once (contiguous
  bytes per row: vector loads), decoding the four codes of a byte into the four outputs they belong to, and adding
  its partial sums into a zero-initialised fp32 y with one `tl.atomic_add` per output.

This is what Mixtral-offloading runs (dvmazur/mixtral-offloading `src/triton_kernels.py`: fused dequantize-matmul
kernels for its HQQ experts, there as batched matmuls); dequantizing a whole Mixtral expert to FP32 first, as the
torch path does, allocates ~0.7 GB of temporaries per matrix on the device (the 2026-12-04 H200 run's INT2 policies
exceeded their planned memory by that). Entry points check shapes (ValueError) and launch a fixed config, which also
runs under the Triton interpreter on CPU; `autotune=True` needs CUDA.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from lab.kernels.floe import _check, _rows, int2_gemv, unpack_int2


def int2_down_ref(h: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int) -> Tensor:
    """Dequantize W[n, k] = (q − zero[n, k // gs]) · scale[n, k // gs], then y = hᵀ W. h (N,) -> (K,) fp32."""
    g = torch.arange(k, device=packed.device) // group_size
    W = (unpack_int2(packed, k).float() - zero[:, g].float()) * scale[:, g].float()  # (N, K)
    return h.float() @ W


@triton.jit
def _int2_down_kernel(h_ptr, q_ptr, s_ptr, z_ptr, y_ptr, N, stride_q, stride_s, K: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ITERS_N: tl.constexpr):
    b = tl.program_id(1) * (BLOCK_K // 4) + tl.arange(0, BLOCK_K // 4)  # (BB,) byte columns: outputs 4b + i
    acc0 = tl.zeros([BLOCK_K // 4], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_K // 4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_K // 4], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_K // 4], dtype=tl.float32)
    for it in range(ITERS_N):
        rows = (tl.program_id(0) * ITERS_N + it) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) rows j
        in_n = rows < N
        hv = tl.load(h_ptr + rows, mask=in_n, other=0.0).to(tl.float32)  # 0 past N: those rows add nothing
        w_rows = rows.to(tl.int64)
        if K % BLOCK_K == 0:  # no column mask: the bytes load as vectors
            byte = tl.load(q_ptr + w_rows[:, None] * stride_q + b[None, :], mask=in_n[:, None], other=0)
        else:
            byte = tl.load(q_ptr + w_rows[:, None] * stride_q + b[None, :],
                           mask=in_n[:, None] & (b * 4 < K)[None, :], other=0)
        byte = byte.to(tl.int32)  # (BLOCK_N, BB); outputs past K are computed from padding and never stored
        for i in tl.static_range(4):
            qi = ((byte >> (2 * i)) & 3).to(tl.float32)
            if BLOCK_K % GROUP == 0 and GROUP % 4 == 0:  # whole groups in the chunk: scale/zero once per group
                gi = tl.program_id(1) * (BLOCK_K // GROUP) + tl.arange(0, BLOCK_K // GROUP)
                g = w_rows[:, None] * stride_s + gi[None, :]
                g2 = in_n[:, None] & (gi * GROUP < K)[None, :]
                s = tl.load(s_ptr + g, mask=g2, other=0.0).to(tl.float32)  # (BLOCK_N, NG)
                z = tl.load(z_ptr + g, mask=g2, other=0.0).to(tl.float32)
                w = (tl.reshape(qi, (BLOCK_N, BLOCK_K // GROUP, GROUP // 4)) - z[:, :, None]) * s[:, :, None]
                w = tl.reshape(w, (BLOCK_N, BLOCK_K // 4))
            elif GROUP % BLOCK_K == 0:  # the chunk inside one group
                g = w_rows * stride_s + (tl.program_id(1) * BLOCK_K) // GROUP
                s = tl.load(s_ptr + g, mask=in_n, other=0.0).to(tl.float32)  # (BLOCK_N,)
                z = tl.load(z_ptr + g, mask=in_n, other=0.0).to(tl.float32)
                w = (qi - z[:, None]) * s[:, None]
            else:  # scale and zero per weight
                col = 4 * b + i
                g = w_rows[:, None] * stride_s + (col // GROUP)[None, :]
                m2 = in_n[:, None] & (col < K)[None, :]
                w = (qi - tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)) * \
                    tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
            part = tl.sum(w * hv[:, None], axis=0)  # (BB,)
            if i == 0:
                acc0 += part
            elif i == 1:
                acc1 += part
            elif i == 2:
                acc2 += part
            else:
                acc3 += part
    # out[4b + i] = acc_i[b]: (BB, 2, 2) with [b, j, m] = acc_{2j+m}, flattened
    out = tl.reshape(tl.join(tl.join(acc0, acc2), tl.join(acc1, acc3)), (BLOCK_K,))
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.atomic_add(y_ptr + cols, out, mask=cols < K)


_FIXED = {"BLOCK_N": 16, "BLOCK_K": 64, "ITERS_N": 2}  # CPU tensors (the interpreter), as `lab.kernels.floe._FIXED`
_CUDA = {"BLOCK_N": 16, "BLOCK_K": 256, "ITERS_N": 4}  # CUDA tensors, as `lab.kernels.floe._CUDA` (untimed)


@functools.cache
def _tuned():
    """`@triton.autotune` wrapper, built on first use (CUDA only)."""
    cfg = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "ITERS_N": i}, num_warps=4) for n in (16, 32) for k in (128, 256)
           for i in (1, 4)]
    return triton.autotune(cfg, key=["N", "K", "GROUP"], reset_to_zero=["y_ptr"])(_int2_down_kernel)


def int2_down(h: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int, *,
              autotune: bool = False) -> Tensor:
    """y = hᵀ W with W (N, K) INT2 (the packing of `lab.kernels.floe.pack_int2`, scale/zero (N, ceil(K/gs)), fp16
    or fp32, read in place). h (N,) -> (K,) fp32."""
    n = packed.shape[0] if packed.dim() == 2 else -1
    g = math.ceil(k / group_size) if group_size >= 1 else -1
    _check(k >= 1 and h.shape == (n,) and packed.dtype == torch.uint8 and packed.shape == (n, math.ceil(k / 4))
           and scale.shape == zero.shape == (n, g) and scale.dtype == zero.dtype and scale.is_floating_point(),
           f"int2_down needs h (N,), uint8 packed (N, {math.ceil(k / 4)}) and float scale/zero (N, ceil(K/group_size)) "
           f"of one dtype with group_size ≥ 1; got {tuple(h.shape)}, {tuple(packed.shape)} {packed.dtype}, "
           f"{tuple(scale.shape)} {scale.dtype}, {tuple(zero.shape)}, group_size={group_size}.")
    h, packed, scale, zero = h.contiguous(), _rows(packed), scale.contiguous(), zero.contiguous()
    y = torch.zeros(k, dtype=torch.float32, device=h.device)  # atomic_add target
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"] * meta["ITERS_N"]), triton.cdiv(k, meta["BLOCK_K"]))
    args = (h, packed, scale, zero, y, n, packed.stride(0), scale.stride(0), k, group_size)
    if autotune:
        _check(h.is_cuda and type(_int2_down_kernel).__name__ != "InterpretedFunction",
               "autotune=True needs CUDA tensors and TRITON_INTERPRET unset; use the fixed config.")
        _tuned()[grid](*args)
    else:
        _int2_down_kernel[grid](*args, **(_CUDA if h.is_cuda else _FIXED))
    return y


def int2_expert(x: Tensor, mats, group_size: int, *, autotune: bool = False) -> Tensor:
    """A whole INT2 expert: mats[m] = (q, s, z) of W_gate, W_up, W_downᵀ (m = 0, 1, 2), each (F, H) packed along H,
    indexed once each and in turn (a sequence that decodes a matrix's meta when indexed holds one at a time).
    x (H,) -> (SiLU(W_gate x) ⊙ W_up x) W_down, (H,) in x's dtype (fp32 accumulation)."""
    k = x.shape[-1]
    h = F.silu(int2_gemv(x, *mats[0], group_size, k, autotune=autotune))
    h = h * int2_gemv(x, *mats[1], group_size, k, autotune=autotune)
    return int2_down(h, *mats[2], group_size, k, autotune=autotune).to(x.dtype)
