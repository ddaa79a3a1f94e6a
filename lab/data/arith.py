"""Two-step modular arithmetic with "tricky" keywords: the cDPO toy (Lin et al., ICML 2025, §2).

A question names three digits and two keywords; each keyword stands for an operation (+ or −), as
"owed" or "gave away" do in GSM8K. The trajectory writes the operations and partial results:

    <bos> 3 5 8 K2 K6 =   ->   + 8 - 0 <eos>        s1 = 3 + 5 = 8 (mod 10), s2 = 8 − 8 = 0

The base model learns from *noisy* traces: for the first `n_tricky` keywords the operation is the
wrong one with probability `flip` (> 1/2: the majority is wrong), so its mistakes start at one
operation token — the critical token — after which no continuation can recover. A trajectory is
correct when its final digit is the true s2 and it ends with <eos> (final-answer grading, like the
paper's GSM8K parser; a wrong operation that happens to give the right digit counts as correct).

With `n_wordings` > 0 each response opens with a free wording token W0..W{n−1}, drawn uniformly in the traces and
irrelevant to correctness (as a GSM8K solution's phrasing): a chosen and a rejected trajectory then usually part at
that harmless token, before the critical one, and every wording is as unlikely under a model of correct answers as
under a model of wrong ones — the variant where "first differing token" and P_p alone stop finding critical tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from lab.models.sample import sample
from lab.models.tokenizer import word_tokenizer

IGNORE = -100
SEP = "="
PROMPT_LEN, RESPONSE_LEN = 7, 5  # <bos> a b c k1 k2 =  |  op1 s1 op2 s2 <eos>
POSITIONS = ("op1", "s1", "op2", "s2", "<eos>")  # what each response position holds


def take(q: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The questions `rows` of a question batch q (every field indexed alike)."""
    return {k: v[rows] for k, v in q.items()}


