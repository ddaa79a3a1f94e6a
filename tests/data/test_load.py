"""lab.data.load: preference pairs, ranked responses and problems read through `datasets` from files in tmp_path."""

import json

import pytest

from lab.data.load import DataNotAvailable, preference_pairs, problems, ranked_responses


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


PAIRS = [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}", "extra": i} for i in range(6)]


def test_pairs_from_jsonl_keep_order_and_columns(tmp_path):
    rows = preference_pairs(write_jsonl(tmp_path / "p.jsonl", PAIRS))
    assert rows == [{"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]} for r in PAIRS]


def test_pairs_from_parquet_and_folder_n_and_seed(tmp_path):
    import datasets

    datasets.Dataset.from_list(PAIRS).to_parquet(str(tmp_path / "a.parquet"))
    all_rows = preference_pairs(str(tmp_path / "a.parquet"))
    assert [r["prompt"] for r in all_rows] == [f"q{i}" for i in range(6)]
    folder = tmp_path / "f"
    folder.mkdir()
    write_jsonl(folder / "x.jsonl", PAIRS[:3])
    write_jsonl(folder / "y.jsonl", PAIRS[3:])
    assert len(preference_pairs(str(folder))) == 6
    a = preference_pairs(str(tmp_path / "a.parquet"), n=3, seed=1)
    assert len(a) == 3 and a == preference_pairs(str(tmp_path / "a.parquet"), n=3, seed=1)
    assert {r["prompt"] for r in preference_pairs(str(tmp_path / "a.parquet"), seed=1)} == {f"q{i}" for i in range(6)}


def test_chat_format_takes_last_assistant_turn(tmp_path):
    conv = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "name?"}]
    row = {"chosen": conv + [{"role": "assistant", "content": "Ann"}],
           "rejected": conv + [{"role": "assistant", "content": "no"}]}
    out = preference_pairs(write_jsonl(tmp_path / "c.jsonl", [row]))[0]
    assert out == {"prompt": conv, "chosen": "Ann", "rejected": "no"}
    # explicit prompt column (TRL's explicit-prompt conversational form)
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": [{"role": "assistant", "content": "a"}],
           "rejected": [{"role": "assistant", "content": "b"}]}
    out = preference_pairs(write_jsonl(tmp_path / "e.jsonl", [row]))[0]
    assert out == {"prompt": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b"}


def test_ranked_responses_sorted_best_first(tmp_path):
    rows = [{"prompt": "p", "responses": ["a", "b", "c"], "rewards": [0.1, 0.9, -1.0]}]
    out = ranked_responses(write_jsonl(tmp_path / "r.jsonl", rows))
    assert out == [{"prompt": "p", "responses": ["b", "a", "c"], "rewards": [0.9, 0.1, -1.0]}]
    bad = [{"prompt": "p", "responses": ["a", "b"], "rewards": [1.0]}]
    with pytest.raises(DataNotAvailable, match="one reward per response"):
        ranked_responses(write_jsonl(tmp_path / "bad.jsonl", bad))


def test_problems_accept_question_or_problem(tmp_path):
    a = problems(write_jsonl(tmp_path / "a.jsonl", [{"problem": "1+1", "answer": "2", "level": 1}]))
    b = problems(write_jsonl(tmp_path / "b.jsonl", [{"question": "2+2", "answer": "4"}]))
    assert a == [{"question": "1+1", "answer": "2"}] and b == [{"question": "2+2", "answer": "4"}]


def test_missing_columns_one_sentence(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "good": "x", "bad": "y"}])
    with pytest.raises(DataNotAvailable) as e:
        preference_pairs(path)
    msg = str(e.value)
    assert "'chosen', 'rejected'" in msg and "preference pairs" in msg and "prompt, good, bad" in msg
    assert msg.count(".") == 2 and msg.endswith(").")  # one sentence (the dot is the file name's)
    with pytest.raises(DataNotAvailable, match="'question' or 'problem', 'answer'"):
        problems(path)
    with pytest.raises(DataNotAvailable, match="no 'prompt' column"):
        preference_pairs(write_jsonl(tmp_path / "n.jsonl", [{"chosen": "x", "rejected": "y"}]))


def test_unreadable_data_is_one_sentence(tmp_path):
    (tmp_path / "t.txt").write_text("plain text")
    with pytest.raises(DataNotAvailable, match="must be a .jsonl"):
        preference_pairs(str(tmp_path / "t.txt"))
    with pytest.raises(DataNotAvailable, match="neither a readable local file"):
        preference_pairs("no-such-org/no-such-set-xyz")


def test_preferences_pick_ranked_or_pairs(tmp_path):
    from lab.data.load import preferences

    ranked = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "p", "responses": ["a", "b"], "rewards": [0.0, 1.0]}])
    assert preferences(ranked) == [{"prompt": "p", "responses": ["b", "a"], "rewards": [1.0, 0.0]}]
    assert preferences(write_jsonl(tmp_path / "p.jsonl", PAIRS[:1])) == [{"prompt": "q0", "chosen": "good 0",
                                                                        "rejected": "bad 0"}]
    with pytest.raises(DataNotAvailable, match="data is empty"):
        preferences("")
