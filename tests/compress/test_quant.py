"""Group-wise quantization: packing round trips, the RTN closed form, HQQ's solver improving on RTN."""

import sys
from pathlib import Path

import pytest
import torch

from lab.compress import fake_quantize, pack, quantize, unpack
from lab.compress.quant import shrink_lp


@pytest.mark.parametrize("nbits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 7, 10, 64, 70])
def test_pack_round_trip(nbits, k):
    q = torch.randint(0, 2**nbits, (5, k), generator=torch.Generator().manual_seed(k), dtype=torch.uint8)
    assert torch.equal(unpack(pack(q, nbits), nbits, k), q)


def test_int2_layout_is_the_kernels():
    q = torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8)
    p = pack(q, 2)
    assert p.dtype == torch.uint8 and p.shape == (1, 2)
    assert p.tolist() == [[1 | 2 << 2 | 3 << 4, 3]]  # code i of a byte in bits 2i..2i+1


def test_rtn_closed_form():
    """One group [0, 1, 2, 3] at 2 bits: s = 1, z = 0, exact; codes are the values."""
    W = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    Q = quantize(W, 2, 4, "rtn")
    assert torch.equal(Q.codes(), torch.tensor([[0, 1, 2, 3]], dtype=torch.uint8))
    assert torch.allclose(Q.scale, torch.ones(1, 1)) and torch.allclose(Q.zero, torch.zeros(1, 1))
    assert torch.equal(Q.dequantize(), W)


@pytest.mark.parametrize("nbits", [1, 2, 3, 4])
def test_hqq_beats_rtn_and_error_falls_with_bits(nbits):
    W = torch.randn(48, 130, generator=torch.Generator().manual_seed(nbits))
    err = {m: float((W - fake_quantize(W, nbits, 32, m)).abs().mean()) for m in ("rtn", "hqq")}
    assert err["hqq"] < err["rtn"]
    if nbits < 4:
        assert float((W - fake_quantize(W, nbits + 1, 32)).abs().mean()) < err["hqq"]


@pytest.mark.parametrize("seed", range(5))
def test_groups_are_independent_and_shapes(seed):
    """Every HQQ step solves each group on its own; only the early stop looks at the whole tensor's error (as the
    package's does), so groups are independent at a fixed number of steps (no early stop can come before step 2)."""
    W = torch.randn(3, 70, generator=torch.Generator().manual_seed(seed))
    Q = quantize(W, 2, 32)
    assert Q.scale.shape == Q.zero.shape == (3, 3) and Q.dequantize().shape == (3, 70)
    W2 = W.clone()
    W2[:, 40:] *= 100  # other groups must not change the first group's reconstruction
    one = lambda M: quantize(M, 2, 32, iters=1).dequantize()[:, :32]
    assert torch.allclose(one(W2), one(W))


def test_bits_per_weight_counts_metadata():
    Q = quantize(torch.randn(8, 128), 2, 64)
    assert Q.bits_per_weight() == pytest.approx(2 + 2 * 16 / 64)  # codes + fp16 scale & zero per group


def test_shrink_lp_reference():
    x = torch.tensor([-2.0, -0.05, 0.0, 0.05, 2.0])
    assert torch.allclose(shrink_lp(x, 10.0, 1), torch.tensor([-1.9, 0.0, 0.0, 0.0, 1.9]))
    y = shrink_lp(x, 10.0, 0.7)
    assert torch.allclose(y[-1], torch.tensor(2.0 - 0.1 * 2.0 ** -0.3)) and y[1] == 0 and y[3] == 0


def test_bad_input():
    with pytest.raises(ValueError, match="nbits"):
        quantize(torch.randn(2, 4), 5)
    with pytest.raises(ValueError, match="method"):
        quantize(torch.randn(2, 4), 2, method="gptq")



# ---------------------------------------------------------------- against the `hqq` package (Badri & Shaji's code)

def _hqq():
    """`hqq.core.quantize`, from the folder `make setup` installs it into (`.venv/hqq-reference`, off the path:
    transformers would import an importable hqq in every process), or from the environment."""
    folder = Path(__file__).resolve().parents[2] / ".venv" / "hqq-reference"
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.append(str(folder))
    return pytest.importorskip("hqq.core.quantize", reason="the `hqq` package is not installed (`make setup` does)")


def _weights(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss+outliers":  # the solver runs all its iterations
        return torch.randn(96, 256, generator=g) * (1 + 9 * (torch.rand(96, 256, generator=g) < 0.01))
    return torch.rand(96, 256, generator=g) ** 2  # skewed: the error rises within 20 iterations, the early stop fires


@pytest.mark.parametrize("kind", ["gauss+outliers", "skewed"])
@pytest.mark.parametrize("method", ["rtn", "hqq"])
@pytest.mark.parametrize("nbits", [1, 2, 3, 4])
def test_matches_the_hqq_package(nbits, method, kind):
    """Scale, zero and dequantized weights equal `hqq.core.quantize.Quantizer.quantize` (optimize=False: min-max
    RTN; optimize=True: its proximal solver, early stop included) on the same grouping, 64 consecutive inputs of a
    row (`axis=1`). hqq ≥ 0.2.7 never multiplies β by κ (its legacy loop lost `beta *= kappa`), so ours runs at
    κ = 1 here; at its default κ = 1.01 (the HQQ paper, hqq ≤ 0.2.6) its error stays within 3 % of the package's."""
    hqq = _hqq()
    W = _weights(kind, nbits)
    W_q, meta = hqq.Quantizer.quantize(W, nbits=nbits, group_size=64, axis=1, optimize=method == "hqq",
                                       device="cpu", compute_dtype=torch.float32)
    ref = hqq.Quantizer.dequantize(W_q, {**meta, "compute_dtype": torch.float32}).reshape(W.shape)
    Q = quantize(W, nbits, 64, method, kappa=1.0)
    assert torch.allclose(Q.scale, meta["scale"].reshape(96, 4), rtol=1e-6, atol=0)
    assert torch.allclose(Q.zero, meta["zero"].reshape(96, 4), rtol=1e-6, atol=1e-6)
    assert torch.allclose(Q.dequantize(), ref, rtol=1e-6, atol=1e-6)
    if method == "hqq":
        longer = quantize(W, nbits, 64, method, kappa=1.0, iters=100)  # equal iff the early stop fired before 20
        assert torch.equal(longer.zero, Q.zero) == (kind == "skewed")
        err = lambda w: float((W - w).abs().mean())
        assert err(fake_quantize(W, nbits, 64)) <= 1.03 * err(ref)
