import pytest
import torch

from lab.data import KVRecall
from lab.data.kv_recall import IGNORE

TASK = KVRecall(n_pairs=3, n_keys=8, n_values=5, n_queries=2)


def naive_answer(words: list[str], key: str) -> str:
    """The value right after `key`'s first occurrence: a reference lookup."""
    return words[words.index(key) + 1]


def test_batch_shapes_labels_and_answers():
    b = TASK.batch(64, torch.Generator().manual_seed(0))
    x, y = b["input_ids"], b["labels"]
    assert x.shape == y.shape == (64, TASK.seq_len)
    tok = TASK.tokenizer
    for row, lab in zip(x.tolist(), y.tolist()):
        words = tok.convert_ids_to_tokens(row)
        keys = words[0:2 * TASK.n_pairs:2]
        assert len(set(keys)) == TASK.n_pairs and all(k.startswith("k") for k in keys)
        scored = [i for i, t in enumerate(lab) if t != IGNORE]
        assert len(scored) == TASK.n_queries
        for i in scored:  # each scored token is "? key VALUE" with VALUE the key's value in the context
            assert words[i - 2] == "?" and words[i] == naive_answer(words, words[i - 1]) and lab[i] == row[i]


def test_ids_agree_with_the_tokenizer():
    b = TASK.batch(4, torch.Generator().manual_seed(1))
    for row in b["input_ids"].tolist():
        text = " ".join(TASK.tokenizer.convert_ids_to_tokens(row))
        assert TASK.tokenizer(text, add_special_tokens=False)["input_ids"] == row


def test_examples_answer_and_span():
    for e in TASK.examples(50, torch.Generator().manual_seed(2)):
        words = e["prompt"].split()
        assert words[-2] == "?" and e["answer"] == naive_answer(words, words[-1])
        s, t = e["answer_span"]
        assert e["prompt"][s:t] == e["answer"] and e["prompt"][s - len(words[-1]) - 1:s - 1] == words[-1]


def test_seeded_and_different_across_seeds():
    g = lambda s: TASK.batch(8, torch.Generator().manual_seed(s))["input_ids"]
    assert torch.equal(g(0), g(0)) and not torch.equal(g(0), g(1))


def test_values_are_uniform_enough():
    v = TASK.batch(4000, torch.Generator().manual_seed(3))["labels"]
    counts = torch.bincount(v[v != IGNORE], minlength=len(TASK.tokenizer))[-TASK.n_values - 1:-1]
    assert counts.min() > 0.8 * counts.float().mean()


@pytest.mark.parametrize("kw", [dict(n_pairs=9, n_keys=8), dict(n_values=1), dict(n_queries=0)])
def test_bad_specs(kw):
    with pytest.raises(ValueError):
        KVRecall(**kw)


def test_variable_number_of_pairs():
    task = KVRecall(n_pairs=6, n_keys=8, n_values=5, n_queries=2, min_pairs=2)
    b = task.batch(200, torch.Generator().manual_seed(4))
    x, y = b["input_ids"], b["labels"]
    assert x.shape == (200, task.seq_len)
    reals = set()
    for row, lab in zip(x.tolist(), y.tolist()):
        words = task.tokenizer.convert_ids_to_tokens(row)
        ctx = words[: 2 * task.n_pairs]
        n_fill = ctx.count("_")
        assert n_fill % 2 == 0 and ctx[:n_fill] == ["_"] * n_fill  # fillers first
        reals.add(task.n_pairs - n_fill // 2)
        for i in (i for i, t in enumerate(lab) if t != IGNORE):
            assert words[i - 1] in ctx[n_fill:] and words[i] == naive_answer(ctx, words[i - 1])
    assert reals == set(range(2, 7))
    for k in (2, 6):
        for e in task.examples(20, torch.Generator().manual_seed(5), n_pairs=k):
            words = e["prompt"].split()
            assert words.count("_") == 2 * (task.n_pairs - k) and e["answer"] == naive_answer(words, words[-1])
            s, t = e["answer_span"]
            assert e["prompt"][s:t] == e["answer"]
    with pytest.raises(ValueError):
        KVRecall(n_pairs=3, min_pairs=4)
