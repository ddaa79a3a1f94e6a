"""Category multiple choice in plain English: an MMLU-shaped letter-retrieval probe for pretrained
LMs (full scale), built from small word lists, no data set to download.

    Which of these is an animal?
    A. chair
    B. seven
    C. horse
    D. green
    Answer:            ->  " C"      (cloze control: "Which of these is an animal? Answer:" -> " horse")

Any instruction-tuned 8B model knows the categories, so the letter prompt tests retrieval of the
letter (what Gather & Aggregate heads do) while the cloze prompt tests the same knowledge without it:
like the paper's knowledge benchmarks (scored by lm-eval on the answer text), it scores the four
option words as continuations (`choices` in each example).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CATEGORIES = {
    "an animal": ["horse", "tiger", "rabbit", "eagle", "dolphin", "sheep", "wolf", "camel"],
    "a color": ["green", "purple", "yellow", "orange", "brown", "silver", "crimson", "violet"],
    "a number": ["seven", "twelve", "three", "forty", "nine", "eleven", "sixty", "twenty"],
    "a fruit": ["apple", "banana", "cherry", "mango", "peach", "grape", "lemon", "plum"],
    "a piece of furniture": ["chair", "table", "sofa", "wardrobe", "bench", "desk", "stool", "cabinet"],
    "a country": ["France", "Brazil", "Japan", "Kenya", "Canada", "Norway", "Peru", "India"],
    "a body part": ["elbow", "knee", "shoulder", "ankle", "wrist", "finger", "ear", "chin"],
    "a musical instrument": ["violin", "piano", "trumpet", "guitar", "flute", "drum", "cello", "harp"],
}


@dataclass(frozen=True)
class CategoryMCQ:
    n_options: int = 4

    @property
    def letters(self) -> list[str]:
        return [chr(ord("A") + i) for i in range(self.n_options)]

    def choices(self, kind: str = "letter") -> list[str] | None:
        """Shared answer set of a prompt kind (None: each cloze example carries its own `choices`)."""
        return self.letters if kind == "letter" else None

    def examples(self, n: int, generator: torch.Generator, kind: str = "letter") -> list[dict]:
        """Letter prompts (answer: the letter) or cloze prompts (answer: the word)."""
        cats = list(CATEGORIES)
        out = []
        for _ in range(n):
            pick = torch.randperm(len(cats), generator=generator)[: self.n_options].tolist()
            words = [CATEGORIES[cats[c]][int(torch.randint(8, (), generator=generator))] for c in pick]
            asked = cats[pick[0]]  # the first sampled category is the one asked about
            order = torch.randperm(self.n_options, generator=generator).tolist()
            options = [words[i] for i in order]
            answer = order.index(0)
            question = f"Which of these is {asked}?"
            if kind == "cloze":
                out.append({"prompt": f"{question} Answer:", "answer": words[0], "choices": options})
            else:
                lines = "\n".join(f"{L}. {w}" for L, w in zip(self.letters, options))
                out.append({"prompt": f"{question}\n{lines}\nAnswer:", "answer": self.letters[answer]})
        return out
