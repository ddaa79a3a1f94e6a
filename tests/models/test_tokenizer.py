import pytest

from lab.models import word_tokenizer


def test_ids_follow_the_given_order_and_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = word_tokenizer(["a", "b", "?"])
    assert tok("a ? b zz", add_special_tokens=False)["input_ids"] == [4, 6, 5, 1]  # 1 = <unk>
    assert (tok.pad_token_id, tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2, 3)
    assert tok.decode([4, 6, 5]) == "a ? b"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("a ? b")["input_ids"] == [4, 6, 5]


@pytest.mark.parametrize("words", [["a", "a"], ["a b"], [""]])
def test_bad_vocabularies(words):
    with pytest.raises(ValueError):
        word_tokenizer(words)
