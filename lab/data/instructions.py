"""A synthetic instruction world with injected low-quality prompts and a programmatic judge: the RIP
toy (Yu et al., ICML 2025). No downloads; the prompt kinds are known, for evaluation only.

A prompt is a task word and a 6-digit payload; the ideal response transforms the payload:

    <bos> REV 3 1 4 1 5 9 =   ->   9 5 1 4 1 3 <eos>        (COPY, REV, INC = each digit + 1 mod 10)

The judge's reward r(y|x) ∈ [0, 1] is the share of the 6 target digits matched before the first
<eos> (a short answer loses the missing positions). Low-quality prompts (paper Tables 26–27):

- `garbled`: looks normal, but every judgment scores against a randomly drawn task (ambiguous);
- `mislabeled`: the judge returns a uniform random reward;
- `truncated`: the payload is cut to one digit; the seed model learns to answer with <eos> at once
  (a "please clarify"), which the judge rewards U(0, 0.1) and anything else with 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lab.models.sample import sample, sample_responses
from lab.models.tokenizer import word_tokenizer

TASKS = ("COPY", "REV", "INC")
KINDS = ("clean", "garbled", "mislabeled", "truncated")
PAYLOAD, RESPONSE_LEN = 6, 7  # 6 digits + <eos>
IGNORE = -100


@dataclass(frozen=True)
class InstructionWorld:
    """Seeded prompts of each kind, the ideal responses, the judge; fields are the spec."""

    bad_frac: float = 0.45  # share of low-quality prompts in a pool, split evenly over the three kinds

    def __post_init__(self):
        if not 0.0 <= self.bad_frac < 1.0:
            raise ValueError("bad_frac must be in [0, 1).")

    @cached_property
    def tokenizer(self):
        return word_tokenizer([str(d) for d in range(10)] + list(TASKS) + ["=", "_"])

    def ids(self, words: list[str]) -> torch.Tensor:
        return torch.tensor(self.tokenizer.convert_tokens_to_ids(words))

    @cached_property
    def eos(self) -> int:
        return self.tokenizer.eos_token_id

    def prompts(self, n: int, generator: torch.Generator, *, bad_frac: float | None = None) -> dict[str, torch.Tensor]:
        """`prompt` (n, 9) ids, `task` (n,), `payload` (n, 6) digits and `kind` (n,) index into KINDS."""
        bad = self.bad_frac if bad_frac is None else bad_frac
        u = torch.rand(n, generator=generator)
        kind = torch.where(u < bad, 1 + (u / max(bad, 1e-9) * 3).long().clamp(max=2), 0)
        task = torch.randint(len(TASKS), (n,), generator=generator)
        payload = torch.randint(10, (n, PAYLOAD), generator=generator)
        shown = self.ids([str(d) for d in range(10)])[payload]
        shown[kind == 3, 1:] = self.ids(["_"])[0]  # truncated: one digit left
        prompt = torch.cat([self.ids(["<bos>"]).expand(n, 1), self.ids(list(TASKS))[task][:, None], shown,
                            self.ids(["="]).expand(n, 1)], 1)
        return {"prompt": prompt, "task": task, "payload": payload, "kind": kind}

    @staticmethod
    def target(task: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
        """The ideal digits (n, 6) for each task."""
        out = payload.clone()
        out[task == 1] = payload[task == 1].flip(-1)
        out[task == 2] = (payload[task == 2] + 1) % 10
        return out

    def ideal(self, p: dict[str, torch.Tensor]) -> torch.Tensor:
        """Ideal response ids (n, 7): the target digits and <eos>, or <eos> alone for truncated prompts
        (the rest <eos>-padded)."""
        digits = self.ids([str(d) for d in range(10)])[self.target(p["task"], p["payload"])]
        out = torch.cat([digits, torch.full((len(digits), 1), self.eos)], 1)
        out[p["kind"] == 3] = self.eos
        return out

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Seed-model SFT batch: ideal responses (garbled and mislabeled prompts look clean, so they are
        answered as clean; 5% truncated prompts answered with <eos>), loss up to the first <eos>."""
        p = self.prompts(n, generator, bad_frac=0.15)
        y = self.ideal(p)
        ids = torch.cat([p["prompt"], y], 1)
        labels = ids.clone()
        labels[:, : p["prompt"].shape[1]] = IGNORE
        labels[:, p["prompt"].shape[1]:][~self.response_mask(y)] = IGNORE
        return {"input_ids": ids, "labels": labels}

    def response_mask(self, y: torch.Tensor) -> torch.Tensor:
        """(…, L) True up to and including the first <eos> (the tokens a response consists of)."""
        is_eos = (y == self.eos).long()
        return (is_eos.cumsum(-1) - is_eos) == 0

    def length(self, y: torch.Tensor) -> torch.Tensor:
        """Response length in tokens before <eos>: (…)."""
        return self.response_mask(y).sum(-1) - (y == self.eos).any(-1).long()

    def reward(self, p: dict[str, torch.Tensor], y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The judge: r (n, k) for responses y (n, k, 7) of prompts p (n)."""
        n, k, _ = y.shape
        digit_of = torch.full((len(self.tokenizer),), -1)
        digit_of[self.ids([str(d) for d in range(10)])] = torch.arange(10)
        said = digit_of[y[..., :PAYLOAD]]  # (n, k, 6), −1 for non-digits
        before_eos = self.response_mask(y)[..., :PAYLOAD] & (y[..., :PAYLOAD] != self.eos)
        task = p["task"][:, None].expand(n, k).clone()
        garbled = p["kind"] == 1
        task[garbled] = torch.randint(len(TASKS), (int(garbled.sum()), k), generator=generator)
        want = self.target(task.reshape(-1), p["payload"].repeat_interleave(k, 0)).view(n, k, PAYLOAD)
        r = ((said == want) & before_eos).float().mean(-1)
        mis = p["kind"] == 2
        r[mis] = torch.rand(int(mis.sum()), k, generator=generator)
        trunc = p["kind"] == 3
        clarify = y[..., 0] == self.eos
        r[trunc] = torch.where(clarify[trunc], 0.1 * torch.rand(int(trunc.sum()), k, generator=generator), 0.0)
        return r

    def model_reward(self, model, p: dict[str, torch.Tensor], generator: torch.Generator, *, samples: int = 4,
                     device: str = "cpu") -> dict[str, float]:
        """A model's mean judge reward on prompts p: its greedy response, and `samples` responses per prompt
        sampled at T = 1."""
        greedy = sample(model, p["prompt"].to(device), RESPONSE_LEN, generator=generator, temperature=0)[:, None]
        sampled = sample_responses(model, p["prompt"].to(device), samples, RESPONSE_LEN, generator=generator,
                                   temperature=1.0)
        return {"greedy": self.reward(p, greedy, generator).mean().item(),
                "sampled": self.reward(p, sampled, generator).mean().item()}