@dataclass(frozen=True)
class TrickyArithmetic:
    """A seeded generator of questions and (noisy) reference traces; its fields are its spec."""

    n_keywords: int = 8
    n_tricky: int = 4  # keywords K0..K{n_tricky-1} have flipped operations in the base traces
    flip: float = 0.6  # probability that a tricky keyword's trace uses the wrong operation
    map_seed: int = 0  # seeds the keyword -> operation map (part of the task)
    modulus: int = 10  # digits 0..modulus-1, arithmetic mod `modulus`
    max_step: int = 0  # > 0: the operands b, c are drawn from 1..max_step (small steps learn fast)
    n_wordings: int = 0  # > 0: responses open with a free wording token W0..W{n-1} (irrelevant to correctness)

    def __post_init__(self):
        if not 0 <= self.n_tricky <= self.n_keywords or not 0.0 <= self.flip <= 1.0:
            raise ValueError("need 0 <= n_tricky <= n_keywords and 0 <= flip <= 1.")
        if not 0 <= self.max_step < self.modulus:
            raise ValueError("max_step must be 0 (any digit) or between 1 and modulus - 1.")
        if not 3 <= self.modulus <= 10:
            raise ValueError("modulus must be between 3 and 10 (single-digit tokens).")
        if self.n_wordings < 0:
            raise ValueError("n_wordings must be >= 0.")

    @property
    def response_len(self) -> int:
        """Tokens per response: 5, plus the wording token when `n_wordings` > 0."""
        return RESPONSE_LEN + (self.n_wordings > 0)

    @property
    def positions(self) -> tuple[str, ...]:
        """What each response position holds (`POSITIONS`, after "wording" when there is one)."""
        return ("wording",) * (self.n_wordings > 0) + POSITIONS

    @property
    def operations(self) -> tuple[int, ...]:
        """The response positions of the two operation tokens (where critical tokens belong)."""
        return tuple(i for i, name in enumerate(self.positions) if name.startswith("op"))

    @property
    def words(self) -> list[str]:
        return ([str(d) for d in range(self.modulus)] + [f"K{i}" for i in range(self.n_keywords)] + ["+", "-", SEP]
                + [f"W{i}" for i in range(self.n_wordings)])

    @cached_property
    def tokenizer(self):
        return word_tokenizer(self.words)

    def ids(self, words: list[str]) -> list[int]:
        return self.tokenizer.convert_tokens_to_ids(words)

    @cached_property
    def op_sign(self) -> torch.Tensor:
        """(n_keywords,) of +1 / −1: the true operation of each keyword (both kinds among the tricky)."""
        g = torch.Generator().manual_seed(self.map_seed)
        sign = torch.where(torch.rand(self.n_keywords, generator=g) < 0.5, 1, -1)
        sign[: self.n_tricky] = torch.tensor([1, -1]).repeat(self.n_tricky)[: self.n_tricky]
        return sign

    @cached_property
    def _vocab(self) -> dict[str, torch.Tensor]:
        return {"digit": torch.tensor(self.ids([str(d) for d in range(self.modulus)])),
                "kw": torch.tensor(self.ids([f"K{i}" for i in range(self.n_keywords)])),
                "op": torch.tensor(self.ids(["-", "+"])),  # index (sign + 1) // 2
                "bos_sep_eos": torch.tensor(self.ids(["<bos>", SEP, "<eos>"])),
                "wording": torch.tensor(self.ids([f"W{i}" for i in range(self.n_wordings)]), dtype=torch.long)}

    def questions(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`prompt` (n, 7) token ids and the question's fields: digits (n, 3), keywords (n, 2)."""
        digits = torch.randint(self.modulus, (n, 3), generator=generator)
        if self.max_step:
            digits[:, 1:] = torch.randint(1, self.max_step + 1, (n, 2), generator=generator)
        kw = torch.randint(self.n_keywords, (n, 2), generator=generator)
        v = self._vocab
        prompt = torch.cat([v["bos_sep_eos"][0].expand(n, 1), v["digit"][digits], v["kw"][kw],
                            v["bos_sep_eos"][1].expand(n, 1)], 1)
        return {"prompt": prompt, "digits": digits, "kw": kw}

    def trace(self, q: dict[str, torch.Tensor], sign: torch.Tensor,
              wording: torch.Tensor | None = None) -> torch.Tensor:
        """Response ids (n, `response_len`) computed with operation signs (n, 2) (the true or a flipped one), opened
        by the wording tokens `wording` (n,) (default W0) when the task has them."""
        a, b, c = q["digits"].unbind(1)
        s1 = (a + sign[:, 0] * b) % self.modulus
        s2 = (s1 + sign[:, 1] * c) % self.modulus
        v = self._vocab
        body = torch.stack([v["op"][(sign[:, 0] + 1) // 2], v["digit"][s1], v["op"][(sign[:, 1] + 1) // 2],
                            v["digit"][s2], v["bos_sep_eos"][2].expand(len(a))], 1)
        if not self.n_wordings:
            return body
        wording = torch.zeros(len(a), dtype=torch.long) if wording is None else wording
        return torch.cat([v["wording"][wording][:, None], body], 1)

    def answer(self, q: dict[str, torch.Tensor]) -> torch.Tensor:
        """The true final digit s2: (n,)."""
        a, b, c = q["digits"].unbind(1)
        sign = self.op_sign[q["kw"]]
        return ((a + sign[:, 0] * b) % self.modulus + sign[:, 1] * c) % self.modulus

    def tricky(self, q: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n,) True when the question has a tricky keyword."""
        return (q["kw"] < self.n_tricky).any(1)

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Base-model training batch: noisy traces (tricky operations flipped w.p. `flip`), loss on
        the response tokens."""
        q = self.questions(n, generator)
        sign = self.op_sign[q["kw"]]
        flipped = (q["kw"] < self.n_tricky) & (torch.rand(n, 2, generator=generator) < self.flip)
        wording = torch.randint(max(self.n_wordings, 1), (n,), generator=generator) if self.n_wordings else None
        response = self.trace(q, torch.where(flipped, -sign, sign), wording)
        ids = torch.cat([q["prompt"], response], 1)
        labels = ids.clone()
        labels[:, :PROMPT_LEN] = IGNORE
        return {"input_ids": ids, "labels": labels}

    def final_answer(self, response: torch.Tensor) -> torch.Tensor:
        """The final digit a response states, or −1 when it is malformed: (..., `response_len`) -> (...)."""
        v = self._vocab
        if self.n_wordings:
            ok = torch.isin(response[..., 0], v["wording"])
            response = response[..., 1:]
        else:
            ok = torch.ones(response.shape[:-1], dtype=torch.bool)
        digit_of = torch.full((len(self.tokenizer),), -1)  # token id -> digit value, −1 if not a digit
        digit_of[v["digit"]] = torch.arange(self.modulus)
        ok &= torch.isin(response[..., 0], v["op"]) & torch.isin(response[..., 2], v["op"])
        ok &= torch.isin(response[..., 1], v["digit"]) & (response[..., 4] == v["bos_sep_eos"][2])
        return torch.where(ok, digit_of[response[..., 3]], -1)

    def grade(self, q: dict[str, torch.Tensor], response: torch.Tensor) -> torch.Tensor:
        """Correct (bool) per response: response (n, L) or (n, k, L) for question batch q (n)."""
        truth = self.answer(q)
        truth = truth.view(-1, *([1] * (response.ndim - 2)))
        return self.final_answer(response) == truth

    def grader(self, q: dict[str, torch.Tensor]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """`grade` as rollouts call it: (rows of q (m,), responses (m, k, 5)) -> correct (m, k)."""
        return lambda rows, response: self.grade(take(q, rows), response)

    def greedy_accuracy(self, model, q: dict[str, torch.Tensor], *, generator: torch.Generator,
                        device: str = "cpu") -> dict[str, float]:
        """Share of questions q a model answers correctly with its greedy trajectory: over all of them, the
        tricky ones and the plain ones."""
        ok = self.grade(q, sample(model, q["prompt"].to(device), self.response_len, generator=generator,
                                  temperature=0))
        tricky = self.tricky(q)
        return {"all": ok.float().mean().item(), "tricky": ok[tricky].float().mean().item(),
                "plain": ok[~tricky].float().mean().item()}

    def chance(self) -> dict[str, float]:
        """Top-1 hit rates of guessing the critical token: a random response position, a random operation."""
        return {"random position": 1 / self.response_len, "random operation token": 1 / 2}  # op1 or op2
