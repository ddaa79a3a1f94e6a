"""A word-level tokenizer for procedural vocabularies: one word, one token id, no merges."""

from __future__ import annotations

from collections.abc import Sequence

SPECIALS = ("<pad>", "<unk>", "<bos>", "<eos>")


def word_tokenizer(words: Sequence[str], *, specials: Sequence[str] = SPECIALS):
    """A `PreTrainedTokenizerFast` over `specials + words`, split on whitespace.

    Ids follow the order given: specials first (pad=0, unk=1, bos=2, eos=3), then `words`, so a task
    can build id tensors directly and they agree with `tokenizer(text)`. It saves and loads with
    `save_pretrained` / `AutoTokenizer.from_pretrained` like any hub tokenizer.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = list(specials) + [w for w in words if w not in specials]
    if len(set(vocab)) != len(vocab):
        raise ValueError("words contain duplicates; a word-level vocabulary needs each word once.")
    if any(not w or any(c.isspace() for c in w) for w in vocab):
        raise ValueError("words must be non-empty and contain no whitespace.")
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                  bos_token="<bos>", eos_token="<eos>")
    return tok
