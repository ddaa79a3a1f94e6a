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


def test_answers_of_a_domain_follow_its_successors_from_the_questions_last_word():
    g = torch.Generator().manual_seed(1)
    word = {int(i): w for w, i in zip(range(D.n_words), D.word_ids)}
    s = D.sample(40, "target", g)
    assert torch.equal(D.answers_of(s["input"], "target"), s["answer"])  # sample's answers are its own domain's
    pi = D.chains["source"][0]
    src = D.answers_of(s["input"], "source")
    for x, y in zip(s["input"], src):
        prev = word[int(x[-2])]
        for tok in y[:-1]:
            prev = int(pi[prev])
            assert word[int(tok)] == prev
        assert int(y[-1]) == D.tokenizer.eos_token_id
    assert (src != s["answer"]).any(1).float().mean() > 0.5  # the shifted successors change most answers


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


def test_answer_scores_match_a_naive_loop():
    from lab.data.domains import answer_scores
    from lab.models import tiny_llama

    torch.manual_seed(0)
    m = tiny_llama(vocab_size=len(D.tokenizer), d_model=16, n_layers=1, n_heads=2, max_len=32).eval()
    data = D.sample(4, "target", torch.Generator().manual_seed(3))
    got = answer_scores(m, data, generator=torch.Generator(), device="cpu")
    hits, rouge, nll, count = 0, 0.0, 0.0, 0
    with torch.no_grad():
        for x, y in zip(data["input"], data["answer"]):
            seq = x.tolist()
            for _ in range(D.answer):  # greedy, one token at a time
                seq.append(int(m(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
            pred, ref = seq[len(x):], y[:-1].tolist()
            hits += sum(int(p == r) for p, r in zip(pred, ref))
            rouge += rouge_l(pred, ref)
            full = torch.cat([x, y]).tolist()
            for t in range(len(x), len(full)):  # every reference token, <eos> included, given its prefix
                nll -= m(input_ids=torch.tensor([full[:t]])).logits[0, -1].log_softmax(-1)[full[t]].item()
                count += 1
    assert got["acc"] == pytest.approx(hits / (4 * D.answer))
    assert got["rougeL"] == pytest.approx(rouge / 4)
    assert got["out_ppl"] == pytest.approx(torch.tensor(nll / count).exp().item(), rel=1e-5)


def test_leaks_count_answer_material_in_a_stream_of_questions():
    s = D.sample(3, "target", torch.Generator().manual_seed(4))
    clean = [s["input"][i:i + 1] for i in range(3)]
    assert D.leaks(clean) == 0
    eos = torch.tensor([[D.tokenizer.eos_token_id]])
    with_answer = torch.cat([s["input"][:1], s["answer"][:1]], 1)  # an <eos> and the wrong length: 2
    eos_in_place = torch.cat([s["input"][:1, :-1], eos], 1)  # an <eos>, the right length: 1
    assert D.leaks([*clean, with_answer, eos_in_place]) == 2 + 1
    assert D.leaks([s["input"][:1, :-1]]) == 1  # a cut question: the wrong length only


def test_retention_domains_add_an_unrelated_chain_and_keep_source_and_target():
    from lab.data.domains import RetentionDomains

    R = RetentionDomains()
    for d in ("source", "target"):  # exactly MarkovDomains' chains
        assert all(torch.equal(a, b) for a, b in zip(R.chains[d], D.chains[d]))
    pi_r, start_r = R.chains["retain"]
    assert sorted(pi_r.tolist()) == list(range(R.n_words)) and start_r.sum().item() == pytest.approx(1.0)
    assert (pi_r == R.chains["source"][0]).float().mean() < 0.2  # not the source chain
    s = R.retained(30, torch.Generator().manual_seed(5))
    a_id = R.tokenizer.convert_tokens_to_ids("A")
    assert (s["input"][:, 1] == a_id).all() and (s["input"][:, -1] == a_id).all()
    word = {int(i): w for w, i in zip(range(R.n_words), R.word_ids)}
    for x, y in zip(s["input"], s["answer"]):  # answers follow pi_R from the passage's last word
        prev = word[int(x[-2])]
        for tok in y[:-1]:
            assert word[int(tok)] == int(pi_r[prev])
            prev = int(pi_r[prev])


def test_retention_pretraining_batches_mix_source_and_retention_questions():
    from lab.data.domains import RetentionDomains

    R = RetentionDomains()
    b = R.batch(64, torch.Generator().manual_seed(6))
    assert torch.equal(b["input_ids"], b["labels"]) and b["input_ids"].shape == (64, R.passage + R.answer + 4)
    markers = b["input_ids"][:, 1]
    assert int((markers == R.tokenizer.convert_tokens_to_ids("A")).sum()) == 16  # retain_frac 0.25 of 64
    assert int((markers == R.tokenizer.convert_tokens_to_ids("Q")).sum()) == 48
    assert not (markers[:16] == R.tokenizer.convert_tokens_to_ids("A")).all()  # rows shuffled
