import math

import pytest
import torch

from lab.align import LOSSES
from lab.align.losses import dpo, fdpo_js, ipo, plackett_luce, rpo, tdpo

torch.manual_seed(0)
PI, REF = torch.randn(5, 2, dtype=torch.float64) - 3, torch.randn(5, 2, dtype=torch.float64) - 3


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_dpo_at_the_reference_is_log_2_per_pair():
    torch.testing.assert_close(dpo(REF.clone(), REF, beta=0.7), torch.full((5,), math.log(2), dtype=torch.float64))


@pytest.mark.parametrize("beta, eps", [(0.1, 0.0), (2.0, 0.0), (0.5, 0.1)])
def test_dpo_matches_a_scalar_reference(beta, eps):
    for b in range(5):
        d = (PI[b, 0] - REF[b, 0]) - (PI[b, 1] - REF[b, 1])
        want = -(1 - eps) * math.log(sig(beta * d)) - eps * math.log(sig(-beta * d))
        assert dpo(PI, REF, beta=beta, label_smoothing=eps)[b].item() == pytest.approx(want, rel=1e-9)


def test_ipo_and_rpo_by_hand():
    d = (PI[:, 0] - REF[:, 0]) - (PI[:, 1] - REF[:, 1])
    torch.testing.assert_close(ipo(PI, REF, beta=0.25), (d - 2.0) ** 2)
    lens = torch.tensor([3.0, 4, 5, 6, 7], dtype=torch.float64)
    torch.testing.assert_close(rpo(PI, REF, beta=0.1, alpha=0.5, chosen_len=lens),
                               dpo(PI, REF, beta=0.1) - 0.5 * PI[:, 0] / lens)
    torch.testing.assert_close(rpo(PI, REF, beta=0.1, alpha=1.0), dpo(PI, REF, beta=0.1) - PI[:, 0])


def test_fdpo_js_from_probabilities():
    p, q = PI.exp(), REF.exp()
    g = torch.log(2 * p / (p + q))
    want = -torch.log(torch.sigmoid(0.3 * (g[:, 0] - g[:, 1])))
    torch.testing.assert_close(fdpo_js(PI, REF, beta=0.3), want)


def test_plackett_luce_naive_product_and_pairwise_limit():
    pi, ref = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    s = 0.5 * (pi - ref)
    for b in range(4):
        e = s[b].exp()
        want = -math.log(e[0] / e.sum()) - math.log(e[1] / (e[1] + e[2]))
        assert plackett_luce(pi, ref, beta=0.5)[b].item() == pytest.approx(want, rel=1e-9)
    torch.testing.assert_close(plackett_luce(PI, REF, beta=0.4), dpo(PI, REF, beta=0.4))


def test_signature_and_shape_errors():
    for name, f in LOSSES.items():
        if name in ("expo", "hps", "tdpo"):  # their own inputs (kl, rewards): tested below / in their modules
            continue
        out = f(PI, REF, beta=0.2)
        assert out.shape == (5,)
    with pytest.raises(ValueError, match=r"\(B, 2\)"):
        dpo(torch.zeros(3, 3), torch.zeros(3, 3))
    with pytest.raises(TypeError):
        dpo(PI, REF, gamma=1.0)  # options are keyword-only and checked


def test_gradient_of_dpo_matches_finite_differences():
    pi = PI.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: dpo(x, REF, beta=0.3).sum(), (pi,))
    assert torch.autograd.gradcheck(lambda x: plackett_luce(x, REF.repeat(1, 2)[:, :3], beta=0.3).sum(),
                                    (torch.randn(5, 3, dtype=torch.float64, requires_grad=True),))


def test_tdpo_by_hand_and_its_stop_gradient():
    """TDPO1: −log σ(β(Δh − (D_l − D_w))); TDPO2: −log σ(β(Δh − α(D_l − sg(D_w)))) (the official `tdpo_loss`);
    with zero sequential KL both are DPO; TDPO2 passes no gradient to D_w, TDPO1 does."""
    kl = torch.rand(5, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for b in range(5):
        d = (PI[b, 0] - REF[b, 0]) - (PI[b, 1] - REF[b, 1])
        one = -math.log(sig(0.3 * (d - (kl[b, 1] - kl[b, 0]))))
        two = -math.log(sig(0.3 * (d - 0.5 * (kl[b, 1] - kl[b, 0]))))
        assert tdpo(PI, REF, beta=0.3, kl=kl, tdpo2=False)[b].item() == pytest.approx(one, rel=1e-9)
        assert tdpo(PI, REF, beta=0.3, kl=kl)[b].item() == pytest.approx(two, rel=1e-9)
    for two in (True, False):
        torch.testing.assert_close(tdpo(PI, REF, beta=0.3, kl=torch.zeros_like(PI), tdpo2=two), dpo(PI, REF, beta=0.3))
        k = kl.clone().requires_grad_()
        tdpo(PI, REF, beta=0.3, kl=k, tdpo2=two).sum().backward()
        assert (k.grad[:, 0] == 0).all() == two and (k.grad[:, 1] > 0).all()  # more KL on y_l: higher loss
    with pytest.raises(ValueError, match=r"kl of the shape of pi"):
        tdpo(PI, REF, kl=kl[:, :1])
    with pytest.raises(ValueError, match=r"got None"):
        tdpo(PI, REF)
