import pytest
import torch

from lab.data.letters import ASK, DELIM, IGNORE, LetterRetrieval

TASK = LetterRetrieval()


def naive_letter(words: list[str], f: dict[str, str]) -> str:
    """Reference: scan the options and return the letter whose content is f(question)."""
    segments, cur = [], []
    for w in words[1:-1]:
        if w == DELIM:
            segments.append(cur)
            cur = []
        elif w != "_":
            cur.append(w)
    hits = [s[0] for s in segments if s[1] == f[words[-1]]]
    assert len(hits) == 1
    return hits[0]


@pytest.mark.parametrize("task", [TASK, LetterRetrieval(n_labels=8), LetterRetrieval(max_filler=0, n_labels=6)])
def test_letter_prompts_have_one_correct_option_and_a_fixed_length(task):
    TASK = task
    f = {q: TASK.contents[i] for q, i in zip(TASK.questions, TASK.knowledge.tolist())}
    ex = TASK.examples(200, torch.Generator().manual_seed(0))
    lengths = {len(e["prompt"].split()) for e in ex}
    assert lengths == {2 + TASK.n_options * (3 + TASK.max_filler)}
    for e in ex:
        words = e["prompt"].split()
        assert e["answer"] == naive_letter(words, f)
        assert words[e["delim_pos"]] == DELIM and words[e["delim_pos"] - 1] != DELIM
        seg_start = max(i for i in range(e["delim_pos"]) if words[i] in TASK.letters)
        assert words[seg_start] == e["answer"]
        labels = [w for w in words if w in TASK.letters]
        assert len(labels) == len(set(labels)) == TASK.n_options
        if not TASK.n_labels:
            assert labels == TASK.letters
    # options move (with filler) or letters are shuffled: no positional shortcut; every letter is an answer
    assert len({e["delim_pos"] for e in ex if e["answer"] == "B"}) > 2
    assert {e["answer"] for e in ex} == set(TASK.letters)


def test_bad_label_count():
    with pytest.raises(ValueError, match="n_labels"):
        LetterRetrieval(n_labels=3)


def test_cloze_and_batches():
    for e in TASK.examples(20, torch.Generator().manual_seed(1), "cloze"):
        bos, ask, q = e["prompt"].split()
        assert ask == ASK and e["answer"] == TASK.contents[TASK.knowledge[TASK.questions.index(q)]]
    g = torch.Generator().manual_seed(2)
    kinds = set()
    for _ in range(30):
        b = TASK.batch(8, g)
        assert (b["labels"][:, :-1] == IGNORE).all() and (b["labels"][:, -1] == b["input_ids"][:, -1]).all()
        kinds.add(b["input_ids"].shape[1])
    assert kinds == {4, 2 + TASK.n_options * (3 + TASK.max_filler) + 1}  # cloze and letter batches


def test_tokenizer_round_trip_and_bad_kind():
    e = TASK.examples(1, torch.Generator().manual_seed(3))[0]
    ids = TASK.tokenizer(e["prompt"], add_special_tokens=False)["input_ids"]
    assert TASK.tokenizer.unk_token_id not in ids and TASK.tokenizer.decode(ids) == e["prompt"]
    with pytest.raises(ValueError):
        TASK.examples(1, torch.Generator(), "essay")
