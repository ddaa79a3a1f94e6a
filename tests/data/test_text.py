"""Calibration text from local files through `datasets`, cut into token blocks."""

from __future__ import annotations

import json

import pytest

from lab.data.text import DataNotAvailable, load_texts, token_blocks
from lab.models.tokenizer import word_tokenizer


def test_txt_and_jsonl_give_the_same_documents(tmp_path):
    docs = ["a b c", "", "d e", "f"]
    (tmp_path / "c.txt").write_text("\n".join(docs) + "\n")
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert load_texts(str(tmp_path / "c.txt")) == ["a b c", "d e", "f"]
    assert load_texts(str(tmp_path / "c.jsonl")) == ["a b c", "d e", "f"]
    assert load_texts(str(tmp_path / "c.jsonl"), n=2) == ["a b c", "d e"]
    assert sorted(load_texts(str(tmp_path / "c.jsonl"), seed=3)) == ["a b c", "d e", "f"]


def test_token_blocks_concatenate_and_chunk():
    tok = word_tokenizer(list("abcdefg"))
    blocks = token_blocks(["a b c", "d e", "f g a b"], tok, n_blocks=5, block_len=3)
    ids = tok("a b c d e f g a b", add_special_tokens=False)["input_ids"]
    assert blocks.tolist() == [ids[0:3], ids[3:6], ids[6:9]]
    assert token_blocks(["a b c", "d e", "f g a b"], tok, n_blocks=2, block_len=4).tolist() == [ids[0:4], ids[4:8]]
    with pytest.raises(DataNotAvailable, match="fewer than one block"):
        token_blocks(["a b"], tok, n_blocks=1, block_len=3)


def test_bad_data_is_one_sentence(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\0")
    with pytest.raises(DataNotAvailable, match="must be a .txt"):
        load_texts(str(tmp_path / "x.bin"))
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "a"}) + "\n")
    with pytest.raises(DataNotAvailable, match="no 'text' column"):
        load_texts(str(tmp_path / "c.jsonl"))
    with pytest.raises(DataNotAvailable, match="local Hugging Face cache"):
        load_texts("no-such-org/no-such-dataset")


def test_halves_split_the_blocks_in_order_and_refuse_too_little(tmp_path):
    from lab.core.params import ParamError
    from lab.data.text import halves

    tok = word_tokenizer([f"w{i}" for i in range(10)])
    (tmp_path / "t.txt").write_text("\n".join(" ".join(f"w{(i + j) % 10}" for j in range(7)) for i in range(6)))
    cal, ev = halves(str(tmp_path / "t.txt"), tok, 2, 5)
    blocks = token_blocks(load_texts(str(tmp_path / "t.txt"), seed=0), tok, 4, 5)
    assert cal.tolist() == blocks[:2].tolist() and ev.tolist() == blocks[2:].tolist()
    with pytest.raises(ParamError, match="a checkpoint needs calibration text"):
        halves("", tok, 2, 5)
    with pytest.raises(ParamError, match="FloE needs at least 2"):
        halves(str(tmp_path / "t.txt"), tok, 2, 40, method="FloE")
