"""Calibration and evaluation text for the checkpoint path: a local file or folder, or a `datasets` name.

The compression papers (HC-SMoE, Olica) calibrate on raw text (C4, BookCorpus + Alpaca) and report
perplexity on WikiText-2. `load_texts` reads that text through `datasets` — a local `.txt` (one document
per line), `.jsonl`/`.json`/`.parquet`/`.csv` file with a text column, a folder of such files, or a dataset
name already in the local Hugging Face cache (`"wikitext:wikitext-2-raw-v1"`, `"allenai/c4"`) — and
`token_blocks` cuts it into the fixed-length token blocks those papers calibrate and evaluate on
(tokenize, concatenate, chunk: the official HC-SMoE `get_calib_dataloder` and Olica `ppl_eval` recipe).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_FORMATS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


class DataNotAvailable(RuntimeError):
    """The data is neither a readable local file/folder nor a cached `datasets` name."""


def load_texts(data: str, *, split: str = "train", column: str = "text", n: int | None = None,
               seed: int | None = None) -> list[str]:
    """Non-empty documents of `data` (a path or `name[:config]`), shuffled by `seed` when given, first `n` kept."""
    import datasets

    path = Path(os.path.expanduser(data))
    try:
        if path.exists():
            files = sorted(p for p in path.rglob("*") if p.suffix in _FORMATS) if path.is_dir() else [path]
            kinds = {_FORMATS.get(p.suffix) for p in files}
            if not files or None in kinds or len(kinds) > 1:
                raise DataNotAvailable(f"data={data!r} must be a .txt, .jsonl, .json, .parquet or .csv file, or a "
                                       "folder of files of one such kind.")
            ds = datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train")
        else:
            name, _, config = data.partition(":")
            ds = datasets.load_dataset(name, config or None, split=split)
    except DataNotAvailable:
        raise
    except Exception as e:  # datasets raises many kinds (FileNotFoundError, ConnectionError, DatasetNotFoundError)
        raise DataNotAvailable(f"data={data!r} is neither a readable local file/folder nor a dataset in the local "
                               f"Hugging Face cache ({type(e).__name__}); pass a local .txt/.jsonl file.") from e
    if column not in ds.column_names:
        raise DataNotAvailable(f"data={data!r} has no {column!r} column (it has {', '.join(ds.column_names)}).")
    if seed is not None:
        ds = ds.shuffle(seed=seed)
    texts = [t for t in ds[column] if t and t.strip()]
    return texts[:n] if n is not None else texts


def token_blocks(texts: list[str], tokenizer, n_blocks: int, block_len: int) -> torch.Tensor:
    """(≤ n_blocks, block_len) token ids: the texts tokenized, concatenated and cut into full blocks."""
    ids: list[int] = []
    for t in texts:
        ids += tokenizer(t, add_special_tokens=False)["input_ids"]
        if len(ids) >= n_blocks * block_len:
            break
    n = min(n_blocks, len(ids) // block_len)
    if n == 0:
        raise DataNotAvailable(f"the text holds {len(ids)} tokens, fewer than one block of {block_len}.")
    return torch.tensor(ids[: n * block_len]).view(n, block_len)


def halves(data: str, tokenizer, n_blocks: int, block_len: int, *, seed: int = 0, method: str = "the method",
           use: str = "calibration text") -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint paths' split: `2·n_blocks` token blocks of `data` (shuffled by `seed`), the first half to
    calibrate or fine-tune, the second held out. Empty `data` or fewer than two blocks: one `ParamError` sentence."""
    from lab.core.params import ParamError

    if not data:
        raise ParamError(f"a checkpoint needs {use}: pass -p data <a .txt/.jsonl file or a datasets name>.")
    ids = token_blocks(load_texts(data, seed=seed), tokenizer, 2 * n_blocks, block_len)
    if len(ids) < 2:
        raise ParamError(f"data={data!r} gives {len(ids)} block(s) of {block_len} tokens; {method} needs at least 2 "
                         "(one to calibrate, one held out): pass more text or a smaller block_len.")
    return ids[: len(ids) // 2], ids[len(ids) // 2:]
