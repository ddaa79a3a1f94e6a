import pytest
import torch

from lab.align import exact as X
from lab.align import infalign as I
from lab.align import infalign_scales as S


def test_exact_win_rates_against_brute_force_and_the_base_policy():
    g = torch.Generator().manual_seed(0)
    S = 7
    p, q = torch.rand(1, S, generator=g).log_softmax(-1), torch.rand(1, S, generator=g).log_softmax(-1)
    r = torch.tensor([[0.3, 1.0, -2.0, 0.3, 5.0, 0.0, 1.0]], dtype=torch.float64)  # with ties
    assert float(X.win_rate(q, q, r, 4)) == pytest.approx(0.5)  # a policy against itself
    # brute force over all N-tuples for N = 2
    P, Q = p[0].double().exp(), q[0].double().exp()
    want = 0.0
    for a in range(S):
        for b in range(S):
            for c in range(S):
                for d in range(S):
                    mine, theirs = max(r[0, a], r[0, b]), max(r[0, c], r[0, d])
                    w = P[a] * P[b] * Q[c] * Q[d]
                    want += w * (1.0 if mine > theirs else 0.5 if mine == theirs else 0.0)
    assert float(X.win_rate(p, q, r, 2, "bon")) == pytest.approx(float(want))
    won = sum(P[a] * P[b] * Q[c] * Q[d] * (1.0 if min(r[0, a], r[0, b]) > min(r[0, c], r[0, d]) else
                                           0.5 if min(r[0, a], r[0, b]) == min(r[0, c], r[0, d]) else 0.0)
              for a in range(S) for b in range(S) for c in range(S) for d in range(S))
    assert float(X.win_rate(p, q, r, 2, "won")) == pytest.approx(float(won))


def test_exact_calibration_and_matched_kl():
    ref = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    r = torch.tensor([[3.0, 1.0, 2.0, 2.0]], dtype=torch.float64)
    want = torch.tensor([[0.2 + 0.3 + 0.4 + 0.05, 0.1, 0.2 + 0.35, 0.2 + 0.35]], dtype=torch.float64)  # ties: ½
    torch.testing.assert_close(X.calibrate_exact(ref, r), want)
    beta = X.beta_for_kl(ref, r, 0.1)
    q = X.tilt_logp(ref, r, beta)
    assert float((q.exp() * (q - ref.double())).sum()) == pytest.approx(0.1, abs=1e-6)
    f = S.rescaled(I.exp_bon(5.0))
    ends = f(torch.tensor([0.0, 1.0], dtype=torch.float64))
    assert ends.tolist() == [0.0, 1.0]


def test_exact_rlhf_training_reaches_the_closed_form():
    from lab.models import tiny_llama

    torch.manual_seed(0)
    seqs, prompts = X.all_sequences(3, 2), torch.tensor([3])
    m = tiny_llama(vocab_size=4, d_model=16, n_layers=1, n_heads=2, max_len=3)
    with torch.no_grad():
        ref = X.seq_logprobs(m, prompts, seqs, 3)
    R = torch.linspace(0, 1, 9)[None]
    got = X.train_rlhf(m, prompts, seqs, ref, R, 0.5, 3, steps=300, lr=1e-2)
    torch.testing.assert_close(got.exp(), X.tilt_logp(ref, R.double(), 0.5).exp().float(), atol=0.02, rtol=0)


def _model(seed=0):
    from lab.models import tiny_llama

    torch.manual_seed(seed)
    return tiny_llama(vocab_size=5, d_model=16, n_layers=1, n_heads=2, max_len=4)


