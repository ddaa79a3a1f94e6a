import pytest
import torch

from lab.data.vqa import POSITIONS, QUESTIONS, SYNONYMS, TEXTUAL, VISUAL, VisualQA

W = VisualQA()


def test_the_object_sits_in_its_quadrant_with_its_colour():
    s = W.sample(64, torch.Generator().manual_seed(0))
    patches = W.patches(s["image"])  # (n, 4, 48)
    assert patches.shape == (64, 4, 48)
    energy = patches.pow(2).sum(-1)  # the object's patch is far brighter than the noise
    assert torch.equal(energy.argmax(1), s["object"][:, 2])
    i = 0
    c, _, p = s["object"][i].tolist()
    quad = patches[i, p].view(3, 4, 4).sum((1, 2))
    assert int(quad.argmax()) == {0: 0, 1: 1, 2: 2, 3: 0}[c]  # red, green, blue, yellow(R≈G: R wins by 0.05)


def test_answers_and_clean_questions():
    assert W.answer([0, 1, 2], 0) == ["red", "cross", POSITIONS[2]]
    assert W.answer([3, 2, 1], 1) == ["yellow"] and W.answer([3, 2, 1], 3) == [POSITIONS[1]]
    assert W.question(0) == QUESTIONS["describe"].split()
    ids = W.tokenizer(" ".join(W.question(1) + W.answer([0, 0, 0], 0)), add_special_tokens=False)["input_ids"]
    assert W.tokenizer.unk_token_id not in ids


def test_textual_shifts_use_unseen_tokens_at_their_rates():
    g = torch.Generator().manual_seed(1)
    qs = [W.question(k % 4, "synonym", 70, g) for k in range(400)]
    replaced = sum(w in SYNONYMS.values() for q in qs for w in q) / sum(len(q) for q in qs)
    assert replaced == pytest.approx(0.7, abs=0.05)
    typo = W.question(0, "typo", 3, g)
    assert sum(w.endswith("~") for w in typo) == 3
    seen = set(W.question_words)
    assert not (set(SYNONYMS.values()) & seen) and all(w + "~" not in seen for w in seen)
    with pytest.raises(ValueError):
        W.question(0, "paraphrase", 1)


def test_visual_shift_severity_orders_the_distance_from_the_clean_image():
    img = W.sample(32, torch.Generator().manual_seed(2))["image"]
    for kind in ("blur", "frost"):
        d = [(W.shift_image(img, kind, s) - img).norm().item() for s in (1, 3, 5)]
        assert d[0] < d[1] < d[2]
    assert torch.equal(W.shift_image(img, "clean", 0), img)
    assert len(VISUAL) * len(TEXTUAL) == 35


def test_encoding_and_training_batches():
    g = torch.Generator().manual_seed(3)
    s = W.sample(16, g)
    e = W.encode(s, visual=("blur", 3), textual=("typo", 1), generator=g)
    assert e["patches"].shape == (16, 4, 48) and e["prompt"].shape == (16, 5) and e["answer"].shape == (16, 4)
    tok = W.tokenizer
    for i in range(16):
        words = tok.convert_ids_to_tokens(e["prompt"][i].tolist())
        assert words[0] == "<bos>" and [w for w in words[1:] if w != "?"] == e["question"][i]
        assert tok.convert_ids_to_tokens(e["answer"][i].tolist())[: len(e["reference"][i]) + 1] == \
            e["reference"][i] + ["<eos>"]
    torch.testing.assert_close(e["patches"], W.patches(W.shift_image(s["image"], "blur", 3)))
    b = W.batch(8, g)
    assert b["input_ids"].shape == (8, 9) and (b["labels"][:, :5] == -100).all()
    assert ((b["labels"] == tok.eos_token_id).sum(1) == 1).all() and not (b["labels"] == tok.pad_token_id).any()


def test_words_stop_at_the_first_eos():
    tok = W.tokenizer
    ids = torch.tensor([tok.convert_tokens_to_ids(r) for r in (["red", "cross", "<eos>", "<pad>"],
                                                               ["blue", "dot", "top-left", "bar"],
                                                               ["<eos>", "red", "<eos>", "<pad>"])])
    assert W.words(ids) == [["red", "cross"], ["blue", "dot", "top-left", "bar"], []]
