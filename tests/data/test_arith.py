import pytest
import torch

from lab.data.arith import IGNORE, POSITIONS, PROMPT_LEN, RESPONSE_LEN, TrickyArithmetic, take

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


def test_take_and_grader_select_rows():
    task = TrickyArithmetic(max_step=2)
    q = task.questions(6, torch.Generator().manual_seed(4))
    rows = torch.tensor([4, 1])
    sub = take(q, rows)
    assert set(sub) == set(q) and all(sub[k].tolist() == [q[k][4].tolist(), q[k][1].tolist()] for k in q)
    right = task.trace(q, task.op_sign[q["kw"]])
    wrong = right.clone()
    wrong[:, 4] = wrong[:, 3]  # no <eos>: malformed
    r = torch.stack([right[rows], wrong[rows]], 1)  # (2, 2, L): per row the right then the wrong trace
    assert task.grader(q)(rows, r).tolist() == [[True, False], [True, False]]


class Oracle(torch.nn.Module):
    """Writes the trace of the question in its prompt, with the tricky keywords' operations flipped when
    `flip_tricky`."""

    def __init__(self, task: TrickyArithmetic, flip_tricky: bool):
        super().__init__()
        self.task, self.flip = task, flip_tricky

    def forward(self, input_ids):
        t = self.task
        V, digit = len(t.tokenizer), {t.tokenizer.convert_tokens_to_ids(str(d)): d for d in range(t.modulus)}
        kw = {t.tokenizer.convert_tokens_to_ids(f"K{i}"): i for i in range(t.n_keywords)}
        logits = torch.zeros(*input_ids.shape, V)
        for n, row in enumerate(input_ids.tolist()):
            q = {"digits": torch.tensor([[digit[x] for x in row[1:4]]]),
                 "kw": torch.tensor([[kw[x] for x in row[4:6]]])}
            sign = t.op_sign[q["kw"]]
            if self.flip:
                sign = torch.where(q["kw"] < t.n_tricky, -sign, sign)
            logits[n, -1, t.trace(q, sign)[0, len(row) - PROMPT_LEN]] = 50.0
        return type("Out", (), {"logits": logits})()


def test_greedy_accuracy_by_hand_and_chance_levels():
    task = TrickyArithmetic(max_step=2)
    q = task.questions(40, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(0)
    assert task.greedy_accuracy(Oracle(task, False), q, generator=g) == {"all": 1.0, "tricky": 1.0, "plain": 1.0}
    sign = {f"K{i}": int(v) for i, v in enumerate(task.op_sign)}
    flipped = {k: -v if int(k[1:]) < task.n_tricky else v for k, v in sign.items()}
    ok, tricky = [], []
    for p in q["prompt"]:  # by hand: the flipped trace is right when it lands on the true final digit
        words = task.tokenizer.convert_ids_to_tokens(p.tolist())
        ok.append(naive(words, flipped) == naive(words, sign))
        tricky.append(int(words[4][1:]) < task.n_tricky or int(words[5][1:]) < task.n_tricky)
    acc = task.greedy_accuracy(Oracle(task, True), q, generator=g)
    share = lambda rows: sum(ok[i] for i in rows) / len(rows)
    assert acc == pytest.approx({"all": share(range(40)), "tricky": share([i for i in range(40) if tricky[i]]),
                                 "plain": share([i for i in range(40) if not tricky[i]])})
    assert acc["plain"] == 1.0 and acc["tricky"] < 0.5
    assert task.chance() == {"random position": 1 / RESPONSE_LEN, "random operation token": 0.5}
    assert POSITIONS.index("s2") == 3 and len(POSITIONS) == RESPONSE_LEN


def test_wording_tokens_are_free_and_graded_like_the_plain_task():
    """With n_wordings > 0 each response opens with W0..W{n-1}: uniform in the base traces, irrelevant to the grade
    (the same trace under every wording is graded alike, and as the plain task grades it), and required (a trace
    without one is malformed); the operation positions shift by one."""
    task, plain = TrickyArithmetic(max_step=2, n_wordings=4), TrickyArithmetic(max_step=2)
    g = torch.Generator().manual_seed(6)
    q = task.questions(300, g)
    assert task.response_len == RESPONSE_LEN + 1 and plain.response_len == RESPONSE_LEN
    assert task.positions == ("wording", *POSITIONS) and task.operations == (1, 3) and plain.operations == (0, 2)
    flipped = torch.where(q["kw"] < task.n_tricky, -task.op_sign[q["kw"]], task.op_sign[q["kw"]])
    body = plain.trace(q, flipped)
    truth = plain.grade(q, body)
    assert set(truth.tolist()) == {True, False}
    for w in range(4):
        r = task.trace(q, flipped, torch.full((300,), w))
        assert r.shape == (300, 6) and torch.equal(r[:, 1:], task.trace(q, flipped)[:, 1:])
        assert task.tokenizer.convert_ids_to_tokens(r[0, 0].item()) == f"W{w}"
        assert torch.equal(task.grade(q, r), truth) and torch.equal(task.final_answer(r), plain.final_answer(body))
    digit_first = torch.cat([body[:, :1], body], 1)  # a digit where the wording belongs
    assert (task.final_answer(digit_first) == -1).all()
    ids = task.batch(4000, g)["input_ids"][:, PROMPT_LEN]
    counts = torch.bincount(ids - ids.min(), minlength=4)
    assert len(counts) == 4 and counts.min() > 900  # uniform over the four wordings
    with pytest.raises(ValueError):
        TrickyArithmetic(n_wordings=-1)
