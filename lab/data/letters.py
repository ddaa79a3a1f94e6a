"""Mini-MMLU letter retrieval with a knowledge (cloze) control, after Bick et al. (ICML 2025, §3).

A fixed random *knowledge map* f: question -> content is learned into the weights. A letter prompt
lists options, each a letter, a content word and a delimiter, then asks a question; the answer is
the *letter* of the option whose content is f(question):

    <bos> _ A c3 w1 ⏎ B c17 ⏎ C c9 w6 w2 ⏎ D c21 ⏎ q5    ->  C        (if f(q5) = c9)

Options have random lengths (0..max_filler filler words `w*` after the content; `_` pads the front
so all prompts have one length): with fixed-length options a model can read the letter off the
position of the matching content and skip retrieval altogether (with RoPE, even random lengths
leave a distance shortcut; the notebook's toy uses no positional encoding).

Answering needs knowledge (f) *and* retrieval (find the option, copy its letter): in the paper's
terms a Gather head summarises each option into its delimiter and an Aggregate head at the last
position picks the matching delimiter. The cloze control asks for the knowledge alone, with the
question last so that answering needs no attention at all:

    <bos> ? q5   ->  c9
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lab.models.tokenizer import word_tokenizer

DELIM, ASK, PAD, IGNORE = "⏎", "?", "_", -100


@dataclass(frozen=True)
class LetterRetrieval:
    """A seeded generator of letter (and cloze) prompts; its fields are its spec."""

    n_options: int = 4
    n_contents: int = 32
    n_questions: int = 8
    max_filler: int = 2  # filler words after an option's content: 0..max_filler, at random
    n_fillers: int = 8
    cloze_frac: float = 0.2  # fraction of training batches that are cloze prompts
    map_seed: int = 0  # seed of the knowledge map f (part of the task, not of the run)
    n_labels: int = 0  # > n_options: each prompt labels its options with a random ordered draw of
    #                    n_options of these letters, so an option's position never gives its letter
    min_options: int = 0  # > 0: each training batch has k ~ U{min_options..n_options} options (a
    #                       retrieval-vs-context-size sweep evaluates one k at a time)

    def __post_init__(self):
        if not 2 <= self.n_options <= 26 or self.n_contents < self.n_options:
            raise ValueError("need 2..26 options and at least as many contents as options.")
        if self.n_labels and not self.n_options <= self.n_labels <= 26:
            raise ValueError("n_labels must be 0 (fixed A, B, ...) or between n_options and 26.")
        if self.min_options and not 2 <= self.min_options <= self.n_options:
            raise ValueError("min_options must be 0 (always n_options) or between 2 and n_options.")

    @property
    def letters(self) -> list[str]:
        """Every answer letter (the scored choices): n_labels of them if set, else n_options."""
        return [chr(ord("A") + i) for i in range(self.n_labels or self.n_options)]

    @property
    def contents(self) -> list[str]:
        return [f"c{i}" for i in range(self.n_contents)]

    @property
    def questions(self) -> list[str]:
        return [f"q{i}" for i in range(self.n_questions)]

    @property
    def fillers(self) -> list[str]:
        return [f"w{i}" for i in range(self.n_fillers)]

    @property
    def words(self) -> list[str]:
        return self.letters + self.contents + self.questions + self.fillers + [DELIM, ASK, PAD]

    @cached_property
    def tokenizer(self):
        return word_tokenizer(self.words)

    @cached_property
    def knowledge(self) -> torch.Tensor:
        """f as a tensor: `knowledge[q]` is the index of q's content."""
        g = torch.Generator().manual_seed(self.map_seed)
        return torch.randint(self.n_contents, (self.n_questions,), generator=g)

    def ids(self, words: list[str]) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(words)

    def letter_rows(self, n: int, generator: torch.Generator, n_options: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids (n, T) of letter prompts, the index of the correct letter in `letters` (n,) and
        the token index of the correct option's delimiter (n,); T = 2 + O·(3 + max_filler)."""
        rows, answer, label, delim = self._letter_rows(n, generator, n_options or self.n_options)
        return rows, label[torch.arange(n), answer], delim

    def _letter_rows(self, n: int, generator: torch.Generator, O: int):
        """Token ids (n, T) of letter prompts, the correct option (n,) and the token index of its
        delimiter (n,), with each option's label (n, O): an index into `letters`."""
        if not 2 <= O <= self.n_options:
            raise ValueError(f"n_options={O} is outside 2..{self.n_options}.")
        C = self.n_contents
        q = torch.randint(self.n_questions, (n,), generator=generator)  # (n,)
        answer = torch.randint(O, (n,), generator=generator)  # (n,)
        # distractor contents: distinct, never f(q) (sample among C-1 and skip over f(q))
        other = torch.rand(n, C - 1, generator=generator).argsort(-1)[:, :O]  # (n, O)
        fq = self.knowledge[q]
        content = other + (other >= fq[:, None]).long()  # (n, O)
        content[torch.arange(n), answer] = fq
        n_fill = torch.randint(self.max_filler + 1, (n, O), generator=generator)  # (n, O)
        fill = torch.randint(self.n_fillers, (n, O, self.max_filler), generator=generator)
        if self.n_labels:
            label = torch.rand(n, self.n_labels, generator=generator).argsort(-1)[:, :O]  # (n, O)
        else:
            label = torch.arange(O).expand(n, O)
        # layout, vectorised: <bos> PAD*pad (label content filler*n_fill ⏎)*O q
        ids = lambda words: torch.tensor(self.ids(words))
        length = 3 + n_fill  # (n, O)
        T = 2 + O * (3 + self.max_filler)
        start = (T - 1 - length.sum(1, keepdim=True)) + length.cumsum(1) - length  # (n, O) label positions
        rows = torch.full((n, T), self.ids([PAD])[0])
        r = torch.arange(n)[:, None].expand(n, O)
        rows[:, 0] = self.ids(["<bos>"])[0]
        rows[r, start] = ids(self.letters)[label]
        rows[r, start + 1] = ids(self.contents)[content]
        k = torch.arange(self.max_filler)  # filler slots
        used = k[None, None, :] < n_fill[:, :, None]  # (n, O, max_filler)
        rows[r[..., None].expand_as(used)[used], (start[..., None] + 2 + k)[used]] = ids(self.fillers)[fill[used]]
        rows[r, start + 2 + n_fill] = ids([DELIM])[0]
        rows[:, -1] = ids(self.questions)[q]
        delim_pos = (start + 2 + n_fill)[torch.arange(n), answer]
        return rows, answer, label, delim_pos

    def cloze_rows(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids (n, 3) of cloze prompts `<bos> ? q` and the content index f(q) (n,)."""
        q = torch.randint(self.n_questions, (n,), generator=generator)
        q_ids = torch.tensor(self.ids(self.questions))[q]
        ends = torch.tensor(self.ids(["<bos>", ASK]))
        return torch.stack([ends[0].expand(n), ends[1].expand(n), q_ids], 1), self.knowledge[q]

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """One training batch: letter prompts, or (with probability `cloze_frac`) cloze prompts;
        the loss is on the answer token only."""
        if torch.rand((), generator=generator) < self.cloze_frac:
            prompt, target = self.cloze_rows(n, generator)
            target = torch.tensor(self.ids(self.contents))[target]
        else:
            k = (int(torch.randint(self.min_options, self.n_options + 1, (), generator=generator))
                 if self.min_options else self.n_options)
            prompt, answer, _ = self.letter_rows(n, generator, k)
            target = torch.tensor(self.ids(self.letters))[answer]
        ids = torch.cat([prompt, target[:, None]], 1)
        labels = torch.full_like(ids, IGNORE)
        labels[:, -1] = target
        return {"input_ids": ids, "labels": labels}

    def choices(self, kind: str = "letter") -> list[str]:
        """The answer set scored for a prompt kind: the letters, or every content (cloze)."""
        return self.letters if kind == "letter" else self.contents

    def examples(self, n: int, generator: torch.Generator, kind: str = "letter",
                 n_options: int | None = None) -> list[dict]:
        """`n` prompts as text with their answer; letter prompts (with `n_options` options, default
        all) also carry `delim_pos`, the token index of the correct option's delimiter (where an
        Aggregate head should look)."""
        tok = self.tokenizer
        if kind == "letter":
            ids, answer, delim = self.letter_rows(n, generator, n_options)
            return [{"prompt": tok.decode(row), "answer": self.letters[a], "delim_pos": d}
                    for row, a, d in zip(ids.tolist(), answer.tolist(), delim.tolist())]
        if kind == "cloze":
            ids, target = self.cloze_rows(n, generator)
            return [{"prompt": tok.decode(row), "answer": self.contents[t]}
                    for row, t in zip(ids.tolist(), target.tolist())]
        raise ValueError(f"kind={kind!r} is not 'letter' or 'cloze'.")
