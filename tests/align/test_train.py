import copy

import pytest
import torch

from lab.align.train import chosen_token_kl, preference_loss, sequence_logprobs, train_preferences
from lab.models import tiny_llama

V = 8


def batch_of(pairs):
    """pairs: list of (prompt, chosen, rejected) token lists, equal lengths within a pair."""
    B, T = len(pairs), max(len(p) + max(len(c), len(r)) for p, c, r in pairs)
    ids = torch.zeros(B, 2, T, dtype=torch.long)
    att = torch.zeros(B, 2, T, dtype=torch.long)
    resp = torch.zeros(B, 2, T)
    for b, (p, c, r) in enumerate(pairs):
        for k, y in enumerate((c, r)):
            seq = p + y
            ids[b, k, :len(seq)] = torch.tensor(seq)
            att[b, k, :len(seq)] = 1
            resp[b, k, len(p):len(seq)] = 1
    return {"input_ids": ids, "attention_mask": att, "response_mask": resp}


PAIRS = [([1, 2], [3, 4], [5, 6]), ([2], [3, 3, 4], [6, 5])]


def model(seed=0):
    torch.manual_seed(seed)
    return tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=8).eval()


def test_sequence_logprobs_match_a_naive_loop():
    m, batch = model(), batch_of(PAIRS)
    got = sequence_logprobs(m, batch)
    with torch.no_grad():
        for b, (p, c, r) in enumerate(PAIRS):
            for k, y in enumerate((c, r)):
                logp = m(input_ids=torch.tensor([p + y])).logits[0].log_softmax(-1)
                want = sum(logp[len(p) + t - 1, y[t]] for t in range(len(y)))
                assert float(got[b, k]) == pytest.approx(float(want), abs=1e-5)


def test_dpo_at_the_reference_and_training_raises_the_margin():
    policy, batch = model(), batch_of(PAIRS)
    reference = copy.deepcopy(policy)
    assert preference_loss(policy, reference, batch, "dpo", beta=0.5).item() == pytest.approx(0.6931, abs=1e-4)
    ref_state = {k: v.clone() for k, v in reference.state_dict().items()}
    losses = train_preferences(policy, reference, lambda g: batch, "dpo", steps=40, lr=1e-2, beta=0.5, quiet=True)
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad():
        margin = sequence_logprobs(policy, batch) - sequence_logprobs(reference, batch)
    assert (margin[:, 0] > margin[:, 1]).all()
    assert all(torch.equal(v, ref_state[k]) for k, v in reference.state_dict().items())  # frozen


def test_expo_uses_a_token_level_kl_that_vanishes_at_the_reference():
    policy, batch = model(), batch_of(PAIRS)
    reference = copy.deepcopy(policy)
    _, d = sequence_logprobs(policy, batch, with_dists=True)
    assert torch.allclose(chosen_token_kl(d, d, batch), torch.zeros(2))
    s = sequence_logprobs(policy, batch).detach()
    want = torch.nn.functional.softplus(-(s[:, 0] - s[:, 1])).mean()  # KL term is 0 at the reference
    assert preference_loss(policy, reference, batch, "expo", lam=3.0).item() == pytest.approx(float(want), abs=1e-5)
    train_preferences(policy, reference, lambda g: batch, "expo", steps=5, lr=1e-2, lam=3.0, quiet=True)
    _, d2 = sequence_logprobs(policy, batch, with_dists=True)
    assert (chosen_token_kl(d, d2, batch) > 0).all()


