"""Preference pairs, ranked responses and problems for the checkpoint path, read through `datasets`.

`data` is a local `.jsonl`/`.json`/`.parquet`/`.csv` file, a folder of files of one such kind, or a dataset name
already in the local Hugging Face cache (`"name[:config]"`, e.g. `"trl-lib/ultrafeedback_binarized"`); the
reading and its errors are `lab.data.text`'s (`DataNotAvailable`, one sentence). Each loader validates the
columns it needs and says, in one sentence, which are missing and which the data has.

- `preference_pairs`: `prompt`, `chosen`, `rejected`, as TRL's preference format. In its conversational form
  `chosen`/`rejected` are lists of `{"role", "content"}` messages: the last assistant turn is the response and
  the messages before it (or an explicit `prompt` column) the prompt, kept as a message list.
- `ranked_responses`: `prompt`, `responses` (a list per row) and `rewards` (one per response); rows come back
  ranked best first (column 0 preferred, the order `lab.align.losses` expects).
- `preferences`: ranked responses when the data has them, else pairs.
- `problems`: `question` (or `problem`) and `answer`; rows come back with `question` and `answer`.
- `image_questions`: `image`, `question`, `reference_answer` (or `answer`), grouped into scenarios by a `shift` column
  or by split; also reads an image folder with a `metadata.jsonl` (`datasets`' imagefolder).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lab.data.text import _FORMATS, DataNotAvailable

__all__ = ["DataNotAvailable", "load_dataset", "preference_pairs", "ranked_responses", "preferences", "problems",
           "image_questions"]


def load_dataset(data: str, *, split: str = "train"):
    """The `datasets.Dataset` of `data` (a local file or folder, or a cached `name[:config]`)."""
    import datasets

    if not data:
        raise DataNotAvailable("data is empty; pass a local .jsonl/.parquet file or a cached `datasets` name.")
    path = Path(os.path.expanduser(data))
    try:
        if path.exists():
            files = sorted(p for p in path.rglob("*") if p.suffix in _FORMATS) if path.is_dir() else [path]
            kinds = {_FORMATS.get(p.suffix) for p in files}
            if not files or None in kinds or len(kinds) > 1 or kinds == {"text"}:
                raise DataNotAvailable(f"data={data!r} must be a .jsonl, .json, .parquet or .csv file, or a folder of "
                                       "files of one such kind.")
            return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train")
        name, _, config = data.partition(":")
        return datasets.load_dataset(name, config or None, split=split)
    except DataNotAvailable:
        raise
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, ConnectionError, DatasetNotFoundError)
        raise DataNotAvailable(f"data={data!r} is neither a readable local file/folder nor a dataset in the local "
                               f"Hugging Face cache ({type(e).__name__}); pass a local .jsonl/.parquet file.") from e


def _rows(data: str, need: list[tuple[str, ...]], what: str, *, split: str, n: int | None, seed: int | None):
    """The dataset, shuffled by `seed`, first `n` kept, after checking that each group in `need` has one column."""
    ds = load_dataset(data, split=split)
    missing = [" or ".join(map(repr, group)) for group in need if not any(c in ds.column_names for c in group)]
    if missing:
        raise DataNotAvailable(f"data={data!r} lacks the column(s) {', '.join(missing)} needed for {what} "
                               f"(it has {', '.join(ds.column_names)}).")
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    return ds.select(range(min(n, len(ds)))) if n is not None else ds


def _is_chat(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in x)


def _split_chat(messages: list[dict]) -> tuple[list[dict], str]:
    """(the messages before the last assistant turn, that turn's content)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise DataNotAvailable(f"a conversational response has no assistant turn: {messages!r}.")
    return [dict(m) for m in messages[:last]], messages[last]["content"]


def preference_pairs(data: str, *, split: str = "train", n: int | None = None,
                     seed: int | None = None) -> list[dict]:
    """Rows `{prompt, chosen, rejected}`: `prompt` a string or a message list, the responses strings."""
    need = [("chosen",), ("rejected",)]
    ds = _rows(data, need, "preference pairs", split=split, n=n, seed=seed)
    out = []
    for row in ds:
        prompt = row.get("prompt")
        if _is_chat(row["chosen"]):
            history, chosen = _split_chat(row["chosen"])
            _, rejected = _split_chat(row["rejected"])
            prompt = (prompt if _is_chat(prompt) else [{"role": "user", "content": prompt}]) if prompt else history
        else:
            chosen, rejected = row["chosen"], row["rejected"]
        if prompt is None:
            raise DataNotAvailable(f"data={data!r} has plain-text responses but no 'prompt' column (it has "
                                   f"{', '.join(ds.column_names)}).")
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def ranked_responses(data: str, *, split: str = "train", n: int | None = None,
                     seed: int | None = None) -> list[dict]:
    """Rows `{prompt, responses, rewards}` with the responses sorted by reward, best first."""
    ds = _rows(data, [("prompt",), ("responses",), ("rewards",)], "ranked responses", split=split, n=n, seed=seed)
    out = []
    for row in ds:
        if len(row["responses"]) != len(row["rewards"]) or len(row["responses"]) < 2:
            raise DataNotAvailable(f"data={data!r}: each row needs ≥ 2 responses and one reward per response; a row "
                                   f"has {len(row['responses'])} responses and {len(row['rewards'])} rewards.")
        order = sorted(range(len(row["rewards"])), key=lambda k: -row["rewards"][k])
        responses = [row["responses"][k] if isinstance(row["responses"][k], str)
                     else _split_chat(row["responses"][k])[1] for k in order]
        rewards = [float(row["rewards"][k]) for k in order]
        out.append({"prompt": row["prompt"], "responses": responses, "rewards": rewards})
    return out


def preferences(data: str, *, split: str = "train", n: int | None = None, seed: int | None = None) -> list[dict]:
    """`ranked_responses` when `data` has `responses` and `rewards` columns, else `preference_pairs`."""
    ranked = {"responses", "rewards"} <= set(load_dataset(data, split=split).column_names)
    return (ranked_responses if ranked else preference_pairs)(data, split=split, n=n, seed=seed)


def problems(data: str, *, split: str = "train", n: int | None = None, seed: int | None = None) -> list[dict]:
    """Rows `{question, answer}` (the question from a `question` or a `problem` column)."""
    ds = _rows(data, [("question", "problem"), ("answer",)], "problems with answers", split=split, n=n, seed=seed)
    key = "question" if "question" in ds.column_names else "problem"
    return [{"question": row[key], "answer": row["answer"]} for row in ds]


# ----------------------------------------------------------------------- image–question–answer sets by scenario

_METADATA = ("metadata.jsonl", "metadata.csv", "metadata.parquet")  # what `datasets`' imagefolder reads


def _image_sets(data: str) -> dict:
    """`{split name: Dataset}` with an `image` column decoded by `datasets.Image`: an imagefolder (images beside a
    metadata file with `file_name`), a .jsonl/.parquet/.csv file or folder whose `image` column holds paths
    (relative to the file's folder) or embedded images, or every split of a cached `datasets` name."""
    import datasets

    path = Path(os.path.expanduser(data))
    if path.is_dir() and any((path / m).exists() for m in _METADATA):
        try:
            return dict(datasets.load_dataset("imagefolder", data_dir=str(path)))
        except Exception as e:  # one sentence, whatever datasets raises
            raise DataNotAvailable(f"data={data!r} has a metadata file but is not a readable image folder "
                                   f"({type(e).__name__}: {e}).") from e
    if path.exists():
        ds = load_dataset(data)
        if "image" in ds.column_names and isinstance(ds.features["image"], datasets.Value):  # paths
            base = path if path.is_dir() else path.parent
            ds = ds.map(lambda p: {"image": str(base / p)}, input_columns="image")
            ds = ds.cast_column("image", datasets.Image())
        return {"train": ds}
    name, _, config = data.partition(":")
    try:
        return dict(datasets.load_dataset(name, config or None))
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, ConnectionError, DatasetNotFoundError)
        raise DataNotAvailable(f"data={data!r} is neither a readable local file/folder nor a dataset in the local "
                               f"Hugging Face cache ({type(e).__name__}); pass a folder of images with a "
                               "metadata.jsonl.") from e


