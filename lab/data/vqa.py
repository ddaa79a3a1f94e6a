"""A synthetic visual-QA world with a visual × textual shift grid: the EMI toy (Oh et al., ICML 2025).

An 8×8 RGB image holds one object — a shape (square, cross, bar, dot) in a colour at a quadrant — on
a noisy background; a "tiny MLLM" sees it as four 4×4 patches (48-d each, LLaVA-style prefix). A
question asks for the whole description or one attribute:

    describe the object   ->  red cross top-left        what colour is it  ->  red

Shifts mirror the paper's synthetic grid (defocus blur, frost × synonym replacement, keyboard typos):
visual `blur` / `frost` at severities 1, 3, 5 and textual `synonym` at 40% / 70% of the question words
(unseen synonym tokens) and `typo` in 1 / 3 words (unseen misspelt tokens). In-distribution = clean
images and canonical wording.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from lab.models.tokenizer import word_tokenizer

COLOURS = {"red": (1.0, 0.1, 0.1), "green": (0.1, 0.9, 0.2), "blue": (0.15, 0.25, 1.0), "yellow": (0.95, 0.9, 0.1)}
SHAPES = {"square": [[1, 1, 1, 1]] * 4, "cross": [[0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]],
          "bar": [[0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0, 0]], "dot": [[0, 0, 0, 0], [0, 1, 1, 0],
                                                                                 [0, 1, 1, 0], [0, 0, 0, 0]]}
POSITIONS = ["top-left", "top-right", "bottom-left", "bottom-right"]
QUESTIONS = {"describe": "describe the object", "colour": "what colour is it", "shape": "what shape is it",
             "position": "where is it"}
SYNONYMS = {"describe": "depict", "the": "this", "object": "item", "what": "which", "colour": "hue", "is": "be",
            "it": "that", "shape": "form", "where": "whereabouts"}
VISUAL = [("clean", 0), ("blur", 1), ("blur", 3), ("blur", 5), ("frost", 1), ("frost", 3), ("frost", 5)]
TEXTUAL = [("clean", 0), ("synonym", 40), ("synonym", 70), ("typo", 1), ("typo", 3)]


@dataclass(frozen=True)
class VisualQA:
    """Seeded images, questions and reference answers, with shifts; fields are the spec."""

    noise: float = 0.1  # background noise std
    seed: int = 0  # seeds the fixed frost pattern (part of the world)

    @cached_property
    def question_words(self) -> list[str]:
        return sorted({w for q in QUESTIONS.values() for w in q.split()})

    @cached_property
    def tokenizer(self):
        answers = list(COLOURS) + list(SHAPES) + POSITIONS
        unseen = sorted(set(SYNONYMS.values())) + [w + "~" for w in self.question_words]  # synonyms and typos
        return word_tokenizer(self.question_words + answers + unseen + ["?"])

    @cached_property
    def frost_pattern(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + 1)
        return F.avg_pool2d(torch.randn(1, 3, 8, 8, generator=g), 3, 1, 1)[0] * 3  # smooth structured noise

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Objects (n, 3) = (colour, shape, position) indices, question kinds (n,) and clean images (n, 3, 8, 8)."""
        obj = torch.stack([torch.randint(4, (n,), generator=generator) for _ in range(3)], 1)
        kind = torch.randint(len(QUESTIONS), (n,), generator=generator)
        img = self.noise * torch.randn(n, 3, 8, 8, generator=generator)
        colours, shapes = torch.tensor(list(COLOURS.values())), torch.tensor(list(SHAPES.values()), dtype=torch.float)
        for i, (c, s, p) in enumerate(obj.tolist()):
            r, col = divmod(p, 2)
            img[i, :, 4 * r:4 * r + 4, 4 * col:4 * col + 4] += shapes[s][None] * colours[c][:, None, None]
        return {"object": obj, "kind": kind, "image": img}

    def shift_image(self, img: torch.Tensor, kind: str, severity: int) -> torch.Tensor:
        """`blur`: a (2s+1)-box blur mixed in by s/5; `frost`: the fixed pattern scaled by 0.1·s."""
        if kind == "clean" or severity == 0:
            return img
        if kind == "blur":
            blurred = F.avg_pool2d(F.pad(img, (1, 1, 1, 1), mode="replicate"), 3, 1)
            for _ in range(severity // 2):
                blurred = F.avg_pool2d(F.pad(blurred, (1, 1, 1, 1), mode="replicate"), 3, 1)
            return img + (severity / 5) * (blurred - img)
        if kind == "frost":
            return img + 0.1 * severity * self.frost_pattern
        raise ValueError(f"unknown visual shift {kind!r}.")

    def question(self, kind: int, shift: str = "clean", severity: int = 0,
                 generator: torch.Generator | None = None) -> list[str]:
        """The question's words under a textual shift: synonyms for `severity`% of the replaceable words,
        or `severity` words misspelt (`w~`)."""
        words = QUESTIONS[list(QUESTIONS)[kind]].split()
        if shift == "clean" or severity == 0:
            return words
        g = generator or torch.Generator().manual_seed(0)
        if shift == "synonym":
            return [SYNONYMS[w] if torch.rand((), generator=g) < severity / 100 else w for w in words]
        if shift == "typo":
            hit = torch.randperm(len(words), generator=g)[:severity].tolist()
            return [w + "~" if i in hit else w for i, w in enumerate(words)]
        raise ValueError(f"unknown textual shift {shift!r}.")

    @staticmethod
    def answer(obj: list[int], kind: int) -> list[str]:
        c, s, p = obj
        full = [list(COLOURS)[c], list(SHAPES)[s], POSITIONS[p]]
        return full if kind == 0 else [full[kind - 1]]

    def encode(self, s: dict[str, torch.Tensor], *, visual: tuple[str, int] = ("clean", 0),
               textual: tuple[str, int] = ("clean", 0), generator: torch.Generator | None = None) -> dict:
        """Model inputs for samples `s` under a shift: `patches` (n, 4, 48), `prompt` (n, 5) ids
        `<bos> ? … question` (front-padded with `?`), `answer` (n, 4) ids (answer words, <eos>, <pad>…)
        and the words themselves (`question`, `reference`)."""
        tok, g = self.tokenizer, generator or torch.Generator().manual_seed(0)
        questions = [self.question(int(k), *textual, generator=g) for k in s["kind"]]
        refs = [self.answer(o, int(k)) for o, k in zip(s["object"].tolist(), s["kind"])]
        prompt = [["<bos>"] + ["?"] * (4 - len(q)) + q for q in questions]
        answer = [r + ["<eos>"] + ["<pad>"] * (3 - len(r)) for r in refs]
        ids = lambda rows: torch.tensor([tok.convert_tokens_to_ids(r) for r in rows])
        return {"patches": self.patches(self.shift_image(s["image"], *visual)), "prompt": ids(prompt),
                "answer": ids(answer), "question": questions, "reference": refs}

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """In-distribution training batch (clean images, canonical questions): loss on the answer."""
        e = self.encode(self.sample(n, generator))
        ids = torch.cat([e["prompt"], e["answer"]], 1)
        labels = ids.clone()
        labels[:, : e["prompt"].shape[1]] = -100
        labels[ids == self.tokenizer.pad_token_id] = -100
        return {"patches": e["patches"], "input_ids": ids, "labels": labels}

    def words(self, ids: torch.Tensor) -> list[list[str]]:
        """Generated ids (n, steps) -> each row's words up to its first <eos> (all of them without one)."""
        out = []
        for row in ids.tolist():
            ws = self.tokenizer.convert_ids_to_tokens(row)
            out.append(ws[: ws.index("<eos>")] if "<eos>" in ws else ws)
        return out

    @staticmethod
    def patches(img: torch.Tensor) -> torch.Tensor:
        """(n, 3, 8, 8) -> (n, 4, 48): the four 4×4 quadrants, flattened (the visual prefix)."""
        n = img.shape[0]
        return img.view(n, 3, 2, 4, 2, 4).permute(0, 2, 4, 1, 3, 5).reshape(n, 4, 48)


class FrozenEncoders:
    """Stand-ins for the frozen encoders of EMI's official code (deeplearning-wisc/mllmshift-emi; no hub
    weights here): text = a fixed random token-embedding table averaged over the words (as XLM-R's
    `hidden_states[0]` mean), image = a fixed random 2-layer map of the patches averaged over patches
    (as CLIP's patch mean); all L2-normalised (d-dim)."""

    def __init__(self, tokenizer, *, d: int = 64, patch_dim: int = 48, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokenizer = tokenizer
        self.table = torch.randn(len(tokenizer), d, generator=g)
        self.W1 = torch.randn(patch_dim, 2 * d, generator=g) / patch_dim**0.5
        self.W2 = torch.randn(2 * d, d, generator=g) / (2 * d) ** 0.5

    def text(self, sentences: list[list[str]]) -> torch.Tensor:
        """(n, d): mean word embedding of each word list (an empty one embeds as zeros)."""
        out = torch.zeros(len(sentences), self.table.shape[1])
        for i, words in enumerate(sentences):
            if words:
                out[i] = self.table[torch.tensor(self.tokenizer.convert_tokens_to_ids(words))].mean(0)
        return F.normalize(out, dim=-1)

    def image(self, patches: torch.Tensor) -> torch.Tensor:
        """(n, P, patch_dim) -> (n, d)."""
        return F.normalize((torch.relu(patches @ self.W1) @ self.W2).mean(1), dim=-1)
