import torch

from lab.data.mcq import CATEGORIES, CategoryMCQ

TASK = CategoryMCQ()


def category_of(word: str) -> str:
    return next(c for c, ws in CATEGORIES.items() if word in ws)


def test_letter_prompts_have_exactly_one_member_of_the_asked_category():
    for e in TASK.examples(100, torch.Generator().manual_seed(0)):
        lines = e["prompt"].split("\n")
        asked = lines[0].removeprefix("Which of these is ").removesuffix("?")
        options = {line[0]: line[3:] for line in lines[1:-1]}
        assert list(options) == TASK.letters and lines[-1] == "Answer:"
        members = [L for L, w in options.items() if category_of(w) == asked]
        assert members == [e["answer"]]


def test_cloze_prompts_score_the_option_words():
    for e in TASK.examples(50, torch.Generator().manual_seed(1), "cloze"):
        asked = e["prompt"].removeprefix("Which of these is ").removesuffix("? Answer:")
        assert len(e["choices"]) == 4 and e["answer"] in e["choices"]
        assert [category_of(w) == asked for w in e["choices"]].count(True) == 1
    assert TASK.choices("letter") == ["A", "B", "C", "D"] and TASK.choices("cloze") is None
