"""The sparse Markov language (lab.data.sparse_markov): its tables, its samples and its true NLL."""

from __future__ import annotations

import math

import pytest
import torch

from lab.data.sparse_markov import SparseMarkov


def test_tables_are_sparse_distributions_that_never_emit_bos():
    task = SparseMarkov(vocab=16, order=2, support=3, seed=1)
    tokens, probs = task.tables
    assert tokens.shape == probs.shape == (256, 3)
    assert int(tokens.min()) >= 1 and all(len(set(r)) == 3 for r in tokens.tolist())
    torch.testing.assert_close(probs.sum(1), torch.ones(256))
    assert SparseMarkov(vocab=16, seed=2).tables[0].tolist() != task.tables[0].tolist()


def test_batches_follow_the_context_distribution():
    task = SparseMarkov(vocab=8, order=2, support=3, length=40, seed=0)
    b = task.batch(400, torch.Generator().manual_seed(0))
    x = b["input_ids"]
    assert (x[:, 0] == 0).all() and (x[:, 1:] > 0).all() and (b["labels"][:, 0] == -100).all()
    tokens, probs = task.tables
    counts = torch.zeros(64, 8)
    for t in range(1, 40):
        c = x[:, t - 1] + 8 * (x[:, t - 2] if t >= 2 else 0)  # (x_{t−2}, x_{t−1}), current token least significant
        counts.index_put_((c, x[:, t]), torch.ones(len(x)), accumulate=True)
    busy = counts.sum(1) > 300
    emp = counts[busy] / counts[busy].sum(1, keepdim=True)
    want = torch.zeros(64, 8).scatter_(1, tokens, probs)[busy]
    assert busy.sum() >= 10 and (emp - want).abs().max() < 0.1


def test_true_nll_is_minus_log_of_the_table_probability():
    task = SparseMarkov(vocab=8, order=2, support=2, length=6, seed=3)
    x = task.batch(5, torch.Generator().manual_seed(1))["input_ids"]
    tokens, probs = task.tables
    nll = task.true_nll(x)
    for b in range(5):
        for t in range(1, 6):
            c = int(x[b, t - 1]) + 8 * (int(x[b, t - 2]) if t >= 2 else 0)
            p = dict(zip(tokens[c].tolist(), probs[c].tolist()))[int(x[b, t])]
            assert float(nll[b, t - 1]) == pytest.approx(-math.log(p), rel=1e-5)
    assert 0 < task.entropy() < math.log(2)
