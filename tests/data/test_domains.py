import pytest
import torch

from lab.data.domains import MarkovDomains, rouge_l

D = MarkovDomains()


def test_answers_follow_the_domains_preferred_successors():
    g = torch.Generator().manual_seed(0)
    for domain in ("source", "target"):
        pi, _ = D.chains[domain]
        s = D.sample(50, domain, g)
        assert s["input"].shape == (50, D.passage + 3) and s["answer"].shape == (50, D.answer + 1)
        word = {int(i): w for w, i in zip(range(D.n_words), D.word_ids)}
        for x, y in zip(s["input"], s["answer"]):
            prev = word[int(x[-2])]  # the passage's last word
            for tok in y[:-1]:
                assert word[int(tok)] == int(pi[prev])
                prev = int(pi[prev])
            assert int(y[-1]) == D.tokenizer.eos_token_id and D.tokenizer.eos_token_id not in x.tolist()


def test_the_target_redraws_a_share_of_the_successors_and_passages_follow_their_chain():
    pi_s, _ = D.chains["source"]
    pi_t, _ = D.chains["target"]
    moved = (pi_s != pi_t).float().mean().item()
    assert 0.2 < moved <= D.shift + 0.1
    s = D.sample(400, "target", torch.Generator().manual_seed(1))
    words = s["input"][:, 2:-1] - D.word_ids[0]
    follows = (pi_t[words[:, :-1]] == words[:, 1:]).float().mean().item()
    assert follows == pytest.approx(D.p_next + (1 - D.p_next) / D.n_words, abs=0.03)


def test_pretraining_batches_are_source_with_full_lm_loss():
    b = D.batch(8, torch.Generator().manual_seed(2))
    assert torch.equal(b["input_ids"], b["labels"]) and b["input_ids"].shape == (8, D.passage + D.answer + 4)


def test_rouge_l_by_hand():
    assert rouge_l([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert rouge_l([1, 3, 5], [1, 2, 3]) == pytest.approx(2 / 3)  # LCS [1, 3]: p = r = 2/3
    assert rouge_l([9], [1, 2]) == 0.0 and rouge_l([], [1]) == 0.0
