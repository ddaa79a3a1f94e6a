"""Synthetic domain languages for test-time learning (TLM toy, Hu et al., ICML 2025).

A domain is a first-order Markov chain over `n_words` words: each word w has a preferred successor
π(w) (probability `p_next`, otherwise uniform) and the domain has its own start distribution. The
target domain re-draws the successor of a fraction `shift` of the words (new "terminology") and
shifts the start distribution. A question is a passage from the domain; its answer continues the
passage deterministically with the domain's preferred successors:

    <bos> Q w1 … w16 A   ->   π(w16) π(π(w16)) …   (8 words) <eos>

Unlabeled target inputs therefore carry the new transitions that the answers need — the property
TLM's input-perplexity minimisation relies on (the notebook measures it rather than assuming it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lab.models.sample import sample
from lab.models.tokenizer import word_tokenizer

IGNORE = -100


@dataclass(frozen=True)
class MarkovDomains:
    """A source and a shifted target domain over one vocabulary; fields are the spec."""

    n_words: int = 60
    p_next: float = 0.8
    shift: float = 0.4  # share of words whose preferred successor is re-drawn in the target domain
    passage: int = 16
    answer: int = 8
    seed: int = 0  # seeds both chains (part of the task)

    @cached_property
    def tokenizer(self):
        return word_tokenizer([f"w{i}" for i in range(self.n_words)] + ["Q", "A"])

    @cached_property
    def chains(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{"source" | "target": (successor π (n_words,), start distribution (n_words,))}."""
        g = torch.Generator().manual_seed(self.seed)
        n = self.n_words
        pi_s = torch.randperm(n, generator=g)
        moved = torch.rand(n, generator=g) < self.shift
        pi_t = pi_s.clone()
        pi_t[moved] = torch.randint(n, (int(moved.sum()),), generator=g)
        start_s = torch.softmax(torch.randn(n, generator=g), 0)
        start_t = torch.softmax(torch.randn(n, generator=g) * 2, 0)
        return {"source": (pi_s, start_s), "target": (pi_t, start_t)}

    @property
    def word_ids(self) -> torch.Tensor:
        return torch.tensor(self.tokenizer.convert_tokens_to_ids([f"w{i}" for i in range(self.n_words)]))

    def sample(self, n: int, domain: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`input` (n, passage + 3) ids `<bos> Q w… A` and `answer` (n, answer + 1) ids ending in <eos>."""
        pi, start = self.chains[domain]
        words = torch.empty(n, self.passage, dtype=torch.long)
        words[:, 0] = torch.multinomial(start, n, replacement=True, generator=generator)
        for t in range(1, self.passage):
            follow = torch.rand(n, generator=generator) < self.p_next
            jump = torch.randint(self.n_words, (n,), generator=generator)
            words[:, t] = torch.where(follow, pi[words[:, t - 1]], jump)
        ans = torch.empty(n, self.answer, dtype=torch.long)
        prev = words[:, -1]
        for t in range(self.answer):
            prev = ans[:, t] = pi[prev]
        ids = self.word_ids
        tok = self.tokenizer
        x = torch.cat([torch.full((n, 1), tok.bos_token_id), torch.full((n, 1), tok.convert_tokens_to_ids("Q")),
                       ids[words], torch.full((n, 1), tok.convert_tokens_to_ids("A"))], 1)
        y = torch.cat([ids[ans], torch.full((n, 1), tok.eos_token_id)], 1)
        return {"input": x, "answer": y}

    def answers_of(self, inputs: torch.Tensor, domain: str) -> torch.Tensor:
        """The answers (n, answer + 1) that `domain`'s chain gives to questions `inputs` (n, passage + 3): its
        successors of each question's last word, then <eos> (`sample`'s answers are `answers_of` their own domain)."""
        pi = self.chains[domain][0]
        ids = self.word_ids
        index = torch.full((int(ids.max()) + 1,), -1, dtype=torch.long)
        index[ids] = torch.arange(self.n_words)
        prev, ans = index[inputs[:, -2]], []  # the word before "A"
        for _ in range(self.answer):
            prev = pi[prev]
            ans.append(prev)
        return torch.cat([ids[torch.stack(ans, 1)], torch.full((len(inputs), 1), self.tokenizer.eos_token_id)], 1)

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Pre-training batch on the *source* domain: whole question + answer, LM loss on every token."""
        s = self.sample(n, "source", generator)
        ids = torch.cat([s["input"], s["answer"]], 1)
        return {"input_ids": ids, "labels": ids.clone()}

    def leaks(self, inputs: list[torch.Tensor]) -> int:
        """Answer material in a stream of questions (each (1, T)): per input, 1 if it holds an <eos> and 1 if
        its length is not a question's (passage + 3); 0 for a stream of questions only."""
        eos = self.tokenizer.eos_token_id
        return sum(int((x == eos).any()) + int(x.shape[1] != self.passage + 3) for x in inputs)