def test_the_exact_solvers_are_plain_adam_loops_bit_for_bit():
    """`fit_exact` and `train_rlhf` run through `lab.align.train.optimize`: the same parameters as a hand-written
    Adam loop (backward, step, zero_grad) on the same objective."""
    import copy

    seqs, prompts = X.all_sequences(3, 2), torch.tensor([3, 4])
    target = torch.randn(2, 9, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    model, naive = _model(), _model()
    kls = X.fit_exact(model, prompts, seqs, target, 3, steps=8, lr=1e-2, quiet=True)
    opt, want = torch.optim.Adam(naive.parameters(), lr=1e-2), []
    for _ in range(8):
        kl = (target.exp() * (target - X.seq_logprobs(naive, prompts, seqs, 3))).sum(-1).mean()
        kl.backward()
        opt.step()
        opt.zero_grad()
        want.append(kl.item())
    assert kls == want and all(torch.equal(a, b) for a, b in zip(model.parameters(), naive.parameters()))

    with torch.no_grad():
        ref = X.seq_logprobs(model, prompts, seqs, 3)
    R = torch.linspace(0, 1, 9)[None].expand(2, -1)
    policy, naive = copy.deepcopy(model), copy.deepcopy(model)
    got = X.train_rlhf(policy, prompts, seqs, ref, R, 0.5, 3, steps=6, lr=1e-2, quiet=True)
    opt = torch.optim.Adam(naive.parameters(), lr=1e-2)
    for _ in range(6):
        logp = X.seq_logprobs(naive, prompts, seqs, 3)
        (-(logp.exp() * (R - 0.5 * (logp - ref))).sum(-1).mean()).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        assert torch.equal(got, X.seq_logprobs(naive, prompts, seqs, 3))


def test_avoid_prob_is_the_mass_of_the_enumerated_token_free_responses():
    """The prefix-tree shortcut against summing π over every response of length L that avoids the token."""
    from lab.align.exact import all_sequences, avoid_prob, seq_logprobs
    from lab.models import tiny_llama

    torch.manual_seed(0)
    V, C = 5, 3
    prompts = torch.arange(V, V + C)
    for L in (1, 2, 3):
        model = tiny_llama(vocab_size=V + C, d_model=16, n_layers=1, n_heads=2, max_len=L + 1)
        seqs = all_sequences(V, L)
        with torch.no_grad():
            full = seq_logprobs(model, prompts, seqs, V).exp()  # (C, V^L)
            for token in (0, 4):
                want = full[:, ~(seqs == token).any(-1)].sum(-1)
                torch.testing.assert_close(avoid_prob(model, prompts, V, L, token), want, rtol=1e-5, atol=1e-6)


def test_the_prefix_trick_gives_the_enumerated_log_probs():
    from lab.align.exact import all_logprobs, all_sequences, seq_logprobs
    from lab.models import tiny_llama

    torch.manual_seed(0)
    V, L, prompts = 4, 3, torch.arange(4, 7)
    model = tiny_llama(vocab_size=V + 3, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_len=L + 1)
    want = seq_logprobs(model, prompts, all_sequences(V, L), V)
    torch.testing.assert_close(all_logprobs(model, prompts, V, L), want, atol=1e-5, rtol=0)
    assert torch.allclose(want.logsumexp(-1), torch.zeros(3), atol=1e-5)


def test_the_all_responses_solvers_are_plain_adam_loops_on_all_logprobs():
    """`fit_all` and `train_rlhf_all` are `fit_exact` and `train_rlhf` over every response, scored by
    `all_logprobs`: the same parameters as a hand-written Adam loop (backward, step, zero_grad) on that objective;
    and `all_logprobs` covers L = 1 (no prefix) and matches the full enumeration there too."""
    import copy

    prompts, V, L = torch.tensor([3, 4]), 3, 2
    target = torch.randn(2, 9, generator=torch.Generator().manual_seed(0)).log_softmax(-1)
    model, naive = _model(), _model()
    kls = X.fit_all(model, prompts, target, V, L, steps=8, lr=1e-2, quiet=True)
    opt, want = torch.optim.Adam(naive.parameters(), lr=1e-2), []
    for _ in range(8):
        kl = (target.exp() * (target - X.all_logprobs(naive, prompts, V, L))).sum(-1).mean()
        kl.backward()
        opt.step()
        opt.zero_grad()
        want.append(kl.item())
    assert kls == want and all(torch.equal(a, b) for a, b in zip(model.parameters(), naive.parameters()))

    with torch.no_grad():
        ref = X.all_logprobs(model, prompts, V, L)
    R = torch.linspace(0, 1, 9)[None].expand(2, -1)
    policy, naive = copy.deepcopy(model), copy.deepcopy(model)
    got = X.train_rlhf_all(policy, prompts, ref, R, 0.5, V, L, steps=6, lr=1e-2, quiet=True)
    opt = torch.optim.Adam(naive.parameters(), lr=1e-2)
    for _ in range(6):
        logp = X.all_logprobs(naive, prompts, V, L)
        (-(logp.exp() * (R - 0.5 * (logp - ref))).sum(-1).mean()).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        assert torch.equal(got, X.all_logprobs(naive, prompts, V, L))
        one = X.all_logprobs(model, prompts, V, 1)
        assert one.shape == (2, 3)
        torch.testing.assert_close(one, X.seq_logprobs(model, prompts, X.all_sequences(V, 1), V), atol=1e-6, rtol=0)
