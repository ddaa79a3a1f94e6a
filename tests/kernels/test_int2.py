"""Whole INT2 experts in Triton (`lab.kernels.int2`) against dequantize-then-matmul, on CPU through the interpreter
(ragged sizes, every way scale and zero are applied), and compiled without a GPU (`test_floe.py` compiles every
launch)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from lab.kernels import floe as kf
from lab.kernels import int2 as ki

TOL = {"rtol": 1e-5, "atol": 1e-5}


def weight(n, k, group_size, seed=0):
    """Random codes, packed, and scale/zero (n, ceil(k / group_size)); W the dequantized matrix."""
    g = torch.Generator().manual_seed(seed)
    G = math.ceil(k / group_size)
    q = torch.randint(0, 4, (n, k), generator=g)
    s, z = torch.rand(n, G, generator=g) * 0.1 + 0.01, torch.rand(n, G, generator=g) * 3
    idx = torch.arange(k) // group_size
    return kf.pack_int2(q), s, z, (q.float() - z[:, idx]) * s[:, idx]


def test_a_hand_computed_case():
    """N = 2 rows, K = 5 (a ragged last byte), one group: y = hᵀ W, W = (q − z) s."""
    q = torch.tensor([[0, 1, 2, 3, 1], [3, 3, 0, 0, 2]])
    s, z = torch.tensor([[0.5], [2.0]]), torch.tensor([[1.0], [0.0]])
    h = torch.tensor([2.0, -1.0])
    W = torch.tensor([[-0.5, 0.0, 0.5, 1.0, 0.0], [6.0, 6.0, 0.0, 0.0, 4.0]])
    assert torch.equal(h @ W, torch.tensor([-7.0, -6.0, 1.0, 2.0, -4.0]))
    torch.testing.assert_close(ki.int2_down(h, kf.pack_int2(q), s, z, 8, 5), h @ W, **TOL)


@pytest.mark.parametrize("group_size,k,n,cfg", [
    (16, 70, 37, None), (64, 70, 37, None), (64, 256, 40, (16, 128, 1)), (128, 300, 37, None),
    (24, 70, 37, None), (6, 70, 37, None), (2, 70, 37, None), (16, 301, 50, (8, 128, 3))])
def test_int2_down_every_group_path(monkeypatch, group_size, k, n, cfg):
    """Whole groups in a chunk, a chunk inside one group, per weight (a group that neither divides nor is divided by
    the chunk, or splits a byte), ragged K and N, several row blocks per program: y = hᵀ W."""
    if cfg:
        monkeypatch.setattr(ki, "_FIXED", dict(zip(("BLOCK_N", "BLOCK_K", "ITERS_N"), cfg)))
    packed, s, z, W = weight(n, k, group_size, seed=group_size)
    h = torch.randn(n, generator=torch.Generator().manual_seed(1))
    y = ki.int2_down(h, packed, s, z, group_size, k)
    assert y.dtype == torch.float32 and y.shape == (k,)
    torch.testing.assert_close(y, h @ W, **TOL)
    torch.testing.assert_close(ki.int2_down_ref(h, packed, s, z, group_size, k), h @ W, **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int2_expert_is_the_dequantized_dense_expert(dtype):
    """(SiLU(W_gate x) ⊙ W_up x) W_down from the codes, with fp16 scale/zero, returned in x's dtype."""
    H, FF, gs = 70, 131, 16
    mats, dense = [], []
    for m in range(3):
        packed, s, z, W = weight(FF, H, gs, seed=10 + m)
        mats.append((packed, s.half(), z.half()))
        idx = torch.arange(H) // gs
        dense.append((kf.unpack_int2(packed, H).float() - z.half().float()[:, idx]) * s.half().float()[:, idx])
    x = torch.randn(H, generator=torch.Generator().manual_seed(2)).to(dtype)
    ref = (F.silu(dense[0] @ x.float()) * (dense[1] @ x.float())) @ dense[2]
    y = ki.int2_expert(x, mats, gs)
    assert y.dtype == dtype and y.shape == (H,)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    torch.testing.assert_close(y.float(), ref.to(dtype).float(), **tol)