def test_response_logps_and_masked_pair_training():
    from lab.align.train import response_logps, train_pairs

    torch.manual_seed(0)
    V = 10
    m = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16).eval()
    x, y = torch.randint(V, (3, 4)), torch.randint(V, (3, 5))
    full = m(input_ids=torch.cat([x, y], 1)).logits.log_softmax(-1)
    want = torch.stack([full[:, 3 + t].gather(-1, y[:, t:t + 1])[:, 0] for t in range(5)], 1)  # naive loop
    torch.testing.assert_close(response_logps(m, x, y), want)
    mask = torch.tensor([[1, 1, 0, 0, 0]] * 3).bool()
    torch.testing.assert_close(response_logps(m, x, y, mask), want * mask)
    seen = []

    def loss(b):
        seen.append(b)
        return -(b["pi_w"] - b["pi_l"]).sum(-1).mean()

    pairs = {"prompt": x, "chosen": y, "rejected": y.flip(-1), "rejected_mask": mask, "tag": torch.arange(3.0)}
    policy, log = train_pairs(m, pairs, loss, steps=4, lr=1e-2, batch_size=2, every=2, quiet=True)
    assert log["step"] == [0, 2, 4] and len(log["loss"]) == 4 and policy is not m
    assert set(seen[0]) == {"tag", "pi_w", "ref_w", "pi_l", "ref_l"} and (seen[0]["pi_l"][:, 2:] == 0).all()


def test_sequential_kl_matches_torch_kl_div_and_pair_training_passes_it():
    """`sequential_kl` against `torch.nn.functional.kl_div` position by position; `train_pairs(kl=True)` gives each
    batch the policy's sequential KLs from the frozen reference (0 at the first step, where π_θ = π_ref; positive
    after training), masked like the log-probs; TDPO's loss over them trains both ways."""
    from torch.nn.functional import kl_div

    from lab.align.train import response_dists, response_kls, sequential_kl, train_pairs

    g = torch.Generator().manual_seed(0)
    p, q = torch.randn(3, 4, 6, generator=g).log_softmax(-1), torch.randn(3, 4, 6, generator=g).log_softmax(-1)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]]).float()
    want = (kl_div(q, p, log_target=True, reduction="none").sum(-1) * mask).sum(-1)  # Σ_t KL(p_t ‖ q_t)
    torch.testing.assert_close(sequential_kl(p, q, mask), want)
    assert (sequential_kl(p, q) > 0).all() and sequential_kl(p, q, mask)[2] == 0
    m, batch = model(), batch_of(PAIRS)
    _, d = sequence_logprobs(m, batch, with_dists=True)
    _, d2 = sequence_logprobs(model(1), batch, with_dists=True)
    kls = response_kls(d, d2, batch)
    assert kls.shape == (2, 2) and torch.equal(kls[:, 0], chosen_token_kl(d, d2, batch))
    for b, (pr, c, r) in enumerate(PAIRS):  # only the response's positions count
        for k, y in enumerate((c, r)):
            row = 2 * b + k
            span = slice(len(pr) - 1, len(pr) - 1 + len(y))
            assert kls[b, k].item() == pytest.approx(sequential_kl(d[row:row + 1, span], d2[row:row + 1, span]).item())

    torch.manual_seed(0)
    net = tiny_llama(vocab_size=10, d_model=16, n_layers=1, n_heads=2, max_len=16).eval()
    x, yw, yl = torch.randint(10, (4, 3)), torch.randint(10, (4, 5)), torch.randint(10, (4, 5))
    rmask = torch.tensor([[1, 1, 1, 0, 0]] * 4).bool()
    seen = []

    def loss(b):
        seen.append({k: v.detach() for k, v in b.items()})
        return -(b["pi_w"] - b["pi_l"]).sum(-1).mean()

    pairs = {"prompt": x, "chosen": yw, "rejected": yl, "rejected_mask": rmask}
    policy, _ = train_pairs(net, pairs, loss, steps=5, lr=3e-2, batch_size=4, kl=True, quiet=True)
    assert set(seen[0]) == {"pi_w", "ref_w", "pi_l", "ref_l", "kl_w", "kl_l"}
    assert seen[0]["kl_w"].abs().max() < 1e-6 and seen[0]["kl_l"].abs().max() < 1e-6
    assert (seen[-1]["kl_w"] > 0).all() and (seen[-1]["kl_l"] > 0).all()
    with torch.no_grad():  # the last step's KLs are the policy's before that step's update: recompute one by hand
        for y, m_ in ((yw, None), (yl, rmask)):
            assert (sequential_kl(response_dists(net, x, y), response_dists(policy, x, y), m_) > 1e-4).all()
    train_pairs(net, pairs, loss, steps=1, lr=1e-2, batch_size=4, quiet=True)
    assert "kl_w" not in seen[-1]  # without `kl` no distribution is kept
