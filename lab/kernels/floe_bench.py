"""GPU timings of FloE's kernels (`lab.kernels.floe`) at Mixtral's expert shape, with the same work on both sides: the
dense FP16 torch expert against the sparse kernels (up projection and mask included), the engine's compact-rows
expert, and the INT2 GEMV against a dense FP16 GEMV. CUDA only (CUDA events)."""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

from lab.kernels.floe import int2_gemv, int2_gemv_ref, masked_down, masked_gate_up, pack_int2, sparse_expert
from lab.kernels.int2 import int2_expert


def _ms(fn, warmup: int = 10, reps: int = 50) -> float:
    """Median milliseconds of `fn()` over `reps` CUDA-event-timed runs after `warmup` runs, the L2 cache flushed before
    each (as `triton.testing.do_bench` does): an INT2 W_up (~18 MB at Mixtral's shape) would otherwise stay in an
    H100/H200's 50 MB L2 between runs while the dense FP16 one (117 MB) cannot, flattering the INT2 side."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_()
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _dequant_expert(x, mats, group_size: int):
    from lab.moe.offload_store import dequant

    Wg, Wu, Wd_t = (dequant(q, s, z, group_size, x.shape[-1], x.dtype) for q, s, z in mats)
    return (F.silu(Wg @ x) * (Wu @ x)) @ Wd_t


def bench(n_hidden: int = 4096, n_ff: int = 14336, keep: tuple[float, ...] = (0.5, 0.3, 0.1), device: str = "cuda",
          dtype: torch.dtype = torch.float16, group_size: int = 64, autotune: bool = True) -> dict:
    """Kernel timings at Mixtral's expert shape with the same work on both sides (median ms, CUDA events).

    - `dense_ms`: the dense FP16 torch expert, W_down(SiLU(W_gate x) ⊙ W_up x);
    - `sparse[keep]`: the FloE expert from the same full x (Alg. 1): a_up = W_up x with the INT2 `int2_gemv`, the
      mask |a_up| ≥ t, then `masked_gate_up` and `masked_down` — the up projection and the mask included, as in the
      dense expert; `speedup` = dense / sparse. t is calibrated once, before timing, as FloE's thresholds are
      (offline, Eq. 6): the (1 − keep)-quantile of this x's |a_up| (until 2026-12-05 a `kthvalue` per call was timed
      too, work FloE never does at decode);
    - `compact[keep]`: what the engine runs per expert once its rows have arrived: `sparse_expert` on the keep·F
      transferred rows (a_up on the kept INT2 rows only, strided (n, 2, H) buffer), tuned; `compact_fixed[keep]`
      the same at the fixed tiles CUDA tensors get (`lab.kernels.floe._CUDA`), what the engine launches;
    - `int2_ms` vs `up_dense_ms`: the INT2 GEMV against a dense FP16 GEMV of the same W_up (`int2_speedup`);
      `int2_ref_ms` the torch dequantize-then-matmul reference, for information;
    - `int2_expert_ms` vs `int2_expert_dequant_ms`: a whole INT2 expert from its codes (`lab.kernels.int2`) vs
      dequantized whole first, the torch path (the baselines' INT2 experts; W_up's codes stand in for all three)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    r = lambda *s: (torch.randn(*s, generator=gen) / math.sqrt(s[-1])).to(device, dtype)
    x, Wg, Wu, Wd = r(n_hidden), r(n_ff, n_hidden), r(n_ff, n_hidden), r(n_hidden, n_ff)  # transformers' layout
    Wd_t = Wd.T.contiguous()
    ng = math.ceil(n_hidden / group_size)
    q = torch.randint(0, 4, (n_ff, n_hidden), generator=gen).to(device)
    packed = pack_int2(q)
    scale = (torch.rand(n_ff, ng, generator=gen) * 0.02).to(device, torch.float16)
    zero = torch.full((n_ff, ng), 1.5, device=device, dtype=torch.float16)
    dense = lambda: F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)
    out = {"dense_ms": _ms(dense), "sparse": {}, "compact": {}, "compact_fixed": {}}
    a_abs = int2_gemv(x, packed, scale, zero, group_size, n_hidden).abs()
    for frac in keep:
        t = a_abs.kthvalue(max(1, round((1 - frac) * n_ff))).values  # calibrated before timing (Eq. 6)

        def sparse(t=t):
            a_up = int2_gemv(x, packed, scale, zero, group_size, n_hidden, autotune=autotune)
            mask = a_up.abs() >= t
            return masked_down(masked_gate_up(x, Wg, a_up, mask, autotune=autotune), Wd_t, mask, autotune=autotune)

        ms = _ms(sparse)
        out["sparse"][frac] = {"ms": ms, "speedup": out["dense_ms"] / ms}
        n = max(1, round(frac * n_ff))
        idx = torch.randperm(n_ff, generator=gen)[:n].sort().values.to(device)
        rows = torch.stack([Wg[idx], Wd_t[idx]], 1)
        ms = _ms(lambda rows=rows, idx=idx: sparse_expert(x, rows, packed, scale, zero, idx, group_size,
                                                          autotune=autotune))
        out["compact"][frac] = {"ms": ms, "speedup": out["dense_ms"] / ms}
        ms = _ms(lambda rows=rows, idx=idx: sparse_expert(x, rows, packed, scale, zero, idx, group_size))
        out["compact_fixed"][frac] = {"ms": ms, "speedup": out["dense_ms"] / ms}
    out["up_dense_ms"] = _ms(lambda: F.linear(x, Wu))
    out["int2_ref_ms"] = _ms(lambda: int2_gemv_ref(x, packed, scale, zero, group_size, n_hidden))
    out["int2_ms"] = _ms(lambda: int2_gemv(x, packed, scale, zero, group_size, n_hidden, autotune=autotune))
    out["int2_speedup"] = out["up_dense_ms"] / out["int2_ms"]
    # a whole HQQ INT2 expert (the INT2 and Mixtral-offloading policies): from its codes vs dequantized whole (the
    # engine's torch path: FP32 temporaries of each matrix) then the dense expert
    mats = ((packed, scale, zero),) * 3
    out["int2_expert_ms"] = _ms(lambda: int2_expert(x, mats, group_size, autotune=autotune))
    out["int2_expert_dequant_ms"] = _ms(lambda: _dequant_expert(x, mats, group_size))
    if autotune:  # the config each tuned kernel picked for the last shape it ran (`triton.autotune.best_config`)
        from lab.kernels.floe import _tuned
        from lab.kernels.int2 import _tuned as _tuned_down

        out["configs"] = {name: str(_tuned(name).best_config) for name in ("gate_up", "down", "int2", "compact")}
        out["configs"]["int2_down"] = str(_tuned_down().best_config)
    return out
