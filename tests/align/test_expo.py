import math

import pytest
import torch

from lab.align import exact as X
from lab.align import expo as E

PI_STAR = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
PI_REF = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)


def test_expo_loss_is_bt_on_the_policy_plus_weighted_kl():
    pi = torch.log(torch.tensor([[0.5, 0.2], [0.1, 0.4]], dtype=torch.float64))
    ref = torch.zeros(2, 2, dtype=torch.float64)  # ignored by the supervised term
    kl = torch.tensor([0.3, 0.0], dtype=torch.float64)
    want = torch.tensor([-math.log(0.5 / 0.7) + 2 * 0.3, -math.log(0.1 / 0.5)], dtype=torch.float64)
    torch.testing.assert_close(E.expo(pi, ref, lam=2.0, kl=kl), want)
    torch.testing.assert_close(E.expo(pi, ref + 5.0, lam=2.0, kl=kl), want)  # no reference ratio


def test_kl_exact_and_the_official_mean_reduction():
    lr, lp = PI_REF.log(), PI_STAR.log()
    want = float((PI_REF * (lr - lp)).sum())
    assert float(E.kl_exact(lr, lp)) == pytest.approx(want)
    assert float(E.kl_exact(lr, lp, scale="mean")) == pytest.approx(want / 3)
    ref = torch.nn.functional.kl_div(lp, lr, log_target=True, reduction="mean")  # the official call
    assert float(E.kl_exact(lr, lp, scale="mean")) == pytest.approx(float(ref))


def test_pair_table_weights():
    i, j, w = E.pair_table(PI_REF, PI_STAR)
    assert len(i) == 6 and float(w.sum()) == pytest.approx(1.0)
    k = [(a, b) for a, b in zip(i.tolist(), j.tolist())].index((0, 2))
    assert float(w[k]) == pytest.approx((0.6 / 0.7) / 3)  # uniform pair, label by BT(π*)
    _, _, wr = E.pair_table(PI_REF, PI_STAR, pairs="reference")
    Z = sum(PI_REF[a] * PI_REF[b] * PI_STAR[a] / (PI_STAR[a] + PI_STAR[b])
            for a in range(3) for b in range(3) if a != b)
    assert float(wr[k]) == pytest.approx(0.4 * 0.2 * 0.6 / 0.7 / float(Z))


@pytest.mark.parametrize("lam", [0.3, 1.0, 4.0])
def test_dpo_and_rlhf_population_minimizers_are_the_closed_form(lam):
    closed = E.dpo_minimizer(PI_REF, PI_STAR, lam)
    torch.testing.assert_close(E.solve("dpo", PI_REF, PI_STAR, lam), closed, atol=1e-6, rtol=0)
    logits = closed.log().clone().requires_grad_()  # the closed form is a stationary point of RLHF's objective
    E.population_loss("rlhf", logits, PI_REF, PI_STAR, lam).backward()
    assert logits.grad.abs().max() < 1e-10


def test_expo_population_minimizer_limits_and_preservation():
    torch.testing.assert_close(E.solve("expo", PI_REF, PI_STAR, 1e-6), PI_STAR, atol=1e-5, rtol=0)  # λ→0: π*
    torch.testing.assert_close(E.solve("expo", PI_REF, PI_STAR, 1e6), PI_REF, atol=1e-4, rtol=0)  # λ→∞: π_ref
    for lam in (0.05, 1.0, 20.0):  # π_ref = π*: preserved for every λ
        torch.testing.assert_close(E.solve("expo", PI_STAR, PI_STAR, lam), PI_STAR, atol=1e-6, rtol=0)
    assert E.kl(PI_STAR, E.solve("dpo", PI_STAR, PI_STAR, 0.5)) > 0.1  # DPO moves the perfect prompt


def test_the_preservation_claim_fails_when_expo_is_swapped_for_dpo():
    """The notebook's claim C1 measured with each loss: it holds for EXPO and fails for DPO."""
    from lab.core import ClaimFailed, check

    def worst(method):
        return max(E.kl(PI_STAR, E.solve(method, PI_STAR, PI_STAR, math.exp(ll))) for ll in range(-3, 4))

    check("preservation (EXPO)", worst("expo"), "<", 1e-3)
    with pytest.raises(ClaimFailed):
        check("preservation (DPO in place of EXPO)", worst("dpo"), "<", 1e-3)


def test_official_numbers_for_dpo_and_ipo():
    """DPO and IPO reproduce the reference tables (uniform pairs, KL(π*‖π) with sum reduction)."""
    assert E.kl(PI_STAR, E.solve("dpo", PI_STAR, PI_STAR, math.exp(-3))) == pytest.approx(7.26, abs=0.01)
    assert E.kl(PI_STAR, E.solve("dpo", PI_REF, PI_STAR, math.exp(-5))) == pytest.approx(56.6, abs=0.1)
    assert E.kl(PI_STAR, E.solve("ipo", PI_REF, PI_STAR, math.exp(-5))) == pytest.approx(11.3, abs=0.1)


def test_enumerated_sequence_logprobs_are_a_distribution_and_match_a_loop():
    from lab.models import tiny_llama

    torch.manual_seed(0)
    seqs = X.all_sequences(3, 2)
    assert seqs.shape == (9, 2) and len({tuple(s) for s in seqs.tolist()}) == 9
    m = tiny_llama(vocab_size=5, d_model=16, n_layers=1, n_heads=2, max_len=4).eval()
    prompts = torch.tensor([3, 4])
    with torch.no_grad():
        logp = X.seq_logprobs(m, prompts, seqs, 3)  # (2, 9)
        torch.testing.assert_close(logp.exp().sum(-1), torch.ones(2))  # the responses exhaust the space
        x = torch.tensor([[4, 2, 0]])
        step = m(input_ids=x).logits[0, :, :3].log_softmax(-1)
        want = step[0, 2] + step[1, 0]
        torch.testing.assert_close(logp[1, seqs.tolist().index([2, 0])], want)


def test_tilt_hits_its_kl_and_exact_sft_fits():
    from lab.models import tiny_llama

    g = torch.Generator().manual_seed(0)
    base = torch.randn(27, dtype=torch.float64, generator=g).log_softmax(-1)
    q = E.tilt(base, 0.7, g)
    assert float((q.exp() * (q - base)).sum()) == pytest.approx(0.7, abs=1e-6)
    torch.manual_seed(0)
    m = tiny_llama(vocab_size=5, d_model=16, n_layers=1, n_heads=2, max_len=4)
    seqs, prompts = X.all_sequences(3, 2), torch.tensor([3, 4])
    kls = X.fit_exact(m, prompts, seqs, torch.randn(2, 9).log_softmax(-1), 3, steps=60, lr=1e-2)
    assert kls[-1] < 0.5 * kls[0]
