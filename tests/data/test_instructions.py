import pytest
import torch

from lab.data.instructions import IGNORE, KINDS, TASKS, InstructionWorld

W = InstructionWorld()


def naive_target(task: str, digits: list[int]) -> list[int]:
    return {"COPY": digits, "REV": digits[::-1], "INC": [(d + 1) % 10 for d in digits]}[task]


def test_prompts_kinds_and_ideal_responses():
    g = torch.Generator().manual_seed(0)
    p = W.prompts(600, g)
    frac = torch.bincount(p["kind"], minlength=4).float() / 600
    assert abs(frac[0] - 0.55) < 0.06 and (frac[1:] > 0.1).all()
    y = W.ideal(p)
    for i in range(40):
        words = W.tokenizer.convert_ids_to_tokens(p["prompt"][i].tolist())
        out = W.tokenizer.convert_ids_to_tokens(y[i].tolist())
        if KINDS[p["kind"][i]] == "truncated":
            assert words[3:8] == ["_"] * 5 and out[0] == "<eos>"
        else:
            want = naive_target(TASKS[p["task"][i]], [int(w) for w in words[2:8]])
            assert [int(w) for w in out[:6]] == want and out[6] == "<eos>"


def test_judge_by_kind():
    g = torch.Generator().manual_seed(1)
    p = W.prompts(400, g)
    y = W.ideal(p)[:, None].expand(-1, 3, -1)
    r = W.reward(p, y, g)
    k = p["kind"]
    assert (r[k == 0] == 1).all()  # ideal answers to clean prompts
    assert (r[k == 3] <= 0.1).all() and (r[k == 3] > 0).all()  # clarifying at once: a small reward
    assert r[k == 2].std() > 0.2 and (r[k == 1] < 1).any()  # random / ambiguous judgments
    half = y.clone()
    half[..., 3:] = W.eos  # stop after 3 digits: 3 of 6 positions
    assert torch.allclose(W.reward(p, half, g)[k == 0], torch.tensor(0.5))
    assert (W.length(half[k == 0]) == 3).all() and (W.length(y[k == 3]) == 0).all()


def test_sft_batch_and_spec():
    b = W.batch(64, torch.Generator().manual_seed(2))
    assert b["input_ids"].shape == (64, 16) and (b["labels"][:, :9] == IGNORE).all()
    lab = b["labels"][:, 9:]
    assert ((lab == W.eos).sum(1) == 1).all()  # the loss stops at the first <eos>
    with pytest.raises(ValueError):
        InstructionWorld(bad_frac=1.0)


class Always(torch.nn.Module):
    """A causal LM that always puts (almost) all its mass on one token (of the world's vocabulary by default)."""

    def __init__(self, token: int, vocab: int = len(W.tokenizer)):
        super().__init__()
        self.token, self.vocab = token, vocab

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., self.token] = 50.0
        return type("Out", (), {"logits": logits})()


def test_model_reward_by_hand():
    """A model that always writes 0 on clean prompts: its reward is the share of 0s among the 6 target digits,
    greedy and sampled alike; one that answers <eos> at once gets nothing."""
    g = torch.Generator().manual_seed(4)
    p = W.prompts(50, g, bad_frac=0.0)
    zeros = [naive_target(TASKS[int(t)], [int(d) for d in row]).count(0) / 6 for t, row in zip(p["task"], p["payload"])]
    got = W.model_reward(Always(W.tokenizer.convert_tokens_to_ids("0")), p, g, samples=3)
    assert got == pytest.approx({"greedy": sum(zeros) / 50, "sampled": sum(zeros) / 50}, abs=1e-6)
    assert W.model_reward(Always(W.eos), p, g) == {"greedy": 0.0, "sampled": 0.0}
