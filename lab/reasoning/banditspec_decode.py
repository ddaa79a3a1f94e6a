"""BanditSpec's decoding loop (Alg. 3 with `SpecDecSub` = Alg. 1/6) for any pair of `transformers` causal LMs
that share a tokenizer: drafters, KV caches cropped on rejection, greedy and rejection-sampling verification.

- An arm is (drafter, γ): `LMDrafter` (a small causal LM, its own `DynamicCache`) or `PromptLookup` (n-gram match
  over prompt + generated text, as `transformers`' `PromptLookupCandidateGenerator`: longest n-gram first, the
  earliest earlier occurrence with a continuation) or `SuffixTree` (SuffixDecoding: the most frequent continuation
  in the prompt and in earlier outputs); `lab.reasoning.banditspec_drafters` adds REST and EAGLE. A drafter
  proposes up to γ tokens and, for sampling, their draft distributions q (the model-free drafters' q is one-hot).
- Caches hold a prefix of the verified text; each call first crops a cache to the longest common prefix with the
  current text and feeds what is missing (an idle drafter catches up with the tokens other arms produced).
- Greedy: accept the longest prefix of drafts equal to the target argmax, then the target's argmax (the official
  `sail-sg/BanditSpec` rule). Sampling (Leviathan et al. 2023 / Chen et al. 2023, the paper's Alg. 6): accept x̃_i
  w.p. min(1, p_i(x̃_i)/q_i(x̃_i)); on the first rejection sample from norm([p_i − q_i]_+) and stop; if all γ are
  accepted, a bonus token from p_γ. The output then has exactly the target's distribution (Prop. 3.1).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import DynamicCache

from lab.reasoning.banditspec import make_policy


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) in float64 (greedy callers use argmax on the logits instead)."""
    return torch.softmax(logits.double() / temperature, dim=-1)


def pick(logits: torch.Tensor, *, greedy: bool, temperature: float, gen: torch.Generator | None, qs: list) -> int:
    """A model drafter's next token from its `logits` (V,): the argmax when greedy, else a sample from
    softmax(logits / T), whose distribution q is appended to `qs` (speculative sampling needs each draft's q)."""
    if greedy:
        return int(logits.argmax())
    q = probs(logits, temperature)
    qs.append(q)
    return int(torch.multinomial(q.cpu(), 1, generator=gen))


class Cached:
    """A causal LM with a KV cache over a prefix of the text; `logits(ids)` returns the next-token logits at the
    last (n_new + 1) positions after syncing, where the first n_new of them follow fed-but-unchecked tokens.
    `feats` (len(held), D): the final-norm hidden state at every held position (the LM head's input, what an EAGLE
    head reads), kept and cropped with the cache when `keep_feats`."""

    def __init__(self, model, keep_feats: bool = False):
        self.model, self.cache, self.held, self.keep_feats = model, None, [], keep_feats
        self.feats: torch.Tensor | None = None
        self.device = next(model.parameters()).device

    @torch.inference_mode()
    def feed(self, ids: list[int], n_out: int = 1) -> torch.Tensor:
        """Make the cache hold `ids` and return the logits (n_out, V) of the last n_out positions of ids."""
        common = 0
        for a, b in zip(self.held, ids):
            if a != b:
                break
            common += 1
        keep = min(common, len(ids) - n_out)  # the last n_out positions must be recomputed for their logits
        if self.cache is None:
            self.cache = DynamicCache()
        drop = self.cache.get_seq_length() - keep
        if drop > 0:
            self.cache.crop(-drop)  # crop on rejection (transformers 5: a negative count of tokens to remove)
        new = torch.tensor([ids[keep:]], device=self.device)
        out = self.model(input_ids=new, cache=self.cache, use_cache=True,  # transformers 5: `cache=`
                         output_hidden_states=self.keep_feats)
        if self.keep_feats:
            h = out.hidden_states[-1][0].float()  # after the final norm (transformers' last entry)
            self.feats = h if self.feats is None or keep == 0 else torch.cat([self.feats[:keep], h])
        self.held = list(ids)
        self.calls = getattr(self, "calls", 0) + 1
        return out.logits[0, -n_out:].float()