def image_questions(data: str, *, n: int | None = None, shift_column: str = "shift") -> dict[str, list[dict]]:
    """Image–question–answer sets by scenario, `{scenario: [{image, question, reference}]}` (images as RGB PIL), the
    first `n` rows of each kept in order.

    Columns: `image`, `question`, and the reference answer as `reference_answer` or `answer`. The scenarios are the
    values of `shift_column` in order of first appearance (a local folder or file: e.g. `coco` and `wild` rows of
    one metadata.jsonl), or, for data without that column, its splits (the layout of the LLaVA-Bench shift sets,
    `changdae/llavabench-shift-natural-v1`: one split per scenario)."""
    sets = _image_sets(data) if data else {}
    if not sets:
        raise DataNotAvailable("data is empty; pass a folder of images with a metadata.jsonl (file_name, question, "
                               "answer, shift) or a cached `datasets` name.")
    cols = next(iter(sets.values())).column_names
    need = [("image",), ("question",), ("reference_answer", "answer")]
    missing = [" or ".join(map(repr, group)) for group in need if not any(c in cols for c in group)]
    if missing:
        raise DataNotAvailable(f"data={data!r} lacks the column(s) {', '.join(missing)} needed for image–question–"
                               f"answer sets (it has {', '.join(cols)}).")
    ref = "reference_answer" if "reference_answer" in cols else "answer"
    if shift_column in cols:
        sets = {str(s): ds.select([i for i, v in enumerate(ds[shift_column]) if v == s])
                for ds in sets.values() for s in dict.fromkeys(ds[shift_column])}
    out = {}
    for name, ds in sets.items():
        ds = ds.select(range(min(n, len(ds)))) if n else ds
        out[name] = [{"image": r["image"].convert("RGB"), "question": r["question"], "reference": r[ref]} for r in ds]
    return out