def test_int2_expert_indexes_each_matrix_once_in_turn():
    """`int2_expert` takes each matrix's (codes, scale, zero) when it needs it, gate, up, down, once each: a sequence
    that decodes meta when indexed (Mixtral-offloading's, `offload_store._MoParts`) holds one matrix's at a time."""
    H, FF, gs = 20, 9, 4
    mats = [weight(FF, H, gs, seed=m)[:3] for m in range(3)]
    seen = []

    class Recording:
        def __getitem__(self, m):
            seen.append(m)
            return mats[m]

    ki.int2_expert(torch.randn(H), Recording(), gs)
    assert seen == [0, 1, 2]


def test_bad_shapes_raise():
    packed, s, z, _ = weight(9, 20, 4)
    with pytest.raises(ValueError, match="int2_down needs"):
        ki.int2_down(torch.ones(8), packed, s, z, 4, 20)
    with pytest.raises(ValueError, match="int2_down needs"):
        ki.int2_down(torch.ones(9), packed, s[:, :2], z, 4, 20)
    with pytest.raises(ValueError, match="autotune=True needs CUDA"):
        ki.int2_down(torch.ones(9), packed, s, z, 4, 20, autotune=True)


GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA with TRITON_INTERPRET unset (make test-gpu)")
@pytest.mark.parametrize("autotune", [False, True])
@pytest.mark.parametrize("group_size", [16, 64])
def test_int2_down_at_mixtral_size(autotune, group_size):
    """W_downᵀ (F = 14336, H = 4096) with HQQ INT2's group 64 and Mixtral-offloading's 16, fp16 meta in both (theirs
    decoded from 8-bit codes to fp16, `offload_store._MoParts`)."""
    packed, s, z, _ = weight(14336, 4096, group_size, seed=3)
    packed, s, z = packed.cuda(), s.to("cuda", torch.float16), z.to("cuda", torch.float16)
    h = torch.randn(14336, generator=torch.Generator().manual_seed(4)).cuda() / 100
    y = ki.int2_down(h, packed, s, z, group_size, 4096, autotune=autotune)
    torch.testing.assert_close(y, ki.int2_down_ref(h, packed, s, z, group_size, 4096), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("k", [512, 300])
@pytest.mark.parametrize("group_size", [64, 16])
def test_the_tiles_cuda_tensors_get_compute_the_same(monkeypatch, k, group_size):
    """The wide tiles CUDA tensors launch (`_CUDA`; no GPU here, so run under the interpreter in place of the CPU
    tiles), with K a whole number of chunks (no column mask: the path Mixtral's K = 4096 takes) and ragged: FloE's
    expert on its transferred rows, the masked kernels, the INT2 GEMV and a whole INT2 expert, against their torch
    references."""
    for name, cfg in kf._CUDA.items():
        monkeypatch.setitem(kf._FIXED, name, cfg)
    monkeypatch.setattr(ki, "_FIXED", ki._CUDA)
    n_ff, n = 200, 37
    mats = [weight(n_ff, k, group_size, seed=20 + m) for m in range(3)]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(k, generator=g)
    rows = torch.randn(n, 2, k, generator=g) / math.sqrt(k)
    idx = torch.randperm(n_ff, generator=g)[:n]
    pk, s, z, Wu = mats[1]
    ref = (F.silu(rows[:, 0] @ x) * (Wu[idx] @ x)) @ rows[:, 1]
    torch.testing.assert_close(kf.sparse_expert(x, rows, pk, s, z, idx, group_size), ref, rtol=1e-4, atol=1e-4)
    mask = torch.rand(n_ff, generator=g) < 0.3
    Wg, Wd_t = mats[0][3], mats[2][3]
    h = kf.masked_gate_up(x, Wg, Wu @ x, mask)
    torch.testing.assert_close(h, kf.masked_gate_up_ref(x, Wg, Wu @ x, mask), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kf.masked_down(h, Wd_t, mask), kf.masked_down_ref(h, Wd_t, mask), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kf.int2_gemv(x, pk, s, z, group_size, k), Wu @ x, rtol=1e-4, atol=1e-4)
    dense = (F.silu(mats[0][3] @ x) * (Wu @ x)) @ mats[2][3]
    got = ki.int2_expert(x, [m[:3] for m in mats], group_size)
    torch.testing.assert_close(got, dense, rtol=1e-4, atol=1e-4)