class LMDrafter:
    """A small causal LM drafting autoregressively from its own cache."""

    kind = "lm"

    def __init__(self, model):
        self.lm = Cached(model)

    def propose(self, ids: list[int], gamma: int, *, greedy: bool, temperature: float,
                gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        """Up to γ draft tokens and their draft distributions q (γ, V) (None when greedy)."""
        drafts, qs, ctx = [], [], list(ids)
        for _ in range(gamma):
            x = pick(self.lm.feed(ctx)[-1], greedy=greedy, temperature=temperature, gen=gen, qs=qs)
            drafts.append(x)
            ctx.append(x)
        return drafts, (torch.stack(qs) if qs else None)


class PromptLookup:
    """Prompt-lookup decoding: the continuation of the earliest earlier match of the text's last n-gram, n from
    `max_ngram` down to 1; no match → no drafts (the round is one plain target step)."""

    kind = "pld"

    def __init__(self, max_ngram: int = 3, vocab_size: int | None = None):
        self.max_ngram, self.vocab_size = max_ngram, vocab_size

    def propose(self, ids: list[int], gamma: int, *, greedy: bool, temperature: float,
                gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        arr = np.asarray(ids)
        for n in range(min(self.max_ngram, len(ids) - 1), 0, -1):
            tail = arr[-n:]
            win = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # windows that end before the last token
            for s in np.flatnonzero((win == tail).all(axis=1)):
                cont = ids[s + n: s + n + gamma]
                if cont:
                    q = None if greedy else torch.nn.functional.one_hot(torch.tensor(cont), self.vocab_size).double()
                    return cont, q
        return [], None


def frequent_chain(conts: list[list[int]], gamma: int, min_prob: float = 0.0) -> tuple[list[int], float]:
    """The most frequent path through continuations `conts` (a trie walked by counts), up to γ tokens, while the
    path's empirical probability (the product of count(child) / count(children)) stays ≥ `min_prob`:
    (chain, Σ path probabilities = the expected accepted tokens if the counts were the truth)."""
    chain, p, score = [], 1.0, 0.0
    for j in range(gamma):
        counts = Counter(c[j] for c in conts if len(c) > j)
        if not counts:
            break
        x, c = counts.most_common(1)[0]
        p *= c / sum(counts.values())
        if p < min_prob:
            break
        chain.append(x)
        score += p
        conts = [c for c in conts if len(c) > j and c[j] == x]
    return chain, score


class SuffixTree:
    """SuffixDecoding (Oliaro et al., 2024), the paper's model-free "Suffix Tree" arm, as one chain: a per-request
    tree over the prompt and the text generated so far, and a global tree over earlier requests' outputs (`finish`
    adds one). In each tree the longest suffix of the text (≤ `max_depth` tokens) that occurs with a continuation is
    the match; from there the chain follows the most frequent next token while the path's empirical probability
    (the product of count(child) / count(children of the node)) stays ≥ `min_prob`; the tree whose chain has the
    larger score Σ path probabilities (expected accepted tokens) drafts. Counting the occurrences of the matched
    text is the suffix tree's walk (a node's count is its substring's occurrences); no tree is materialised.
    SuffixDecoding grows a speculation *tree* and tries several match lengths; the chain, the longest match and
    the text kept (whole outputs) are this lab's simplifications for a chain verifier."""

    kind = "suffix"

    def __init__(self, max_depth: int = 16, min_prob: float = 0.1, vocab_size: int | None = None):
        self.max_depth, self.min_prob, self.vocab_size = max_depth, min_prob, vocab_size
        self.outputs: list[list[int]] = []

    def finish(self, output: list[int]) -> None:
        self.outputs.append(list(output))

    def walk(self, texts: list[list[int]], ids: list[int], gamma: int) -> tuple[list[int], float]:
        """(chain, score) of the longest match of ids' suffix in `texts`."""
        conts: list[list[int]] = []
        for n in range(min(self.max_depth, len(ids)), 0, -1):
            tail = np.asarray(ids[-n:])
            for t in texts:
                arr = np.asarray(t)
                if len(arr) > n:
                    win = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # matches with a next token
                    conts += [t[s + n:s + n + gamma] for s in np.flatnonzero((win == tail).all(axis=1))]
            if conts:
                break
        return frequent_chain(conts, gamma, self.min_prob)

    def propose(self, ids: list[int], gamma: int, *, greedy: bool, temperature: float,
                gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        local, glob = self.walk([ids], ids, gamma), self.walk(self.outputs, ids, gamma)
        chain = (glob if glob[1] > local[1] else local)[0]
        if not chain or greedy:
            return chain, None
        return chain, torch.nn.functional.one_hot(torch.tensor(chain), self.vocab_size).double()


@dataclass(frozen=True)
class Arm:
    name: str
    drafter: object
    gamma: int


def verify_greedy(logits: torch.Tensor, drafts: list[int]) -> tuple[int, int]:
    """(accepted count k, bonus token): longest prefix of drafts equal to argmax, then argmax at position k.
    `logits` (len(drafts)+1, V): row i predicts the token after drafts[:i]."""
    top = logits.argmax(-1).tolist()
    k = 0
    while k < len(drafts) and drafts[k] == top[k]:
        k += 1
    return k, top[k]


def verify_sample(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int],
                  gen: torch.Generator | None) -> tuple[int, int]:
    """(k, next token) by speculative sampling: p (γ+1, V) target, q (γ, V) draft distributions (q moved to p's
    device: prompt lookup's one-hot drafts are built on the host)."""
    q = q.to(p.device) if q is not None else q
    for i, x in enumerate(drafts):
        if torch.rand((), generator=gen, dtype=torch.float64) < min(1.0, float(p[i, x] / q[i, x])):
            continue
        residual = (p[i] - q[i]).clamp_min(0)  # norm([p − q]_+)
        return i, int(torch.multinomial((residual / residual.sum()).cpu(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)].cpu(), 1, generator=gen))


@dataclass
class Trace:
    """One prompt's decoding: new tokens, per round the arm, drafts offered and accepted (Y = accepted + 1)."""

    tokens: list[int]
    arms: list[int] = field(default_factory=list)
    offered: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    source: list[int] = field(default_factory=list)  # per new token: arm index that drafted it, −1 = target

    @property
    def rounds(self) -> int:  # the stopping time ST = target calls
        return len(self.arms)

    @property
    def mat(self) -> float:  # mean accepted tokens per round, bonus included
        return len(self.tokens) / max(self.rounds, 1)


def bandit_generate(target, arms: list[Arm], prompt: list[int], max_new: int, *, policy: str = "UCBSpec",
                    greedy: bool = True, temperature: float = 1.0, seed: int = 0, eos: int | None = None,
                    cr_scale: float = 1.0, delta: float = 0.5, radius: str = "paper",
                    bandit: str = "bandit") -> Trace:
    """BanditSpec (Alg. 3) on one prompt: each round the policy picks an arm from the history, the arm drafts,
    the target verifies all drafts in one forward call; the bandit restarts for every prompt. Rounds stop once
    `max_new` tokens (or eos) are out; the output is cut there, as `generate(max_new_tokens=...)` does."""
    L = max(a.gamma for a in arms)
    pol = make_policy(policy, len(arms), 1, rng=np.random.default_rng(seed), L=L, delta=delta, cr_scale=cr_scale,
                      radius=radius, bandit=bandit)
    gen = torch.Generator().manual_seed(seed)
    tgt = Cached(target, keep_feats=any(a.drafter.kind == "eagle" for a in arms))
    ids, tr = list(prompt), Trace([])
    for a in arms:  # a fresh cache per prompt for every LM drafter; an EAGLE head reads the target's features
        if a.drafter.kind == "lm":
            a.drafter.lm.cache, a.drafter.lm.held = None, []
        elif a.drafter.kind == "eagle":
            a.drafter.target = tgt
    while len(tr.tokens) < max_new and (eos is None or eos not in tr.tokens):
        i = int(pol.select()[0])
        arm = arms[i]
        drafts, q = arm.drafter.propose(ids, arm.gamma, greedy=greedy, temperature=temperature, gen=gen)
        logits = tgt.feed(ids + drafts, n_out=len(drafts) + 1)  # one verification call of P
        if greedy:
            k, nxt = verify_greedy(logits, drafts)
        else:
            k, nxt = verify_sample(probs(logits, temperature), q, drafts, gen)
        out = drafts[:k] + [nxt]
        ids += out
        tr.tokens += out
        tr.source += [i] * k + [-1]
        tr.arms.append(i)
        tr.offered.append(len(drafts))
        tr.accepted.append(k)
        pol.update(np.array([i]), np.array([k + 1.0]))
    cut = len(tr.tokens) if eos is None or eos not in tr.tokens else tr.tokens.index(eos) + 1
    tr.tokens, tr.source = tr.tokens[:min(cut, max_new)], tr.source[:min(cut, max_new)]
    for a in {id(a.drafter): a.drafter for a in arms}.values():  # a suffix tree remembers this output
        if a.kind == "suffix":
            a.finish(tr.tokens)
    return tr
