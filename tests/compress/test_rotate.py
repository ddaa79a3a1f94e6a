"""Hadamard rotations and norm folding against independent references: `scipy.linalg.hadamard`, dense matrices,
and the unrotated model's own logits (computational invariance)."""

import numpy as np
import pytest
import torch
from scipy.linalg import hadamard as scipy_hadamard

from lab.compress import rotate as R
from lab.models.zoo import tiny_llama


def model(tied: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    m = tiny_llama(vocab_size=20, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    if tied:
        m.config.tie_word_embeddings = True
        m.lm_head.weight = m.model.embed_tokens.weight
    with torch.no_grad():  # non-trivial RMSNorm gains, so folding them matters
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(0.5 + torch.rand_like(p))
    return m.double().eval()


IDS = torch.randint(0, 20, (3, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64, 256])
def test_fwht_matches_scipy_hadamard(n):
    x = torch.randn(5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    ref = x.numpy() @ scipy_hadamard(n) / np.sqrt(n)
    assert np.allclose(R.fwht(x).numpy(), ref, atol=1e-12)
    assert torch.allclose(R.fwht(R.fwht(x)), x, atol=1e-12)  # H/√n is symmetric and orthogonal


def test_fwht_rejects_non_powers_of_two():
    with pytest.raises(ValueError, match="power of 2"):
        R.fwht(torch.zeros(3, 12))


def test_random_hadamard_is_diag_signs_times_h_and_orthogonal():
    s = R.random_signs(16, torch.Generator().manual_seed(0))
    Q = np.diag(s.numpy()) @ scipy_hadamard(16) / 4
    assert np.allclose(R.matrix(s).numpy(), Q)
    assert np.allclose(Q @ Q.T, np.eye(16))
    x = torch.randn(7, 16, dtype=torch.float64)
    assert np.allclose(R.hadamard(x, s).numpy(), x.numpy() @ Q)
    assert np.allclose(R.online(x, s).numpy(), x.numpy() @ Q)


@pytest.mark.skipif(not torch.cuda.is_available() or R._cuda_hadamard is None,
                    reason="needs CUDA and the optional fast-hadamard-transform package")
def test_cuda_kernel_matches_torch():  # pragma: no cover
    x = torch.randn(4, 256, device="cuda")
    s = R.random_signs(256, torch.Generator().manual_seed(0)).cuda()
    assert torch.allclose(R.hadamard(x, s, backend="cuda"), R.hadamard(x, s, backend="torch"), atol=1e-4)


def test_norm_folding_preserves_logits_and_leaves_unit_gains():
    m = model()
    ref = m(input_ids=IDS).logits
    f = R.fuse_norms(model())
    assert (f(input_ids=IDS).logits - ref).abs().max() < 1e-10
    assert all(torch.all(n.weight == 1) for n in [f.model.norm, *[ly.input_layernorm for ly in f.model.layers]])


@pytest.mark.parametrize("tied", [False, True])
def test_r1_with_folding_is_invariant_and_unties(tied):
    m = model(tied)
    ref = m(input_ids=IDS).logits
    rot = R.Rotations.draw(m.config, 0)
    q = R.quantize_model(m, R.QuantSpec().off(), rot, r1=True)
    assert (q(input_ids=IDS).logits - ref).abs().max() < 1e-4
    assert q.lm_head.weight.data_ptr() != q.model.embed_tokens.weight.data_ptr()
    assert not torch.allclose(q.model.embed_tokens.weight, m.model.embed_tokens.weight)  # really rotated


def test_r1_on_the_wrong_side_breaks_invariance():
    m = model()
    ref = m(input_ids=IDS).logits
    q = R.quantize_model(m, R.QuantSpec().off(), R.Rotations.draw(m.config, 0), r1=True, wrong_side=True)
    assert (q(input_ids=IDS).logits - ref).abs().max() > 1e-2


def test_norm_folding_is_needed_before_r1():
    """Rotating without folding the gains changes the function (RMSNorm's gain does not commute with Q)."""
    m = model()
    ref = m(input_ids=IDS).logits
    R.untie(m)
    R.rotate_r1(m, R.matrix(R.Rotations.draw(m.config, 0).r1))
    assert (m(input_ids=IDS).logits - ref).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["R2", "R3", "R4"])
def test_each_in_block_rotation_is_invariant_in_full_precision(kind):
    m = model()
    ref = m(input_ids=IDS).logits
    choice = [{k: k == kind for k in R.KINDS} for _ in m.model.layers]
    q = R.quantize_model(m, R.QuantSpec().off(), R.Rotations.draw(m.config, 0), r1=True, choice=choice)
    assert (q(input_ids=IDS).logits - ref).abs().max() < 1e-4


def test_r2_rotates_every_value_head():
    m = model()
    attn = m.model.layers[0].self_attn
    x = torch.randn(5, 32, dtype=torch.float64)
    v = attn.v_proj(x).view(5, 4, 8)
    s = R.random_signs(8, torch.Generator().manual_seed(3))
    Wo = attn.o_proj.weight.clone()
    R.rotate_r2(attn, R.matrix(s))
    assert torch.allclose(attn.v_proj(x).view(5, 4, 8), v @ R.matrix(s), atol=1e-12)
    assert torch.allclose(attn.o_proj(attn.v_proj(x)), v.reshape(5, 32) @ Wo.T, atol=1e-10)


def test_quant_linear_is_rotated_quantized_product():
    """Q_x(x·Q4)·Q_w(W·Q4)ᵀ for down_proj with R4, by hand."""
    from lab.compress.quant import fake_quant

    m = model()
    rot = R.Rotations.draw(m.config, 0)
    choice = [{"R2": False, "R3": False, "R4": True} for _ in m.model.layers]
    q = R.quantize_model(m, R.QuantSpec(), rot, choice=choice)
    down, Q4 = q.model.layers[0].mlp.down_proj, R.matrix(rot.per_layer[0]["R4"])
    W0 = R.fuse_norms(model()).model.layers[0].mlp.down_proj.weight
    u = torch.randn(6, 64, dtype=torch.float64)
    ref = fake_quant(u @ Q4, 4) @ fake_quant(W0 @ Q4, 4).T
    assert torch.allclose(down(u), ref, atol=1e-6)
