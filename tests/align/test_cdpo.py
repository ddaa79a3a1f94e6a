import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lab.align import LOSSES
from lab.align import cdpo as C
from lab.models import tiny_llama

V = 12


class Stub(nn.Module):
    """A causal LM whose next-token logits depend only on the last token: logits = table[last]."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = nn.Parameter(table.float())

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.table[input_ids]})()


def always(token: int, sharp: float = 20.0) -> Stub:
    table = torch.zeros(V, V)
    table[:, token] = sharp
    return Stub(table)


def rand_logps(B=4, L=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [-torch.rand(B, L, generator=g) * 3 for _ in range(4)]


def test_cdpo_is_dpo_when_no_token_is_critical_and_drops_fully_critical_rejected_terms():
    pi_w, ref_w, pi_l, ref_l = rand_logps()
    zero, one = torch.zeros(4, 5), torch.ones(4, 5)
    dpo = LOSSES["dpo"](torch.stack([pi_w.sum(1), pi_l.sum(1)], 1), torch.stack([ref_w.sum(1), ref_l.sum(1)], 1),
                        beta=0.3)
    torch.testing.assert_close(C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, zero, gamma=0.3), dpo, atol=1e-6, rtol=0)
    only_w = -F.logsigmoid(0.3 * (pi_w - ref_w).sum(1))
    torch.testing.assert_close(C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, one, gamma=0.3), only_w, atol=1e-6, rtol=0)


def test_positionwise_variant_by_hand_and_bad_variant():
    pi_w, ref_w, pi_l, ref_l = rand_logps(B=2, L=3, seed=1)
    s = torch.tensor([[0.0, 0.5, 1.0], [0.2, 0.2, 0.9]])
    want = torch.tensor([sum(-math.log(1 / (1 + math.exp(-0.5 * ((pi_w[b, t] - ref_w[b, t])
                                                                 - (1 - s[b, t]) * (pi_l[b, t] - ref_l[b, t])).item())))
                             for t in range(3)) / 3 for b in range(2)])
    got = C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, s, gamma=0.5, variant="official_positionwise")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="variant"):
        C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, s, variant="sum")


def test_scores_get_no_gradient_and_the_weights_scale_the_rejected_gradient():
    pi_w, ref_w, pi_l, ref_l = rand_logps(B=1, L=4, seed=2)
    pi_l.requires_grad_(True)
    s = torch.tensor([[0.0, 1.0, 0.5, 0.25]], requires_grad=True)
    C.cdpo_loss(pi_w, ref_w, pi_l, ref_l, s).sum().backward()
    assert s.grad is None or torch.all(s.grad == 0)
    g = pi_l.grad[0]
    assert g[1] == 0 and torch.allclose(g[2], 0.5 * g[0]) and torch.allclose(g[3], 0.75 * g[0])


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(6, 0, 2), (6, 2, 1), (6, 2, 3), (5, 5, 4), (7, 3, 7)]:
        outcomes = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(range(n), k))
        brute = sum(any(outcomes[i] for i in sub) for sub in subsets) / len(subsets)
        assert C.pass_at_k(n, c, k) == pytest.approx(brute)


def test_critical_token_rule():
    c = torch.tensor([[0.8, 0.5, 0.0, 0.0, 0.0],  # first zero with nothing after it -> 2
                      [0.3, 0.0, 0.10, 0.0, 0.0],  # a later prefix recovers 10% > 5%: reset -> 3
                      [0.3, 0.0, 0.04, 0.0, 0.0],  # 4% < 5%: still 1
                      [0.9, 0.9, 0.9, 0.9, 0.9]])  # never zero -> -1
    assert C.critical_token(c).tolist() == [2, 3, 1, -1]


def test_selection_follows_the_official_rules():
    # answers of 10 samples; correct answer 7 (never -1)
    answers = torch.tensor([[7, 3, 3, 3, 5, 5, 2, 7, -1, 4],
                            [7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
                            [1, 1, 2, -1, 3, 4, 5, 6, 8, 9]])
    correct = answers == 7
    sel = C.select(answers, correct, top_p=0.5)
    # wrong parsable: 3x3, 5x2, 2, 4 (7 samples): 3 covers 3/7 < 0.5, 5 (count 2) brings 5/7 -> stop
    assert sel[0] == {"pos": 0, "neg": [1, 4]}
    assert sel[1] is None and sel[2] is None  # no wrong answer / no correct answer
    # after the first, answers seen once are not added
    only_singles = C.select(torch.tensor([[7, 1, 2, 3, 4]]), torch.tensor([[True, False, False, False, False]]))
    assert only_singles[0] == {"pos": 0, "neg": [1]}


def test_ce_scores_equal_the_log_prob_formula_and_flag_the_negative_models_token():
    torch.manual_seed(0)
    pos, neg = (tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16).eval() for _ in range(2))
    x, y = torch.randint(V, (3, 4)), torch.randint(V, (3, 5))
    ids = torch.cat([x, y], 1)
    lp = pos(input_ids=ids).logits[:, 3:-1].log_softmax(-1)
    ln = neg(input_ids=ids).logits[:, 3:-1].log_softmax(-1)
    want = ((2 * lp - ln).log_softmax(-1)).gather(-1, y[..., None])[..., 0].exp()  # beta = 1, normalised over V
    torch.testing.assert_close(C.ce_scores(pos, neg, x, y, beta=1.0), want.detach(), atol=1e-5, rtol=1e-4)
    p_pos = lp.exp().gather(-1, y[..., None])[..., 0].detach()
    torch.testing.assert_close(C.ce_scores(pos, neg, x, y, beta=0.0), p_pos)
    # stubs: the positive model writes 5, the negative one 7; a rejected trajectory with 7 at position 2
    y = torch.tensor([[5, 5, 7, 5, 5]])
    s = C.ce_scores(always(5), always(7), torch.tensor([[1, 2]]), y)
    assert int(s.argmin()) == 2
    # the named wrong variant: positive and negative models swapped -> the critical token is missed
    assert int(C.ce_scores(always(7), always(5), torch.tensor([[1, 2]]), y).argmin()) != 2


def test_rollouts_and_replacement_with_a_deterministic_model():
    model = always(5)
    y = torch.tensor([[5, 5, 3, 5], [5, 5, 5, 5]])
    prompts = torch.tensor([[1, 2], [1, 2]])
    grade = lambda rows, r: (r == 5).all(-1)  # correct = all fives
    g = torch.Generator().manual_seed(0)
    c = C.rollout_correctness(model, prompts, y, grade, K=4, generator=g, temperature=0)
    assert c.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert C.critical_token(c).tolist() == [2, -1]
    kept, swapped = C.replacement(model, prompts[:1], y[:1], torch.tensor([2]), grade, K=4, generator=g)
    assert not kept.any() and swapped.all()  # banning the 3 leaves the model's 5, and all rollouts recover
    kept, swapped = C.replacement(model, prompts[:1], y[:1], torch.tensor([1]), grade, K=4, generator=g)
    assert not swapped.any()  # banning a correct 5 forces a mistake


def test_sample_shapes_greedy_and_ban():
    g = torch.Generator().manual_seed(0)
    out = C.sample_responses(always(5), torch.tensor([[1, 2], [3, 4]]), 3, 4, generator=g)
    assert out.shape == (2, 3, 4) and (out == 5).all()
    banned = C.sample(always(5), torch.tensor([[1, 2]]), 2, generator=g, temperature=0, ban=torch.tensor([5]))
    assert banned[0, 0] != 5 and banned[0, 1] == 5


def test_training_arms_and_sft_run_and_log():
    torch.manual_seed(0)
    base = tiny_llama(vocab_size=V, d_model=16, n_layers=1, n_heads=2, max_len=16).eval()
    x, yw, yl = torch.randint(V, (8, 3)), torch.randint(V, (8, 4)), torch.randint(V, (8, 4))
    pairs = {"prompt": x, "chosen": yw, "rejected": yl, "s": torch.rand(8, 4)}
    w0 = [p.clone() for p in base.parameters()]
    for arm in ("dpo", "rpo", "cdpo", "cdpo_positionwise"):
        policy, log = C.train_arm(base, pairs, arm, steps=6, lr=1e-2, gamma=0.5, batch_size=4, every=3, quiet=True)
        assert log["step"] == [0, 3, 6] and len(log["loss"]) == 6
        assert log["rejected"][-1] < log["rejected"][0]  # every arm pushes the rejected responses down
    assert all(torch.equal(a, b) for a, b in zip(w0, base.parameters()))  # the reference is untouched
    losses = C.fine_tune(base, x, yw, steps=30, lr=1e-2, batch_size=8, quiet=True)
    assert losses[-1] < losses[0]
