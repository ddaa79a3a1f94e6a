import torch

from lab.data.arith import TrickyArithmetic
from lab.models import tiny_llama
from lab.widgets.critical import (
    critical_explorer,
    critical_figure,
    dynamics_figure,
    replacement_pass_k,
    trajectory_items,
)

from ..align.test_cdpo import always

TASK = TrickyArithmetic()


def models():
    torch.manual_seed(0)
    V = len(TASK.tokenizer)
    return [tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16).eval() for _ in range(2)]


def scores(pos, neg, prompt, y, beta):
    """s_t = softmax((1 + β)·logits_p − β·logits_n)[y_t] at each response position, from the raw logits."""
    ids, P = torch.cat([prompt, y], 1), prompt.shape[1]
    with torch.no_grad():
        lp, ln = pos(input_ids=ids).logits[0], neg(input_ids=ids).logits[0]
    return torch.stack([((1 + beta) * lp[P - 1 + t] - beta * ln[P - 1 + t]).softmax(-1)[y[0, t]]
                        for t in range(y.shape[1])])


def test_explorer_rescores_marks_and_reports_pass_at_k():
    pos, neg = models()
    q = TASK.questions(3, torch.Generator().manual_seed(0))
    y = TASK.trace(q, -TASK.op_sign[q["kw"]])  # wrong operations: rejected trajectories
    c = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0], [0.5, 0.0, 0.0, 0.0, 0.0]])
    calls = []

    def pass_k(i, t):
        calls.append((i, t))
        return {1: 0.0, 8: 0.0}, {1: 0.5, 8: 1.0}

    box = critical_explorer(pos, neg, TASK.tokenizer, q["prompt"], y, rollouts=c, critical=torch.tensor([0, 2, 1]),
                            pass_k=pass_k)
    ctl = box.controls
    want = scores(pos, neg, q["prompt"][:1], y[:1], beta=1.0)
    torch.testing.assert_close(torch.tensor(box.figure.data[0].z[0]), 1 - want)
    assert list(box.figure.data[1].y) == c[0].tolist()
    assert box.figure.layout.shapes[0].x0 == -0.5  # the critical token (0) is boxed
    assert "@8 0.00 / <b>1.00</b>" in box.readout.value
    ctl["beta"].value = 3.0
    torch.testing.assert_close(box.scores, scores(pos, neg, q["prompt"][:1], y[:1], beta=3.0))
    ctl["trajectory"].value = 1
    assert box.figure.layout.shapes[0].x0 == 1.5 and list(box.figure.data[1].y) == c[1].tolist()
    ctl["position"].value = 3
    tok = TASK.tokenizer.convert_ids_to_tokens([int(y[1, 3])])[0]
    assert f"position 3 <b>{tok}</b>" in box.readout.value
    ctl["position"].value = 0
    ctl["position"].value = 3  # cached: not recomputed
    assert calls.count((1, 3)) == 1


def test_precomputed_view():
    items = [{"label": "a", "tokens": ["+", "3"], "s": torch.tensor([0.1, 0.9]), "c": torch.tensor([0.0, 0.0]),
              "critical": 0},
             {"label": "b", "tokens": ["-", "4"], "s": torch.tensor([0.5, 0.5]), "c": None, "critical": None}]
    fig = critical_figure(items)
    assert len(fig.data) == 3 and [t.visible for t in fig.data] == [True, True, False]
    torch.testing.assert_close(torch.tensor(fig.data[0].z[0]), torch.tensor([0.9, 0.1]))
    buttons = fig.layout.updatemenus[0].buttons
    assert [b.args[0]["visible"] for b in buttons] == [[True, True, False], [False, False, True]]
    assert buttons[0].args[1]["shapes"][0]["x0"] == -0.5 and buttons[1].args[1]["shapes"] == []
    assert fig.layout.shapes[0].x0 == -0.5


def test_replacement_pass_k_by_hand():
    """`always(5)`, correct = all fives, graded through the full set's rows: replacing the wrong 3 recovers every
    rollout, replacing a right 5 loses every one."""
    seen = []

    def grade(rows, r):
        seen.append(rows.tolist())
        return (r == 5).all(-1)

    y, x = torch.tensor([[5, 5, 5, 5], [5, 5, 3, 5]]), torch.tensor([[1, 2], [1, 2]])
    pass_k = replacement_pass_k(always(5), x, y, grade, K=4, ks=[1, 2], generator=torch.Generator().manual_seed(0))
    assert pass_k(1, 2) == ({1: 0.0, 2: 0.0}, {1: 1.0, 2: 1.0}) and seen[-1] == [1]
    assert pass_k(0, 1) == ({1: 1.0, 2: 1.0}, {1: 0.0, 2: 0.0}) and seen[-1] == [0]


def test_trajectory_items_and_dynamics_figure():
    q = TASK.questions(3, torch.Generator().manual_seed(1))
    y = TASK.trace(q, TASK.op_sign[q["kw"]])
    s, c = torch.rand(3, 5), torch.rand(3, 5)
    items = trajectory_items(TASK.tokenizer, q["prompt"], y, s, c, torch.tensor([0, 3, -1]), 2)
    words = TASK.tokenizer.convert_ids_to_tokens(y[1].tolist())
    assert len(items) == 2 and items[1]["tokens"] == words and items[1]["critical"] == 3
    assert items[1]["label"] == TASK.tokenizer.decode(q["prompt"][1]) + " → " + TASK.tokenizer.decode(y[1])
    assert torch.equal(items[1]["s"], s[1]) and torch.equal(items[1]["c"], c[1])
    res = {("dpo", 0.1): {"log": {"step": [0, 5], "chosen": [-1.0, -4.0], "rejected": [-2.0, -9.0]}},
           ("dpo", 0.3): {"log": {"step": [0, 5], "chosen": [-1.0, -8.0], "rejected": [-2.0, -19.0]}},
           ("cdpo", 0.1): {"log": {"step": [0, 5], "chosen": [-1.0, -1.5], "rejected": [-2.0, -3.0]}}}
    fig = dynamics_figure(res, {"dpo": 0.3, "cdpo": 0.1}, title="t")
    assert [t.name for t in fig.data] == ["dpo chosen", "dpo rejected", "cdpo chosen", "cdpo rejected"]
    assert list(fig.data[1].y) == [-2.0, -19.0] and list(fig.data[2].x) == [0, 5]
    assert [t.line.dash for t in fig.data] == ["solid", "dash", "solid", "dash"]
