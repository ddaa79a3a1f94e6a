"""Tent, EATA and COME (`lab.adapt.entropy_tta`) against hand-computed references, on TLM's LoRA adapter."""

import math

import pytest
import torch

from lab.adapt import entropy_tta as E
from lab.adapt import tlm as T
from tests.adapt.tiny import V, model


def test_entropy_baselines():
    m = model()
    x = torch.randint(V, (2, 6))
    e = E.entropy_of_continuation(m, x, 3)
    with torch.no_grad():  # by hand: greedy continuation, then the entropies at those positions
        seq = x
        for _ in range(3):
            seq = torch.cat([seq, m(input_ids=seq).logits[:, -1:].argmax(-1)], 1)
        p = m(input_ids=seq).logits[:, 5:8].softmax(-1)
        want = -(p * p.log()).sum(-1).mean(-1)
    torch.testing.assert_close(e.detach(), want, rtol=1e-5, atol=1e-6)
    loss, sel = E.tent_objective(3)(m, x)
    loss.backward()
    assert sel and any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
    loss, sel = E.eata_objective(e0=0.0, k=3)(m, x)  # nothing is that confident: skipped
    assert not sel and loss.item() == 0.0


def test_eata_filters_weights_and_regularises_as_the_official_code():
    m = T.add_lora(model())
    x1, x2 = (torch.randint(V, (1, 6), generator=torch.Generator().manual_seed(i)) for i in (0, 1))
    with torch.no_grad():
        tokens, logp = E.continuation(m, x1, 3)
        p = logp.exp()
        e1 = -(p * logp).sum(-1).mean().item()
        p1 = p.mean(1)[0]
        p2 = E.continuation(m, x2, 3)[1].exp().mean(1)[0]
    e0 = e1 + 0.5  # x1 is reliable
    f = E.eata_objective(e0, 3, d_margin=1.01)
    loss, kept = f(m, x1)  # no moving average yet: kept; loss = exp(E0 - E)·E
    assert kept and loss.item() == pytest.approx(math.exp(0.5) * e1, rel=1e-4)
    cos = torch.nn.functional.cosine_similarity(p1, p2, dim=0).abs().item()
    strict = E.eata_objective(e0 + 10, 3, d_margin=cos - 1e-3)
    assert strict(m, x1)[1] and not strict(m, x2)[1]  # x2 redundant with the average (= p1): skipped
    loose = E.eata_objective(e0 + 10, 3, d_margin=cos + 1e-3)
    assert loose(m, x1)[1] and loose(m, x2)[1]
    assert not E.eata_objective(e1 - 1e-3, 3)(m, x1)[1]  # unreliable (E >= E0): skipped
    # per_sample (the entropy_as_ppl control): the same entropy weight exp(E0 - E), the input's NLL as the term
    nll = lambda model, x: torch.full((x.shape[0],), 2.5)
    loss, kept = E.eata_objective(e0, 3, d_margin=1.01, per_sample=nll)(m, x1)
    assert kept and loss.item() == pytest.approx(math.exp(0.5) * 2.5, rel=1e-4)
    assert not E.eata_objective(e1 - 1e-3, 3, per_sample=nll)(m, x1)[1]  # the entropy filter still decides
    # the Fisher regulariser: alpha * sum F (theta - theta0)^2, by hand after moving one parameter
    fishers = E.fisher_information(m, [x1, x2], 3)
    name, q = next((n, q) for n, q in m.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        q.add_(0.1)
    reg = E.eata_objective(-1.0, 3, fishers=fishers, alpha=7.0)(m, x1)[0]  # nothing kept: the regulariser alone
    want = 7.0 * sum((fishers[n][0] * (r - fishers[n][1]) ** 2).sum() for n, r in m.named_parameters() if n in fishers)
    assert reg.item() == pytest.approx(want.item(), rel=1e-5) and reg.item() > 0


def test_fisher_information_is_the_mean_squared_gradient_over_batches():
    m = T.add_lora(model())
    with torch.no_grad():  # B = 0 at init leaves A without gradient; give B a value so both are checked
        for n, q in m.named_parameters():
            if "lora_B" in n:
                q.normal_(0, 0.1)
    batches = [torch.randint(V, (2, 6), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    got = E.fisher_information(m, batches, 2)
    params = {n: q for n, q in m.named_parameters() if q.requires_grad}
    want = {n: torch.zeros_like(q) for n, q in params.items()}
    for x in batches:  # naive: pseudo-labels = greedy continuation, CE over (B, k), grad squared
        with torch.no_grad():
            seq = x
            for _ in range(2):
                seq = torch.cat([seq, m(input_ids=seq).logits[:, -1:].argmax(-1)], 1)
        logits = m(input_ids=seq).logits[:, 5:7]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, V), seq[:, 6:].reshape(-1))
        m.zero_grad()
        ce.backward()
        for n, q in params.items():
            want[n] += q.grad ** 2 / len(batches)
    for n in params:
        torch.testing.assert_close(got[n][0], want[n], rtol=1e-4, atol=1e-10)
        assert torch.equal(got[n][1], params[n].detach())
    assert any(got[n][0].abs().sum() > 0 for n in params if "lora_A" in n)


def test_opinion_entropy_is_the_official_formula_and_cannot_grow_the_logits():
    z = torch.randn(3, 10, dtype=torch.float64) * 2
    e = z.exp()  # the official `dirichlet_entropy`, written out with K = 1000 as in tent_come.py
    s = e.sum(1, keepdim=True) + 1000
    q = torch.cat([e / s, 1000 / s], 1) + 1e-7
    torch.testing.assert_close(E.opinion_entropy(z, K=1000), -(q * q.log()).sum(1))
    assert E.opinion_entropy(z).shape == (3,)  # K defaults to the class count (here 10)
    big = torch.tensor([[200.0, 0.0, 0.0]])  # exp(200) overflows float32; in log space: belief ≈ one-hot, u ≈ 0
    assert torch.isfinite(E.opinion_entropy(big)).all() and E.opinion_entropy(big).item() < 1e-4
    z = z.clone().requires_grad_(True)
    E.opinion_entropy(z).sum().backward()
    torch.testing.assert_close((z.grad * z).sum(1), torch.zeros(3, dtype=torch.float64))  # no radial component
    sharp = torch.tensor([[4.0, 0.0, 0.0]])  # the uncertainty mass u keeps it above the softmax entropy
    assert E.opinion_entropy(sharp).item() > -(sharp.softmax(1) * sharp.log_softmax(1)).sum().item()


def test_come_objective_on_the_greedy_continuation():
    m = model()
    x = torch.randint(V, (2, 6))
    loss, sel = E.come_objective(3)(m, x)
    with torch.no_grad():
        seq = x
        for _ in range(3):
            seq = torch.cat([seq, m(input_ids=seq).logits[:, -1:].argmax(-1)], 1)
        z = m(input_ids=seq).logits[:, 5:8].double()
    want = E.opinion_entropy(z).mean()
    assert sel and loss.item() == pytest.approx(want.item(), rel=1e-5)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
