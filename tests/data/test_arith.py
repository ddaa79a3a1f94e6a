import pytest
import torch

from lab.data.arith import IGNORE, PROMPT_LEN, RESPONSE_LEN, TrickyArithmetic

TASK = TrickyArithmetic()


def naive(words: list[str], sign: dict[str, int], m: int = 10) -> str:
    """Reference answer from the prompt's words, <bos> a b c k1 k2 =."""
    a, b, c, k1, k2 = words[1:6]
    s1 = (int(a) + sign[k1] * int(b)) % m
    return str((s1 + sign[k2] * int(c)) % m)


def test_true_traces_are_graded_correct_and_match_a_naive_computation():
    g = torch.Generator().manual_seed(0)
    q = TASK.questions(200, g)
    sign = {f"K{i}": int(v) for i, v in enumerate(TASK.op_sign)}
    r = TASK.trace(q, TASK.op_sign[q["kw"]])
    assert q["prompt"].shape == (200, PROMPT_LEN) and r.shape == (200, RESPONSE_LEN)
    assert TASK.grade(q, r).all()
    for p, resp in zip(q["prompt"][:50], r[:50]):
        words = TASK.tokenizer.convert_ids_to_tokens(p.tolist())
        out = TASK.tokenizer.convert_ids_to_tokens(resp.tolist())
        assert out[3] == naive(words, sign) and out[-1] == "<eos>"
        assert out[0] == ("+" if sign[words[4]] > 0 else "-")


def test_malformed_and_wrong_responses():
    g = torch.Generator().manual_seed(1)
    q = TASK.questions(4, g)
    r = TASK.trace(q, TASK.op_sign[q["kw"]])
    bad = r.clone()
    bad[:, 4] = bad[:, 3]  # no <eos>
    assert (TASK.final_answer(bad) == -1).all() and not TASK.grade(q, bad).any()
    grid = torch.stack([r, r], 1)  # (n, k, L)
    assert TASK.grade(q, grid).all()


def test_flipped_traces_use_the_wrong_operation_only_for_tricky_keywords():
    task = TrickyArithmetic(flip=1.0)
    b = task.batch(300, torch.Generator().manual_seed(2))
    ids = b["input_ids"]
    assert (b["labels"][:, :PROMPT_LEN] == IGNORE).all() and (b["labels"][:, PROMPT_LEN:] == ids[:, PROMPT_LEN:]).all()
    kw = torch.tensor([int(w[1:]) for w in task.tokenizer.convert_ids_to_tokens(ids[:, 4].tolist())])
    plus = ids[:, PROMPT_LEN] == task.tokenizer.convert_tokens_to_ids("+")
    true_plus = task.op_sign[kw] > 0
    tricky = kw < task.n_tricky
    assert (plus[tricky] != true_plus[tricky]).all() and (plus[~tricky] == true_plus[~tricky]).all()


def test_small_steps_modulus_and_bad_specs():
    task = TrickyArithmetic(modulus=5, max_step=2)
    q = task.questions(100, torch.Generator().manual_seed(3))
    assert q["digits"][:, 0].max() <= 4 and q["digits"][:, 1:].min() >= 1 and q["digits"][:, 1:].max() <= 2
    assert task.grade(q, task.trace(q, task.op_sign[q["kw"]])).all()
    assert set(task.tricky(q).tolist()) == {True, False}
    for bad in ({"flip": 1.5}, {"n_tricky": 9}, {"modulus": 11}, {"max_step": 10}):
        with pytest.raises(ValueError):
            TrickyArithmetic(**bad)