@torch.no_grad()
def answer_scores(model, data: dict[str, torch.Tensor], *, generator: torch.Generator, device) -> dict[str, float]:
    """A causal LM's answers to `data["input"]` (questions) scored against `data["answer"]` (answers + <eos>):
    greedy answers of the answers' length (without <eos>) -> token accuracy `acc` and mean ROUGE-L `rougeL`;
    `out_ppl` = exp of the mean NLL of the reference answer tokens (<eos> included) given the question."""
    model.eval()
    x, y = data["input"].to(device), data["answer"].to(device)
    pred = sample(model, x, y.shape[1] - 1, generator=generator, temperature=0)
    ref = y[:, :-1].cpu()
    logp = model(input_ids=torch.cat([x, y], 1)).logits[:, x.shape[1] - 1:-1].float().log_softmax(-1)
    return {"acc": (pred == ref).float().mean().item(),
            "rougeL": sum(rouge_l(p.tolist(), r.tolist()) for p, r in zip(pred, ref)) / len(ref),
            "out_ppl": (-logp.gather(-1, y[..., None]).mean()).exp().item()}


def rouge_l(pred: list, ref: list) -> float:
    """ROUGE-L F1 from the longest common subsequence of two token lists."""
    if not pred or not ref:
        return 0.0
    prev = [0] * (len(ref) + 1)
    for a in pred:
        cur = [0]
        for j, b in enumerate(ref):
            cur.append(prev[j] + 1 if a == b else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(pred), lcs / len(ref)
    return 2 * p * r / (p + r)


@dataclass(frozen=True)
class RetentionDomains(MarkovDomains):
    """`MarkovDomains` whose pre-training also covers an unrelated *retention* domain (the role GSM8K plays for
    TLM's forgetting figure, Fig. 2): its own chain π_R (an independent permutation, its own start distribution)
    behind its own marker, `<bos> A w1 … w16 A -> π_R(w16) …`. The target shift does not touch it, so what
    test-time learning on the target costs on it is forgetting, not a conflict. Source and target are exactly
    `MarkovDomains`'."""

    retain_frac: float = 0.25  # share of each pre-training batch given to the retention domain

    @cached_property
    def chains(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """`MarkovDomains.chains` plus "retain": (π_R, start distribution), from its own generator."""
        g = torch.Generator().manual_seed(self.seed + 1)
        retain = (torch.randperm(self.n_words, generator=g), torch.softmax(torch.randn(self.n_words, generator=g), 0))
        return {**MarkovDomains.chains.func(self), "retain": retain}

    def retained(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Retention questions: `sample(n, "retain")` with the marker A in place of Q."""
        s = self.sample(n, "retain", generator)
        s["input"][:, 1] = self.tokenizer.convert_tokens_to_ids("A")
        return s

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """Pre-training batch: `retain_frac` of it retention questions, the rest source questions (rows shuffled
        by the generator), whole question + answer, LM loss on every token."""
        k = round(n * self.retain_frac)
        s, r = self.sample(n - k, "source", generator), self.retained(k, generator)
        ids = torch.cat([torch.cat([s["input"], s["answer"]], 1), torch.cat([r["input"], r["answer"]], 1)])
        ids = ids[torch.randperm(n, generator=generator)]
        return {"input_ids": ids, "labels": ids.clone()}
