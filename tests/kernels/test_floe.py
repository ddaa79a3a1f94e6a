"""FloE's Triton kernels against their torch references: on CPU through the interpreter (small, ragged sizes),
and on CUDA at Mixtral size (`@pytest.mark.gpu`, run by `make test-gpu`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lab.kernels import floe as kf

H, FF, K = 70, 131, 70  # ragged: no size is a multiple of any block
TOL = {"rtol": 1e-5, "atol": 1e-5}


def rand(*shape, seed=0, dtype=torch.float32, device="cpu"):
    """N(0, 1) vectors; matrices scaled by 1/sqrt(fan-in) so that every activation is O(1)."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return (t / math.sqrt(shape[-1]) if len(shape) == 2 else t).to(device, dtype)


def masks(n):
    """Edge cases and a random one, each (F,) bool."""
    none, every, first, last, one = (torch.zeros(n, dtype=torch.bool) for _ in range(5))
    every[:], first[0], last[-1], one[n // 2 + 3] = True, True, True, True
    rnd = torch.rand(n, generator=torch.Generator().manual_seed(7)) < 0.3
    return {"none": none, "all": every, "first": first, "last": last, "single": one, "random": rnd}


MASKS = masks(FF)


@pytest.fixture(scope="module")
def expert():
    """x (H,), W_gate (F, H), W_up (F, H), W_down (H, F) in transformers' layout."""
    return rand(H, seed=1), rand(FF, H, seed=2), rand(FF, H, seed=3), rand(H, FF, seed=4)


def dense_expert(x, Wg, Wu, Wd):
    return (F.silu(x @ Wg.T) * (x @ Wu.T)) @ Wd.T


@pytest.mark.parametrize("name", list(MASKS))
def test_masked_gate_up(expert, name):
    x, Wg, Wu, _ = expert
    mask, a_up = MASKS[name], Wu @ x
    h = kf.masked_gate_up(x, Wg, a_up, mask)
    assert h.dtype == torch.float32 and h.shape == (FF,)
    torch.testing.assert_close(h, kf.masked_gate_up_ref(x, Wg, a_up, mask), **TOL)
    assert (h[~mask] == 0).all()
    if name == "none":
        assert (h == 0).all()


@pytest.mark.parametrize("name", list(MASKS))
def test_masked_down(expert, name):
    _, _, _, Wd = expert
    mask, h = MASKS[name], rand(FF, seed=5)
    y = kf.masked_down(h, Wd.T.contiguous(), mask)
    assert y.dtype == torch.float32 and y.shape == (H,)
    torch.testing.assert_close(y, kf.masked_down_ref(h, Wd.T, mask), **TOL)
    if name == "none":
        assert (y == 0).all()
    if name == "single":
        j = int(mask.nonzero())
        torch.testing.assert_close(y, h[j] * Wd[:, j], **TOL)


@pytest.mark.parametrize("block_f,iters", [(16, 1), (16, 3), (64, 4)])
def test_masked_down_sums_several_row_blocks_per_program(monkeypatch, expert, block_f, iters):
    """A program sums ITERS_F row blocks before its one atomic add (the last group ragged, or a single program
    covering all F rows): the same y as the torch reference."""
    monkeypatch.setitem(kf._FIXED, "down", {"BLOCK_F": block_f, "BLOCK_H": 32, "ITERS_F": iters})
    _, _, _, Wd = expert
    mask, h = MASKS["random"], rand(FF, seed=5)
    torch.testing.assert_close(kf.masked_down(h, Wd.T.contiguous(), mask), kf.masked_down_ref(h, Wd.T, mask), **TOL)


def test_full_mask_is_the_dense_expert(expert):
    x, Wg, Wu, Wd = expert
    every = MASKS["all"]
    y = kf.masked_down(kf.masked_gate_up(x, Wg, Wu @ x, every), Wd.T.contiguous(), every)
    torch.testing.assert_close(y, dense_expert(x, Wg, Wu, Wd), **TOL)


def test_sparse_expert_equals_zeroed_neurons(expert):
    """Keeping neurons with |a_up| ≥ t equals the dense expert with the other W_up rows zeroed."""
    x, Wg, Wu, Wd = expert
    a_up = Wu @ x
    mask = a_up.abs() >= a_up.abs().quantile(0.7)
    y = kf.masked_down(kf.masked_gate_up(x, Wg, a_up, mask), Wd.T.contiguous(), mask)
    torch.testing.assert_close(y, dense_expert(x, Wg, Wu * mask[:, None], Wd), **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_accumulate_in_fp32(expert, dtype):
    x, Wg, Wu, Wd = (t.to(dtype) for t in expert)
    mask, a_up = MASKS["random"], (Wu.float() @ x.float())
    h = kf.masked_gate_up(x, Wg, a_up, mask)
    torch.testing.assert_close(h, kf.masked_gate_up_ref(x, Wg, a_up, mask), **TOL)
    Wd_t = Wd.T.contiguous()
    torch.testing.assert_close(kf.masked_down(h.to(dtype), Wd_t, mask), kf.masked_down_ref(h.to(dtype), Wd_t, mask),
                               **TOL)


@pytest.mark.parametrize("k", [1, 3, 4, 5, 70, 96])
def test_pack_unpack_round_trip(k):
    q = torch.randint(0, 4, (9, k), generator=torch.Generator().manual_seed(k))
    packed = kf.pack_int2(q)
    assert packed.dtype == torch.uint8 and packed.shape == (9, math.ceil(k / 4))
    assert torch.equal(kf.unpack_int2(packed, k), q.to(torch.uint8))


def test_pack_layout():
    q = torch.tensor([[1, 2, 3, 0, 3]])
    assert kf.pack_int2(q).tolist() == [[1 | 2 << 2 | 3 << 4, 3]]


def int2_weight(n, k, group_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    ng = math.ceil(k / group_size)
    q = torch.randint(0, 4, (n, k), generator=g)
    return q, kf.pack_int2(q), torch.rand(n, ng, generator=g) * 0.1 + 0.01, torch.rand(n, ng, generator=g) * 3


@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_int2_gemv(group_size):
    q, packed, scale, zero = int2_weight(FF, K, group_size)
    x = rand(K, seed=9)
    idx = torch.arange(K) // group_size
    W = (q.float() - zero[:, idx]) * scale[:, idx]  # dequantize, then matmul
    y = kf.int2_gemv(x, packed, scale, zero, group_size, K)
    assert y.dtype == torch.float32 and y.shape == (FF,)
    torch.testing.assert_close(y, W @ x, **TOL)
    torch.testing.assert_close(kf.int2_gemv_ref(x, packed, scale, zero, group_size, K), W @ x, **TOL)


@pytest.mark.parametrize("group_size,k,block_k", [(64, 70, 128), (128, 300, 64), (24, 70, 64), (6, 70, 64),
                                                   (2, 70, 64), (16, 301, 128)])
def test_int2_gemv_every_group_path(monkeypatch, group_size, k, block_k):
    """Each way the kernel applies scale and zero — whole groups in a chunk, a chunk inside one group, per weight
    (a group that neither divides nor is divided by the chunk, or splits a packed byte) — at ragged K, against
    dequantize-then-matmul; on all rows and on kept rows."""
    monkeypatch.setitem(kf._FIXED, "int2", {"BLOCK_N": 16, "BLOCK_K": block_k})
    q, packed, scale, zero = int2_weight(37, k, group_size, seed=group_size)
    x = rand(k, seed=10)
    idx = torch.arange(k) // group_size
    W = (q.float() - zero[:, idx]) * scale[:, idx]
    torch.testing.assert_close(kf.int2_gemv(x, packed, scale, zero, group_size, k), W @ x, **TOL)
    rows = torch.tensor([36, 0, 5, 17])
    torch.testing.assert_close(kf.int2_gemv(x, packed, scale, zero, group_size, k, rows=rows), W[rows] @ x, **TOL)


def test_int2_gemv_reads_the_lab_quantizer_format():
    from lab.compress.quant import quantize

    W, x = rand(37, K, seed=11), rand(K, seed=12)
    qt = quantize(W, nbits=2, group_size=32, method="rtn")
    torch.testing.assert_close(kf.int2_gemv(x, qt.packed, qt.scale, qt.zero, 32, K), qt.dequantize() @ x, **TOL)


def test_gather_rows(expert):
    _, Wg, _, Wd = expert
    Wd_t = Wd.T.contiguous()
    for idx in (torch.tensor([5, 0, FF - 1, 7]), MASKS["random"].nonzero().squeeze(1), torch.arange(0)):
        out = kf.gather_rows(Wg, Wd_t, idx)
        assert out.shape == (len(idx), 2, H)
        assert torch.equal(out, kf.gather_rows_ref(Wg, Wd_t, idx))
        if len(idx):
            assert torch.equal(out[0, 0], Wg[idx[0]]) and torch.equal(out[0, 1], Wd[:, idx[0]])


def packed(n, k):
    return kf.pack_int2(torch.zeros(n, k, dtype=torch.long))


BAD = {
    "gate_up x length": lambda x, Wg, a, m, Wd: kf.masked_gate_up(x[:-1], Wg, a, m),
    "gate_up a_up length": lambda x, Wg, a, m, Wd: kf.masked_gate_up(x, Wg, a[:-1], m),
    "gate_up float mask": lambda x, Wg, a, m, Wd: kf.masked_gate_up(x, Wg, a, m.float()),
    "gate_up 1-D weight": lambda x, Wg, a, m, Wd: kf.masked_gate_up(x, Wg[0], a, m),
    "down untransposed": lambda x, Wg, a, m, Wd: kf.masked_down(a, Wd, m),
    "down h length": lambda x, Wg, a, m, Wd: kf.masked_down(a[:-1], Wd.T, m),
    "int2 packed width": lambda x, *_: kf.int2_gemv(x, packed(4, K + 8), torch.ones(4, 3), torch.ones(4, 3), 32, K),
    "int2 groups": lambda x, *_: kf.int2_gemv(x, packed(4, K), torch.ones(4, 2), torch.ones(4, 2), 32, K),
    "int2 scale/zero": lambda x, *_: kf.int2_gemv(x, packed(4, K), torch.ones(4, 3), torch.ones(5, 3), 32, K),
    "int2 dtype": lambda x, *_: kf.int2_gemv(x, packed(4, K).int(), torch.ones(4, 3), torch.ones(4, 3), 32, K),
    "int2 group_size 0": lambda x, *_: kf.int2_gemv(x, packed(4, K), torch.ones(4, 3), torch.ones(4, 3), 0, K),
    "gather shapes": lambda x, Wg, a, m, Wd: kf.gather_rows(Wg, Wd, torch.tensor([0])),
    "gather float idx": lambda x, Wg, a, m, Wd: kf.gather_rows(Wg, Wd.T, torch.tensor([0.0])),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_shapes_raise(expert, case):
    x, Wg, Wu, Wd = expert
    with pytest.raises(ValueError, match="needs"):
        BAD[case](x, Wg, Wu @ x, MASKS["random"], Wd)


def test_autotune_is_lazy_and_gpu_only(expert):
    import triton

    assert not any(isinstance(v, triton.runtime.Autotuner) for v in vars(kf).values())
    x, Wg, Wu, _ = expert
    with pytest.raises(ValueError, match="CUDA"):
        kf.masked_gate_up(x, Wg, Wu @ x, MASKS["all"], autotune=True)


GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA with TRITON_INTERPRET unset (make test-gpu)")
class TestCuda:
    """The same checks at Mixtral-8x7B expert size (H=4096, F=14336) in fp16, then the benchmark."""

    Hm, Fm = 4096, 14336
    TOLG = {"rtol": 2e-3, "atol": 2e-3}

    @pytest.fixture(scope="class")
    def big(self):
        """x (H,), W_gate, W_up (F, H), W_down (H, F), fp16 on CUDA."""
        shapes = [(self.Hm,), (self.Fm, self.Hm), (self.Fm, self.Hm), (self.Hm, self.Fm)]
        return [rand(*s, seed=i, dtype=torch.float16, device="cuda") for i, s in enumerate(shapes, start=1)]

    @pytest.mark.parametrize("autotune", [False, True])
    def test_sparse_expert(self, big, autotune):
        x, Wg, Wu, Wd = big
        a_up = Wu.float() @ x.float()
        Wd_t = Wd.T.contiguous()
        for mask in (a_up.abs() >= a_up.abs().quantile(0.9), torch.ones_like(a_up, dtype=torch.bool),
                     torch.zeros_like(a_up, dtype=torch.bool)):
            h = kf.masked_gate_up(x, Wg, a_up, mask, autotune=autotune)
            torch.testing.assert_close(h, kf.masked_gate_up_ref(x, Wg, a_up, mask), **self.TOLG)
            y = kf.masked_down(h, Wd_t, mask, autotune=autotune)
            torch.testing.assert_close(y, kf.masked_down_ref(h, Wd_t, mask), **self.TOLG)
        dense = dense_expert(*(t.float() for t in big))
        every = torch.ones_like(a_up, dtype=torch.bool)
        y = kf.masked_down(kf.masked_gate_up(x, Wg, a_up, every, autotune=autotune), Wd_t, every, autotune=autotune)
        torch.testing.assert_close(y, dense, **self.TOLG)

    @pytest.mark.parametrize("autotune", [False, True])
    def test_int2_gemv(self, big, autotune):
        x = big[0]
        _, pk, scale, zero = (t.cuda() for t in int2_weight(self.Fm, self.Hm, 64))
        y = kf.int2_gemv(x, pk, scale, zero, 64, self.Hm, autotune=autotune)
        torch.testing.assert_close(y, kf.int2_gemv_ref(x, pk, scale, zero, 64, self.Hm), **self.TOLG)

    def test_gather_rows(self, big):
        _, Wg, _, Wd = big
        idx = torch.randperm(self.Fm, device="cuda")[: self.Fm // 10]
        Wd_t = Wd.T.contiguous()
        assert torch.equal(kf.gather_rows(Wg, Wd_t, idx), kf.gather_rows_ref(Wg, Wd_t, idx))

    @pytest.fixture(scope="class")
    def timings(self):
        from lab.kernels.floe_bench import bench

        r = bench()
        print(r)
        return r

    def test_bench(self, timings):
        r = timings
        assert all(v > 0 for v in (r["dense_ms"], r["int2_ms"], r["int2_ref_ms"], r["up_dense_ms"]))
        assert all(v["ms"] > 0 for k in ("sparse", "compact", "compact_fixed") for v in r[k].values())
        assert r["int2_ms"] < r["int2_ref_ms"]  # the fused GEMV beats dequantize-then-matmul

    @pytest.mark.xfail(reason="measured on an H200 (2026-12-04, torch 2.11, triton 3.6) with the kernels and bench "
                              "of then: FloE's kernels at keep 0.1 took 0.35 ms (a kthvalue per call timed with them) "
                              "against the dense FP16 torch expert's 0.11 ms, and the INT2 GEMV 0.17 ms against a "
                              "dense FP16 GEMV's 0.04 ms; kernels, tiles and bench reworked since, untimed (issue 16)",
                       strict=False)
    def test_sparse_kernels_beat_the_dense_expert(self, timings):
        """The paper's premise for its kernels: at keep 0.1 the sparse expert (up projection and mask included) is
        faster than the dense FP16 expert, as is the engine's expert on its transferred rows at the tiles it
        launches, and the INT2 GEMV than the FP16 one."""
        assert timings["sparse"][0.1]["ms"] < timings["dense_ms"]
        assert timings["compact_fixed"][0.1]["ms"] < timings["dense_ms"]
        assert timings["int2_ms"] < timings["up_dense_ms"]


# ------------------------------------------------------------------ the decode path: kept rows, strided, in-dtype


def test_int2_gemv_on_kept_rows_with_fp16_meta():
    q, pk, scale, zero = int2_weight(FF, K, 16, seed=3)
    x, idx = rand(K, seed=4), torch.tensor([0, 5, 7, FF - 1, 64])
    y = kf.int2_gemv(x, pk, scale.half(), zero.half(), 16, K, rows=idx)
    ref = kf.int2_gemv_ref(x, pk[idx], scale.half()[idx], zero.half()[idx], 16, K)
    assert y.shape == (5,) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, **TOL)
    assert kf.int2_gemv(x, pk, scale, zero, 16, K, rows=idx[:0]).shape == (0,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_expert_reads_the_compact_buffer_in_place(dtype):
    """FloE's double buffer (2, top_k, n, 2, H): slot (1, 0) is a strided view; the kernels read it in place and
    return the model's dtype, equal to the torch reference."""
    n = 9
    buf = rand(2, 2, n, 2, H, seed=5).to(dtype) / math.sqrt(H)
    rows = buf[1, 0]
    _, pk, scale, zero = int2_weight(FF, H, 16, seed=6)
    x, idx = rand(H, seed=7).to(dtype), torch.randperm(FF, generator=torch.Generator().manual_seed(8))[:n].sort().values
    y = kf.sparse_expert(x, rows, pk, scale.half(), zero.half(), idx, 16)
    ref = kf.sparse_expert_ref(x, rows, pk, scale.half(), zero.half(), idx, 16)
    assert y.dtype == dtype and y.shape == (H,)
    tol = TOL if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y.float(), ref.float(), **tol)


@pytest.mark.parametrize("group_size,k,block_k", [(16, 70, 64), (64, 70, 128), (128, 300, 64), (24, 70, 64),
                                                   (2, 70, 64), (16, 256, 64)])
def test_sparse_expert_fused_gate_up_every_group_path(monkeypatch, group_size, k, block_k):
    """The fused kernel (INT2 up on the kept rows and the gate step in one pass) through each way scale and zero are
    applied, at ragged and at whole-chunk K, on a strided buffer: equal to the reference (the up projection from
    dequantized rows, then SiLU(gate) ⊙ up, then down)."""
    monkeypatch.setitem(kf._FIXED, "compact", {"BLOCK_N": 4, "BLOCK_K": block_k})
    q, pk, scale, zero = int2_weight(37, k, group_size, seed=group_size)
    n = 11
    rows = rand(n, 3, k, seed=13)[:, 1:] / math.sqrt(k)  # (n, 2, k), row stride 3k
    x, idx = rand(k, seed=14), torch.randperm(37, generator=torch.Generator().manual_seed(15))[:n]
    g = torch.arange(k) // group_size
    Wu = (q.float() - zero[:, g]) * scale[:, g]
    ref = (F.silu(rows[:, 0] @ x) * (Wu[idx] @ x)) @ rows[:, 1]
    torch.testing.assert_close(kf.sparse_expert(x, rows, pk, scale, zero, idx, group_size), ref, **TOL)
    torch.testing.assert_close(kf.sparse_expert_ref(x, rows, pk, scale, zero, idx, group_size), ref, **TOL)


def test_sparse_expert_is_two_launches_and_masked_down_needs_no_mask(monkeypatch, expert):
    """FloE's decode path launches two kernels per expert (the fused gate·up, then the down kernel without a mask);
    `masked_down` with mask None sums every row, as with an all-true mask."""
    _, _, _, Wd = expert
    h = rand(FF, seed=5)
    torch.testing.assert_close(kf.masked_down(h, Wd.T, None), kf.masked_down(h, Wd.T, MASKS["all"]), **TOL)
    names, launch = [], kf._launch
    monkeypatch.setattr(kf, "_launch", lambda name, *a, **kw: (names.append(name), launch(name, *a, **kw)))
    _, pk, scale, zero = int2_weight(FF, H, 16, seed=6)
    kf.sparse_expert(rand(H, seed=7), rand(5, 2, H, seed=8), pk, scale, zero, torch.tensor([1, 4, 9, 30, 99]), 16)
    assert names == ["compact", "down"]


def test_cuda_tensors_get_the_cuda_tiles(monkeypatch):
    """CUDA tensors launch the wide `_CUDA` tiles (the engine's decode at Mixtral's shape), CPU ones the interpreter's
    `_FIXED` tiles."""
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **kw: seen.append(kw)

    class OnCuda:
        is_cuda = True

    for name in kf._FIXED:
        kf._launch(name, Kernel(), None, False, OnCuda())
        kf._launch(name, Kernel(), None, False, torch.zeros(1))
        assert seen[-2:] == [kf._CUDA[name], kf._FIXED[name]]
    assert all(kf._CUDA[n]["BLOCK_" + ("H" if n in ("gate_up", "down") else "K")] >= 256 for n in kf._CUDA)


@pytest.mark.parametrize("policy,kw", [("floe", {"keep": 0.25}), ("int2", {}), ("lru-int2", {"cache_k": 1}),
                                       ("mixtral", {"cache_k": 1})])
def test_engine_decodes_the_same_with_the_kernels(policy, kw):
    """The offload engine with the Triton kernels (interpreter) and with the torch reference, on the same model and
    tokens: the same logits, bytes and misses. FloE runs its sparse kernels; the INT2 policies and
    Mixtral-offloading compute their whole INT2 experts from the codes (`lab.kernels.int2`)."""
    from lab.models.zoo import tiny_mixtral
    from lab.moe.links import SimLink, TimeModel
    from lab.moe.offload import OffloadEngine

    torch.manual_seed(0)
    model = tiny_mixtral(vocab_size=40, d_model=32, n_layers=3, n_heads=4, d_ff=48, n_experts=4).eval()
    seq = torch.randint(40, (1, 3), generator=torch.Generator().manual_seed(3))
    out = {}
    for kernels in (False, True):
        eng = OffloadEngine(model, policy, SimLink(TimeModel()), group_size=16, kernels=kernels, **kw)
        out[kernels] = eng.run(seq)
    (ref, s_ref), (got, s_got) = out[False], out[True]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert s_got.bytes == s_ref.bytes and s_got.misses == s_ref.misses and s_got.seconds == s_ref.seconds


@pytest.mark.parametrize("policy,kw", [("floe", {"keep": 0.25}), ("mixtral", {"cache_k": 1})])
def test_engine_at_the_cuda_tiles(monkeypatch, policy, kw):
    """The engine's kernel path at the tiles CUDA tensors get (`_CUDA`, run here under the interpreter), with hidden
    size 256, one whole chunk (no column mask, as at Mixtral's 4096): the torch path's logits."""
    from lab.kernels import int2 as ki
    from lab.models.zoo import tiny_mixtral
    from lab.moe.links import SimLink, TimeModel
    from lab.moe.offload import OffloadEngine

    torch.manual_seed(0)
    model = tiny_mixtral(vocab_size=40, d_model=256, n_layers=2, n_heads=4, d_ff=96, n_experts=4).eval()
    seq = torch.randint(40, (1, 3), generator=torch.Generator().manual_seed(3))
    ref, _ = OffloadEngine(model, policy, SimLink(TimeModel()), kernels=False, **kw).run(seq)
    for name, cfg in kf._CUDA.items():
        monkeypatch.setitem(kf._FIXED, name, cfg)
    monkeypatch.setattr(ki, "_FIXED", ki._CUDA)
    got, _ = OffloadEngine(model, policy, SimLink(TimeModel()), kernels=True, **kw).run(seq)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------- compiled for NVIDIA GPUs, without a GPU


def _compile(args, code=None, interpret="0"):
    """`python -m lab.kernels.floe_compile ARGS` (or `python -c CODE`), interpreter off as a GPU launch has it."""
    env = {**os.environ, "TRITON_INTERPRET": interpret, "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-c", code] if code else [sys.executable, "-m", "lab.kernels.floe_compile", *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_kernels_compile_to_cubin_for_sm80_and_sm90(tmp_path):
    """Every launch the entry points make (fixed configs; 3 model dtypes; all rows and kept rows) lowers through
    Triton and ptxas to a cubin for A100 and H100/H200 (at the CPU and the CUDA tiles), without spilling registers;
    the masked down kernel's partial sums meet through global atomics. (`--autotune` compiles the 378 autotuner
    launches too: all compile, and none spills; measured 2026-12-04.)"""
    out = tmp_path / "cubin.json"
    p = _compile(["--target", "sm_80,sm_90", "--out", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    recs = json.loads(out.read_text())
    assert {(r["arch"], r["kernel"], r["dtype"]) for r in recs} == {
        (a, k, d) for a in ("sm_80", "sm_90") for k in ("gate_up", "down", "int2", "compact", "gather", "int2_down")
        for d in ("fp32", "fp16", "bf16")}
    from lab.kernels import floe as kf  # each kernel at the interpreter's tiles and at the ones CUDA tensors get
    assert {str({**kf._CUDA["compact"], "num_warps": 4}), str({**kf._FIXED["compact"], "num_warps": 4})} == {
        str(r["config"]) for r in recs if r["kernel"] == "compact"}
    assert all(r["ok"] and r["registers"] and r["spill_bytes"] == 0 for r in recs), recs
    assert all(r["atomics"] > 0 for r in recs if r["kernel"] in ("down", "int2_down"))
    assert all(r["atomics"] == 0 for r in recs if r["kernel"] not in ("down", "int2_down"))


def test_the_largest_int2_tile_does_not_spill():
    """The INT2 GEMV's largest autotuner tile (32 × 512, 4 warps: 128 weights per thread) on FloE's kept rows compiles
    for sm_90 without spilling: scale and zero are loaded once per group (a (32, 8) tile), not once per weight (with
    per-weight loads and their 64-bit addresses this launch spilled 24 kB per thread)."""
    code = ("import json; from lab.kernels import floe_compile as fc\n"
            "cfg = {'int2': [{'BLOCK_N': 32, 'BLOCK_K': 512, 'num_warps': 4}], 'gate_up': [], 'down': [],\n"
            "       'compact': []}\n"
            "print(json.dumps([r for r in fc.compile_all((90,), ('bf16',), cfgs=cfg) if r['kernel'] == 'int2']))")
    p = _compile([], code)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = json.loads(p.stdout.strip().splitlines()[-1])
    assert {r["rows"] for r in recs} == {"all", "kept", "g16"}  # FloE's; Mixtral-offloading's whole experts
    assert all(r["ok"] and r["spill_bytes"] == 0 for r in recs), recs


def test_int2_codes_load_as_vectors():
    """The INT2 GEMV reads each packed byte once, as contiguous bytes of a row: at its largest tile (32 × 512, 4 warps,
    Mixtral's K = 4096, all rows) a thread's code has a handful of global loads, vector loads among them (the kernel
    that loaded a byte once per code, with a column mask, had 133 loads here, 128 of them single bytes)."""
    code = ("import json; from lab.kernels import floe_compile as fc\n"
            "cfg = {'int2': [{'BLOCK_N': 32, 'BLOCK_K': 512, 'num_warps': 4}], 'gate_up': [], 'down': [],\n"
            "       'compact': []}\n"
            "print(json.dumps([r for r in fc.compile_all((90,), ('bf16',), cfgs=cfg) if r['kernel'] == 'int2']))")
    p = _compile([], code)
    assert p.returncode == 0, p.stderr[-2000:]
    r = next(r for r in json.loads(p.stdout.strip().splitlines()[-1]) if r["rows"] == "all")
    assert r["ok"] and r["vector_loads"] >= 2 and r["global_loads"] <= 16, r


def test_a_kernel_that_cannot_lower_is_reported_not_passed():
    """The check can fail: the down kernel with an int8 output (atomic_add has no int8 form) is recorded as an error,
    and the command exits 2 with one sentence on bad input (an unknown dtype, the interpreter on)."""
    code = ("import dataclasses, json; from lab.kernels import floe_compile as fc\n"
            "lc = next(l for l in fc.launches('bf16', fc.configs(False)) if l.kernel == 'down')\n"
            "bad = dataclasses.replace(lc, args={**lc.args, 'y_ptr': ('*i8', None)})\n"
            "print(json.dumps([fc.compile_one(l, 90) for l in (lc, bad)]))")
    p = _compile([], code)
    assert p.returncode == 0, p.stderr[-2000:]
    good, bad = json.loads(p.stdout.strip().splitlines()[-1])
    assert good["ok"] and not bad["ok"] and "int8" in bad["error"]
    p = _compile(["--dtypes", "fp8"])
    assert p.returncode == 2 and "unknown dtype" in p.stderr
    p = _compile([], interpret="1")
    assert p.returncode == 2 and "TRITON_INTERPRET" in p.stderr
