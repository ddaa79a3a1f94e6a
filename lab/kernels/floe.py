"""FloE's sparse expert kernels in Triton, each beside a pure-torch reference (FloE, ICML 2025, Alg. 1, Sec. 3.4).

A Mixtral expert computes y = (SiLU(x W_gateᵀ) ⊙ (x W_upᵀ)) W_downᵀ. FloE keeps W_up resident in INT2 (HQQ,
group-wise), computes a_up = x W_upᵀ first, and keeps only the neurons j with |a_up_j| ≥ t (contextual sparsity),
so only row j of W_gate and row j of W_downᵀ are fetched and multiplied. For one decoding token (GEMV):

- `masked_gate_up`: h_j = SiLU(W_gate[j]·x) · a_up_j on kept rows, 0 elsewhere; one program per BLOCK_F rows,
  masked-off rows are never loaded, the H loop runs in BLOCK_H chunks with fp32 accumulation.
- `masked_down`: y = Σ_{j kept} h_j · W_downᵀ[j]; a grid over (groups of ITERS_F row blocks, H blocks) whose
  partial sums meet in a zero-initialised fp32 output through `tl.atomic_add` (as FloE and CATS do), one atomic add
  per output and program.
- `int2_gemv`: a_up = W_up x with W_up unpacked from 2-bit codes (the packing of `lab.compress.quant`) in registers:
  each packed byte loaded once (contiguous bytes per row: vector loads) and its four codes multiplied with the four
  inputs they belong to; the FP16 (or FP32) scale/zero applied once per group,
  Σ_g s_g (Σ_{k∈g} q_k x_k − z_g Σ_{k∈g} x_k), not once per weight; `rows=idx` computes only the kept rows.
- `sparse_expert`: the offload engine's decode path (`lab.moe.offload_policies`) on CUDA, on the compact transferred
  rows (n, 2, H) read in place through their row stride, in two launches: the up projection on the kept INT2 rows
  and the gate step fused (one pass over x), then `masked_down` with no mask; output in x's dtype.
- `gather_rows`: kept gate row j and down row j side by side, FloE's compact transfer layout.

Entry points take torch tensors, check shapes (ValueError), allocate the output and launch a kernel with a fixed config
(`_FIXED` on CPU tensors, `_CUDA` on CUDA ones); this path also runs on CPU tensors under the Triton interpreter
(`TRITON_INTERPRET=1`, read when `@triton.jit` decorates, so set it before importing). Loop bounds (H, K) are
`tl.constexpr` because the interpreter cannot loop to a runtime int. `autotune=True` selects `@triton.autotune` wrappers
of the same kernels; they are built lazily on first use, CUDA only, because autotuning fails under the interpreter.
`lab.kernels.floe_bench.bench` times them on a GPU.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

# ----------------------------------------------------------------------------------------------- torch references


def masked_gate_up_ref(x: Tensor, w_gate: Tensor, a_up: Tensor, mask: Tensor) -> Tensor:
    """h = SiLU(W_gate x) ⊙ a_up on kept neurons, 0 elsewhere. x (H,), w_gate (F, H), a_up (F,), mask (F,) -> (F,)."""
    h = F.silu(w_gate.float() @ x.float()) * a_up.float()
    return torch.where(mask, h, torch.zeros_like(h))


def masked_down_ref(h: Tensor, w_down_t: Tensor, mask: Tensor) -> Tensor:
    """y = Σ_{j: mask_j} h_j W_downᵀ[j]. h (F,), w_down_t (F, H), mask (F,) -> (H,) fp32."""
    return (h.float() * mask.float()) @ w_down_t.float()


def pack_int2(q: Tensor) -> Tensor:
    """Codes q (N, K) in {0..3} -> uint8 (N, ceil(K/4)), packed[n, c] = Σ_i q[n, 4c+i] << 2i (K padded with 0)."""
    n, k = q.shape
    qp = torch.zeros(n, 4 * math.ceil(k / 4), dtype=torch.int32, device=q.device)
    qp[:, :k] = q.to(torch.int32)
    shifts = torch.arange(4, dtype=torch.int32, device=q.device) * 2
    return (qp.reshape(n, -1, 4) << shifts).sum(-1).to(torch.uint8)  # disjoint bit fields: sum == or


def unpack_int2(packed: Tensor, k: int) -> Tensor:
    """Inverse of `pack_int2`: uint8 (N, ceil(K/4)) -> codes (N, K) uint8."""
    shifts = torch.arange(4, dtype=torch.int32, device=packed.device) * 2
    q = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 3  # (N, C, 4)
    return q.reshape(packed.shape[0], -1)[:, :k].to(torch.uint8)


def int2_gemv_ref(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int) -> Tensor:
    """Dequantize W[n, k] = (q − zero[n, k // gs]) · scale[n, k // gs], then y = W x. x (K,) -> (N,) fp32."""
    g = torch.arange(k, device=packed.device) // group_size
    W = (unpack_int2(packed, k).float() - zero[:, g].float()) * scale[:, g].float()  # (N, K)
    return W @ x.float()


def gather_rows_ref(w_gate: Tensor, w_down_t: Tensor, idx: Tensor) -> Tensor:
    """Staging (len(idx), 2, H): [i, 0] = W_gate[idx_i], [i, 1] = W_downᵀ[idx_i]."""
    return torch.stack([w_gate[idx], w_down_t[idx]], dim=1)


# ----------------------------------------------------------------------------------------------- Triton kernels


@triton.jit
def _masked_gate_up_kernel(x_ptr, wg_ptr, a_ptr, m_ptr, h_ptr, F, stride_wg, H: tl.constexpr,
                           BLOCK_F: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_F + tl.arange(0, BLOCK_F)  # (BLOCK_F,) neurons j
    in_f = rows < F
    keep = (tl.load(m_ptr + rows, mask=in_f, other=0) != 0) & in_f
    acc = tl.zeros([BLOCK_F], dtype=tl.float32)  # W_gate[j] · x
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        in_h = cols < H
        xv = tl.load(x_ptr + cols, mask=in_h, other=0.0).to(tl.float32)  # (BLOCK_H,)
        w = tl.load(wg_ptr + rows[:, None] * stride_wg + cols[None, :], mask=keep[:, None] & in_h[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_F, BLOCK_H); masked-off rows are not read
        acc += tl.sum(w * xv[None, :], axis=1)
    a = tl.load(a_ptr + rows, mask=keep, other=0.0).to(tl.float32)
    h = tl.where(keep, acc * tl.sigmoid(acc) * a, 0.0)  # SiLU(g) ⊙ a_up
    tl.store(h_ptr + rows, h, mask=in_f)


@triton.jit
def _masked_down_kernel(h_ptr, wd_ptr, m_ptr, y_ptr, F, H, stride_wd, HAS_MASK: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_H: tl.constexpr, ITERS_F: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (BLOCK_H,) outputs
    in_h = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for i in range(ITERS_F):  # ITERS_F row blocks summed here: one atomic add per output for all of them
        rows = (tl.program_id(0) * ITERS_F + i) * BLOCK_F + tl.arange(0, BLOCK_F)  # (BLOCK_F,) neurons j
        in_f = rows < F
        if HAS_MASK:
            keep = (tl.load(m_ptr + rows, mask=in_f, other=0) != 0) & in_f
        else:  # every row kept (FloE's transferred rows)
            keep = in_f
        hv = tl.load(h_ptr + rows, mask=keep, other=0.0).to(tl.float32)
        w = tl.load(wd_ptr + rows[:, None] * stride_wd + cols[None, :], mask=keep[:, None] & in_h[None, :],
                    other=0.0).to(tl.float32)  # (BLOCK_F, BLOCK_H)
        acc += tl.sum(w * hv[:, None], axis=0)
    tl.atomic_add(y_ptr + cols, acc, mask=in_h)  # this program's partial sum over its rows


@triton.jit
def _int2_chunk(xv, q_ptr, s_ptr, z_ptr, w_rows, in_n, k0, stride_q, stride_s, K: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Σ_{k0 ≤ k < k0 + BLOCK_K} W[w_rows, k] x_k for INT2 W: (BLOCK_N,) fp32; xv the chunk of x (BLOCK_K,) fp32,
    0 past K (a ragged last byte's padding codes add nothing)."""
    # each packed byte loaded once (BLOCK_K // 4 contiguous bytes a row: wide loads), its four codes
    # (code i in bits 2i, 2i + 1) multiplied with the four inputs 4b + i they belong to
    b = k0 // 4 + tl.arange(0, BLOCK_K // 4)  # (BB,) byte columns
    if K % BLOCK_K == 0:  # no column mask: a mask constant along the row lets the bytes load as vectors
        byte = tl.load(q_ptr + w_rows[:, None] * stride_q + b[None, :], mask=in_n[:, None], other=0)
    else:
        byte = tl.load(q_ptr + w_rows[:, None] * stride_q + b[None, :],
                       mask=in_n[:, None] & (b * 4 < K)[None, :], other=0)
    byte = byte.to(tl.int32)  # (BLOCK_N, BB)
    x02, x13 = tl.split(tl.reshape(xv, (BLOCK_K // 4, 2, 2)))  # x[4b + i], i = 0..3: (BB, 2) = [x[4b], x[4b + 2]]
    x0, x2 = tl.split(x02)  # and [x[4b + 1], x[4b + 3]]
    x1, x3 = tl.split(x13)
    q0, q1 = (byte & 3).to(tl.float32), ((byte >> 2) & 3).to(tl.float32)
    q2, q3 = ((byte >> 4) & 3).to(tl.float32), ((byte >> 6) & 3).to(tl.float32)
    # Σ_k (q − z_g) s_g x_k = Σ_g s_g (Σ_{k∈g} q x − z_g Σ_{k∈g} x): scale and zero (fp16 or fp32, read as they
    # are) loaded once per group, not per weight, where a chunk holds whole groups or lies inside one
    if BLOCK_K % GROUP == 0 and GROUP % 4 == 0:
        qx = q0 * x0[None, :] + q1 * x1[None, :] + q2 * x2[None, :] + q3 * x3[None, :]  # (BLOCK_N, BB)
        gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)  # (NG,) the chunk's groups
        g2 = in_n[:, None] & (gi * GROUP < K)[None, :]
        g = w_rows[:, None] * stride_s + gi[None, :]
        s = tl.load(s_ptr + g, mask=g2, other=0.0).to(tl.float32)  # (BLOCK_N, NG)
        z = tl.load(z_ptr + g, mask=g2, other=0.0).to(tl.float32)
        qxg = tl.sum(tl.reshape(qx, (BLOCK_N, BLOCK_K // GROUP, GROUP // 4)), axis=2)  # (BLOCK_N, NG)
        xs = tl.sum(tl.reshape(x0 + x1 + x2 + x3, (BLOCK_K // GROUP, GROUP // 4)), axis=1)  # (NG,)
        part = tl.sum(s * (qxg - z * xs[None, :]), axis=1)
    elif GROUP % BLOCK_K == 0:
        g = w_rows * stride_s + k0 // GROUP
        s = tl.load(s_ptr + g, mask=in_n, other=0.0).to(tl.float32)  # (BLOCK_N,)
        z = tl.load(z_ptr + g, mask=in_n, other=0.0).to(tl.float32)
        qx = q0 * x0[None, :] + q1 * x1[None, :] + q2 * x2[None, :] + q3 * x3[None, :]
        part = s * (tl.sum(qx, axis=1) - z * tl.sum(x0 + x1 + x2 + x3, axis=0))
    else:  # a group size that neither divides nor is divided by the chunk: scale and zero per weight
        part = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in tl.static_range(4):
            qi = q0 if i == 0 else (q1 if i == 1 else (q2 if i == 2 else q3))
            xi = x0 if i == 0 else (x1 if i == 1 else (x2 if i == 2 else x3))
            col = 4 * b + i
            m2 = in_n[:, None] & (col < K)[None, :]
            g = w_rows[:, None] * stride_s + (col // GROUP)[None, :]
            s = tl.load(s_ptr + g, mask=m2, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g, mask=m2, other=0.0).to(tl.float32)
            part += tl.sum((qi - z) * s * xi[None, :], axis=1)
    return part


@triton.jit
def _int2_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, idx_ptr, N, stride_q, stride_s, K: tl.constexpr,
                      GROUP: tl.constexpr, HAS_IDX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) outputs n
    in_n = rows < N
    if HAS_IDX:  # output n is weight row idx[n] (the kept neurons only)
        w_rows = tl.load(idx_ptr + rows, mask=in_n, other=0).to(tl.int64)
    else:
        w_rows = rows.to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # x loaded contiguously
        xv = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += _int2_chunk(xv, q_ptr, s_ptr, z_ptr, w_rows, in_n, k0, stride_q, stride_s, K, GROUP, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + rows, acc, mask=in_n)


@triton.jit
def _compact_gate_up_kernel(x_ptr, r_ptr, q_ptr, s_ptr, z_ptr, idx_ptr, h_ptr, N, stride_r, stride_q, stride_s,
                            K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h_i = SiLU(rows[i, 0] · x) · (W_up[idx_i] · x) over FloE's transferred rows i (gate row i in place, row stride
    stride_r) and the resident INT2 W_up: the up projection on the kept rows and the gate step in one pass over x."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) transferred rows i
    in_n = rows < N
    w_rows = tl.load(idx_ptr + rows, mask=in_n, other=0).to(tl.int64)  # their neurons j = idx_i in W_up
    r_rows = rows.to(tl.int64)
    a = tl.zeros([BLOCK_N], dtype=tl.float32)  # W_up[j] · x
    g = tl.zeros([BLOCK_N], dtype=tl.float32)  # W_gate[j] · x
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        a += _int2_chunk(xv, q_ptr, s_ptr, z_ptr, w_rows, in_n, k0, stride_q, stride_s, K, GROUP, BLOCK_N, BLOCK_K)
        if K % BLOCK_K == 0:
            w = tl.load(r_ptr + r_rows[:, None] * stride_r + cols[None, :], mask=in_n[:, None], other=0.0)
        else:
            w = tl.load(r_ptr + r_rows[:, None] * stride_r + cols[None, :],
                        mask=in_n[:, None] & (cols < K)[None, :], other=0.0)
        g += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    tl.store(h_ptr + rows, g * tl.sigmoid(g) * a, mask=in_n)


@triton.jit
def _gather_rows_kernel(wg_ptr, wd_ptr, idx_ptr, out_ptr, H, stride_wg, stride_wd, BLOCK_H: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = cols < H
    j = tl.load(idx_ptr + i).to(tl.int64)
    tl.store(out_ptr + i * 2 * H + cols, tl.load(wg_ptr + j * stride_wg + cols, mask=in_h), mask=in_h)
    tl.store(out_ptr + (i * 2 + 1) * H + cols, tl.load(wd_ptr + j * stride_wd + cols, mask=in_h), mask=in_h)


# Fixed configs: `_FIXED` for CPU tensors (the interpreter: small tiles, so the tests' ragged sizes run several loop
# iterations), `_CUDA` for CUDA tensors, the offload engine's decode path at Mixtral's shape (H = 4096): wide tiles, a
# few loop iterations per program and 16-byte loads per thread (the interpreter's 64-wide tiles need 64 iterations
# over H); chosen without GPU timings, `lab.kernels.floe_bench.bench` times them beside the autotuned ones.
_FIXED = {"gate_up": {"BLOCK_F": 16, "BLOCK_H": 64}, "down": {"BLOCK_F": 32, "BLOCK_H": 64, "ITERS_F": 2},
          "int2": {"BLOCK_N": 16, "BLOCK_K": 64}, "compact": {"BLOCK_N": 16, "BLOCK_K": 64}}
_CUDA = {"gate_up": {"BLOCK_F": 16, "BLOCK_H": 256}, "down": {"BLOCK_F": 32, "BLOCK_H": 256, "ITERS_F": 2},
         "int2": {"BLOCK_N": 16, "BLOCK_K": 256}, "compact": {"BLOCK_N": 8, "BLOCK_K": 256}}


@functools.cache
def _tuned(name: str):
    """`@triton.autotune` wrapper of one kernel, built on first use (never at import: the interpreter rejects it).
    Six to eight configs each (54 in all before 2026-12-04: tuning them was most of notebook 05's CUDA run), chosen
    without GPU timings; `lab.kernels.floe_bench.bench` records the ones picked. The INT2 kernels are keyed on the
    group size too (HQQ's 64 and Mixtral-offloading's 16 are tuned apart)."""
    C = triton.Config
    if name == "gate_up":
        cfg = [C({"BLOCK_F": f, "BLOCK_H": h}, num_warps=4) for f in (8, 16, 32) for h in (256, 512)]
        return triton.autotune(cfg, key=["F", "H"])(_masked_gate_up_kernel)
    if name == "down":
        cfg = [C({"BLOCK_F": f, "BLOCK_H": h, "ITERS_F": i}, num_warps=4) for f in (32, 64) for h in (128, 256)
               for i in (1, 4)]
        return triton.autotune(cfg, key=["F", "H", "HAS_MASK"], reset_to_zero=["y_ptr"])(_masked_down_kernel)
    cfg = [C({"BLOCK_N": n, "BLOCK_K": k}, num_warps=4) for n in (8, 16, 32) for k in (256, 512)]
    kernel = _compact_gate_up_kernel if name == "compact" else _int2_gemv_kernel
    return triton.autotune(cfg, key=["N", "K", "GROUP"])(kernel)


def _launch(name: str, kernel, grid, autotune: bool, *args, **kw) -> None:
    if autotune:
        if not args[0].is_cuda or type(kernel).__name__ == "InterpretedFunction":
            raise ValueError("autotune=True needs CUDA tensors and TRITON_INTERPRET unset; use the fixed config.")
        _tuned(name)[grid](*args, **kw)
    else:
        kernel[grid](*args, **kw, **(_CUDA if args[0].is_cuda else _FIXED)[name])


def _rows(w: Tensor) -> Tensor:
    """w itself when its rows are unit-stride (any row stride: a strided view such as rows[:, 0] of FloE's (n, 2, H)
    buffer is read in place), else a contiguous copy."""
    return w if w.stride(-1) == 1 else w.contiguous()


def _check(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


# ----------------------------------------------------------------------------------------------- entry points


def masked_gate_up(x: Tensor, w_gate: Tensor, a_up: Tensor, mask: Tensor, *, autotune: bool = False) -> Tensor:
    """FloE Alg. 1 gate step: h_j = SiLU(W_gate[j]·x) · a_up_j if mask_j else 0. x (H,), w_gate (F, H) -> (F,) fp32."""
    _check(x.dim() == 1 and w_gate.dim() == 2 and w_gate.shape[1] == x.shape[0] and a_up.shape == mask.shape
           == w_gate.shape[:1] and mask.dtype == torch.bool,
           f"masked_gate_up needs x (H,), w_gate (F, H), a_up (F,) and a bool mask (F,); got {tuple(x.shape)}, "
           f"{tuple(w_gate.shape)}, {tuple(a_up.shape)}, {tuple(mask.shape)} {mask.dtype}.")
    n_ff, n_h = w_gate.shape
    x, w_gate, a_up, m = x.contiguous(), _rows(w_gate), a_up.contiguous(), mask.contiguous().view(torch.uint8)
    h = torch.empty(n_ff, dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(n_ff, meta["BLOCK_F"]),)
    _launch("gate_up", _masked_gate_up_kernel, grid, autotune, x, w_gate, a_up, m, h, n_ff, w_gate.stride(0), n_h)
    return h


def masked_down(h: Tensor, w_down_t: Tensor, mask: Tensor | None, *, autotune: bool = False) -> Tensor:
    """FloE Alg. 1 down step: y = Σ_{j: mask_j} h_j · W_downᵀ[j]. h (F,), w_down_t (F, H), mask (F,) or None (every
    row: FloE's transferred rows) -> (H,) fp32."""
    every = mask is None
    mask = torch.empty(h.shape, dtype=torch.bool, device=h.device) if every else mask  # a dummy pointer if every
    _check(h.dim() == 1 and w_down_t.dim() == 2 and h.shape == mask.shape == w_down_t.shape[:1]
           and mask.dtype == torch.bool,
           f"masked_down needs h (F,), w_down_t (F, H) and a bool mask (F,); got {tuple(h.shape)}, "
           f"{tuple(w_down_t.shape)}, {tuple(mask.shape)} {mask.dtype}.")
    n_ff, n_h = w_down_t.shape
    h, w_down_t, m = h.contiguous(), _rows(w_down_t), mask.contiguous().view(torch.uint8)
    y = torch.zeros(n_h, dtype=torch.float32, device=h.device)  # atomic_add target
    grid = lambda meta: (triton.cdiv(n_ff, meta["BLOCK_F"] * meta["ITERS_F"]), triton.cdiv(n_h, meta["BLOCK_H"]))
    _launch("down", _masked_down_kernel, grid, autotune, h, w_down_t, m, y, n_ff, n_h, w_down_t.stride(0), not every)
    return y


def int2_gemv(x: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int, *,
              rows: Tensor | None = None, autotune: bool = False) -> Tensor:
    """a_up = W_up x with W_up INT2 (the packing of `pack_int2` / `lab.compress.quant.pack`, scale/zero (N, ceil(K/gs))
    in fp16 or fp32, read in place) -> (N,) fp32; with `rows` (n,) integer, only those rows of W_up -> (n,)."""
    n = packed.shape[0] if packed.dim() == 2 else -1
    g = math.ceil(k / group_size) if group_size >= 1 else -1
    _check(k >= 1 and x.shape == (k,) and packed.dtype == torch.uint8 and packed.shape == (n, math.ceil(k / 4))
           and scale.shape == zero.shape == (n, g) and scale.dtype == zero.dtype and scale.is_floating_point()
           and (rows is None or (rows.dim() == 1 and not rows.is_floating_point())),
           f"int2_gemv needs x ({k},), uint8 packed (N, {math.ceil(k / 4)}), float scale/zero (N, ceil(K/group_size)) "
           f"of one dtype with group_size ≥ 1, and integer rows (n,) if any; got {tuple(x.shape)}, "
           f"{tuple(packed.shape)} {packed.dtype}, {tuple(scale.shape)} {scale.dtype}, {tuple(zero.shape)}, "
           f"group_size={group_size}.")
    x, packed, scale, zero = x.contiguous(), _rows(packed), _rows(scale), _rows(zero)
    if scale.stride(0) != zero.stride(0):
        scale, zero = scale.contiguous(), zero.contiguous()
    n_out = n if rows is None else rows.numel()
    idx = rows.contiguous() if rows is not None else packed  # a dummy pointer when every row is computed
    y = torch.empty(n_out, dtype=torch.float32, device=x.device)
    if n_out:
        grid = lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]),)
        _launch("int2", _int2_gemv_kernel, grid, autotune, x, packed, scale, zero, y, idx, n_out, packed.stride(0),
                scale.stride(0), k, group_size, rows is not None)
    return y


def sparse_expert(x: Tensor, rows: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, idx: Tensor,
                  group_size: int, *, autotune: bool = False) -> Tensor:
    """FloE's expert on its transferred neurons (Alg. 1 on the compact rows) in two launches: h = SiLU(W_gate[idx] x)
    ⊙ W_up[idx] x, the up projection on the kept rows of the resident INT2 W_up and the gate step in one pass over x
    (`_compact_gate_up_kernel`), then y = Σ_j h_j W_downᵀ[idx_j] (`masked_down`, no mask); rows (n, 2, H) = [gate
    row, down column] read in place (strided). x (H,) -> (H,) in x's dtype."""
    k, n = x.shape[-1], rows.shape[0] if rows.dim() == 3 else -1
    _check(x.dim() == 1 and rows.dim() == 3 and rows.shape[1] == 2 and rows.shape[2] == k and idx.shape == (n,)
           and not idx.is_floating_point() and packed.dtype == torch.uint8 and packed.shape[1:] == (math.ceil(k / 4),)
           and scale.shape == zero.shape == (packed.shape[0], math.ceil(k / max(1, group_size))) and group_size >= 1,
           f"sparse_expert needs x (H,), rows (n, 2, H), integer idx (n,), uint8 packed (F, ceil(H/4)) and scale/zero "
           f"(F, ceil(H/group_size)); got {tuple(x.shape)}, {tuple(rows.shape)}, {tuple(idx.shape)}, "
           f"{tuple(packed.shape)} {packed.dtype}, {tuple(scale.shape)}, {tuple(zero.shape)}, group_size={group_size}.")
    x, gate, packed, idx = x.contiguous(), _rows(rows[:, 0]), _rows(packed), idx.contiguous()
    scale, zero = (scale, zero) if scale.stride() == zero.stride() and scale.stride(-1) == 1 else (
        scale.contiguous(), zero.contiguous())
    h = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)
        _launch("compact", _compact_gate_up_kernel, grid, autotune, x, gate, packed, scale, zero, idx, h, n,
                gate.stride(0), packed.stride(0), scale.stride(0), k, group_size)
    return masked_down(h, rows[:, 1], None, autotune=autotune).to(x.dtype)


def sparse_expert_ref(x: Tensor, rows: Tensor, packed: Tensor, scale: Tensor, zero: Tensor, idx: Tensor,
                      group_size: int) -> Tensor:
    """Torch reference of `sparse_expert` (FP32)."""
    k = x.shape[-1]
    a_up = int2_gemv_ref(x, packed[idx], scale[idx], zero[idx], group_size, k)
    h = F.silu(rows[:, 0].float() @ x.float()) * a_up
    return (h @ rows[:, 1].float()).to(x.dtype)


def gather_rows(w_gate: Tensor, w_down_t: Tensor, idx: Tensor) -> Tensor:
    """FloE's compact transfer layout (Sec. 3.4): staging (len(idx), 2, H) with gate row j and down row j adjacent.

    idx (n,) integer neuron indices, each in [0, F) (not checked: that would synchronise with the GPU)."""
    _check(w_gate.dim() == 2 and w_gate.shape == w_down_t.shape and w_gate.dtype == w_down_t.dtype
           and idx.dim() == 1 and not idx.is_floating_point(),
           f"gather_rows needs w_gate and w_down_t of one shape (F, H) and dtype, and integer idx (n,); got "
           f"{tuple(w_gate.shape)} {w_gate.dtype}, {tuple(w_down_t.shape)} {w_down_t.dtype}, {tuple(idx.shape)}.")
    w_gate, w_down_t, idx = w_gate.contiguous(), w_down_t.contiguous(), idx.contiguous()
    n_h = w_gate.shape[1]
    out = torch.empty(idx.numel(), 2, n_h, dtype=w_gate.dtype, device=w_gate.device)
    if idx.numel():
        grid = (idx.numel(), triton.cdiv(n_h, 64))
        _gather_rows_kernel[grid](w_gate, w_down_t, idx, out, n_h, w_gate.stride(0), w_down_t.stride(0), BLOCK_H=64)
    return out
