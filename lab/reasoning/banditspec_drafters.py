"""The two arms of BanditSpec's Table 1 that need more than a small LM: REST and EAGLE, as chain drafters for
`lab.reasoning.banditspec_decode.bandit_generate`.

- `Retrieval` — REST (He et al., NAACL 2024; official `FasterDecoding/REST`): a static datastore of text; the
  longest suffix of the current text, from `max_span` = 16 tokens down to 2 (the official `token_spans`; never 1),
  that occurs in the datastore; the continuations of its occurrences; the draft is their most frequent path. REST
  builds a trie of the retrieved continuations and verifies its `num_draft` = 64 most frequent nodes as a tree with
  tree attention; this loop verifies one chain, so the chain is the trie's most frequent path (`frequent_chain`).
  Differences: an exact match over the datastore's positions instead of its suffix array (`draftretriever`), every
  occurrence kept (it keeps ≤ 5,000, continuations ≤ 10 tokens), a separator between texts (its datastore
  concatenates them, so a match may run across two), and nothing drafted on a miss (it drafts a fixed token).
- `EagleHead` / `EagleDrafter` — EAGLE (Li et al., ICML 2024, arXiv 2401.15077; official `SafeAILab/EAGLE`,
  `eagle/model/cnets1.py`, `eagle/train/main.py`): autoregression at the feature level. With f_t the target's
  final-norm hidden state at position t (its LM head's input) and e(x) the target's token embedding (frozen), the
  head predicts f̂_{t+1} = Layer(fc([e(x_{t+1}); f_t])): fc a Linear(2D→D) with bias (the default; some official
  heads set it off), no activation, one Llama decoder layer without its input RMSNorm (`index == 0`), PyTorch's default
  initialisation, no final norm; the draft token comes from the target's own LM head applied to f̂. Training
  (Sec. 4 / `main.py`): L = SmoothL1(f̂_{t+1}, f_{t+1}) + w_cls · CE(softmax(head(f_{t+1})), head(f̂_{t+1})) with
  w_cls = `p_w` = 0.1, AdamW (β = 0.9, 0.95), on a fixed data set (here the task's own training mix) with the target
  frozen, input features perturbed by U(−0.1, 0.1) noise (the paper's value; the official code scales its width by
  512 / sequence length). Differences, for the toy's size: lr 1e-2 held constant (officially 3e-5 after 2,000
  warm-up steps, then linear decay, in bf16 mixed precision), a norm clip 0.5 (officially by value), the loss on
  pairs whose token x_{t+1} is an answer token (officially pairs whose x_t is; one pair apart at the prompt's end),
  and no KV cache in the head (it re-reads the whole text each draft step: the same numbers). EAGLE-2 (the paper's
  arm) grows a dynamic draft *tree* from the head's confidences; a chain verifier takes its greedy path, i.e.
  EAGLE-1's chain.
  At decode time the features come from the target's verification calls (`Cached(keep_feats=True)`): f_t is known for
  every verified position but the last (the bonus token has not been fed yet), exactly what EAGLE pairs with the
  text shifted by one. The first round of a prompt has no features yet: the head drafts nothing and the round is a
  plain target step (EAGLE's prefill; a bandit that pulls EAGLE first records a reward of 1 for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaModel

from lab.core.stages import stage
from lab.models.train import optimize
from lab.reasoning.banditspec_decode import Arm, frequent_chain, pick

# ------------------------------------------------------------------------------------------------- REST

class Retrieval:
    """REST's drafter over a static datastore `texts` (token lists); see the module docstring."""

    kind = "rest"

    def __init__(self, texts: list[list[int]], max_span: int = 16, min_span: int = 2, vocab_size: int | None = None):
        self.max_span, self.min_span, self.vocab_size = max_span, min_span, vocab_size
        sep = np.full(1, -1)  # a separator no token equals: no match crosses two texts
        self.data = np.concatenate([np.concatenate([np.asarray(t), sep]) for t in texts])
        self.ends = {}  # bigram -> positions of its last token (the index every longer match starts from)
        for i in range(1, len(self.data) - 1):
            self.ends.setdefault((int(self.data[i - 1]), int(self.data[i])), []).append(i)

    def conts(self, ids: list[int], gamma: int) -> list[list[int]]:
        """The ≤ γ-token continuations of every occurrence of the longest matching suffix (min_span…max_span)."""
        if len(ids) < self.min_span:
            return []
        pos = np.asarray(self.ends.get((ids[-2], ids[-1]), []), dtype=np.int64)
        pos = pos[self.data[pos + 1] >= 0]  # an occurrence needs a next token
        if not len(pos):
            return []
        span = min(self.max_span, len(ids))
        back = pos[:, None] - np.arange(span)  # (occurrences, span) positions read backwards
        tail = np.asarray(ids[-span:][::-1])
        ok = (back >= 0) & (self.data[np.clip(back, 0, None)] == tail)
        length = np.cumprod(ok, axis=1).sum(1)  # matched suffix length per occurrence
        best = pos[length == length.max()]
        out = []
        for p in best:
            c = self.data[p + 1:p + 1 + gamma]
            out.append(c[:np.argmax(c < 0)].tolist() if (c < 0).any() else c.tolist())
        return out

    def propose(self, ids: list[int], gamma: int, *, greedy: bool, temperature: float,
                gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        chain = frequent_chain(self.conts(ids, gamma), gamma)[0]
        if not chain or greedy:
            return chain, None
        return chain, F.one_hot(torch.tensor(chain), self.vocab_size).double()


# ------------------------------------------------------------------------------------------------ EAGLE

class EagleHead(nn.Module):
    """f̂_{t+1} = Layer(fc([e(x_{t+1}); f_t])): one Llama decoder layer (EAGLE's choice for every base model) with the
    target's width, heads and MLP width (`config`, any family: GPT-2's names are mapped by transformers), and the
    target's token embedding (V, D), frozen."""

    def __init__(self, config, embedding: torch.Tensor):
        super().__init__()
        V, D = embedding.shape
        heads = getattr(config, "num_attention_heads", None) or max(1, D // 64)
        cfg = LlamaConfig(vocab_size=V, hidden_size=D, num_hidden_layers=1, num_attention_heads=heads,
                          num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
                          intermediate_size=getattr(config, "intermediate_size", None) or 4 * D,
                          rms_norm_eps=getattr(config, "rms_norm_eps", None) or 1e-6,
                          max_position_embeddings=getattr(config, "max_position_embeddings", None) or 4096,
                          attn_implementation=getattr(config, "_attn_implementation", None) or "eager")
        self.fc = nn.Linear(2 * D, D, bias=True)
        self.body = LlamaModel(cfg)
        self.body.norm = nn.Identity()  # no final norm: f̂ regresses the post-norm feature itself
        self.body.layers[0].input_layernorm = nn.Identity()  # `cnets1.LlamaDecoderLayer`, index 0
        for m in self.body.modules():  # the official head is a plain nn.Module: PyTorch's default Linear init
            if isinstance(m, nn.Linear):
                m.reset_parameters()
        self.body.embed_tokens.weight.data.copy_(embedding)
        self.body.embed_tokens.weight.requires_grad_(False)

    def forward(self, feats: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """feats (B, T, D) = f_0..f_{T−1}, next_ids (B, T) = x_1..x_T → f̂_1..f̂_T (B, T, D)."""
        x = self.fc(torch.cat([self.body.embed_tokens(next_ids), feats], -1))
        return self.body(inputs_embeds=x).last_hidden_state


def features(target, ids: torch.Tensor) -> torch.Tensor:
    """The target's final-norm hidden states (B, T, D) of `ids` (B, T): its LM head's input."""
    return target(input_ids=ids, output_hidden_states=True).hidden_states[-1]


def eagle_loss(pred: torch.Tensor, feats: torch.Tensor, lm_head: nn.Module, mask: torch.Tensor,
               p_w: float = 0.1) -> torch.Tensor:
    """SmoothL1(f̂, f) averaged over the D dimensions + p_w · cross-entropy of head(f̂) against softmax(head(f)),
    both averaged over the positions where `mask` (B, T) is set (`main.py`'s `compute_loss`, v_w = 1)."""
    m = mask.float()
    v = F.smooth_l1_loss(pred, feats, reduction="none").mean(-1)
    with torch.no_grad():
        p_target = torch.softmax(lm_head(feats), -1)
    p = -(p_target * torch.log_softmax(lm_head(pred), -1)).sum(-1)
    return ((v + p_w * p) * m).sum() / m.sum().clamp_min(1)


@stage
def train_eagle(target, task, *, steps: int = 300, batch_size: int = 32, lr: float = 3e-3, noise: float = 0.1,
                p_w: float = 0.1, seed: int = 0, quiet: bool | None = None) -> tuple[EagleHead, list[float]]:
    """Train an EAGLE head on the frozen `target` over batches of `task` (`input_ids`, `labels` with −100 where no
    loss is taken: the loss covers pairs whose next token x_{t+1} is a labelled one). Returns (head, losses)."""
    torch.manual_seed(seed)
    dev = next(target.parameters()).device
    head = EagleHead(target.config, target.get_input_embeddings().weight.detach()).to(dev)
    gen = torch.Generator().manual_seed(seed)
    out = target.get_output_embeddings()
    w = out.weight.detach().float()  # the head trains in float32 whatever the target's dtype
    b = None if getattr(out, "bias", None) is None else out.bias.detach().float()
    lm_head = lambda h: F.linear(h, w, b)

    def step_loss(_: int) -> torch.Tensor:
        b = task.batch(batch_size, gen)
        ids = b["input_ids"].to(dev)
        with torch.no_grad():
            f = features(target, ids).float()
        f_in = f[:, :-1] + ((torch.rand(f[:, :-1].shape, generator=gen) * 2 - 1) * noise).to(dev)
        return eagle_loss(head(f_in, ids[:, 1:]), f[:, 1:], lm_head, b["labels"][:, 1:].to(dev) != -100, p_w)

    trainable = [p for p in head.parameters() if p.requires_grad]
    losses = optimize(trainable, step_loss, steps=steps, lr=lr, grad_clip=0.5,
                      optimizer=partial(torch.optim.AdamW, betas=(0.9, 0.95)), desc="EAGLE head", quiet=quiet)
    return head.eval(), losses


class EagleDrafter:
    """EAGLE as a chain drafter: the head extrapolates features from the target's verified ones (`target`, the
    target's `Cached` with `keep_feats`, set by `bandit_generate`) and its LM head names each draft token."""

    kind = "eagle"

    def __init__(self, head: EagleHead, target_model):
        self.head, self.lm_head, self.target = head, target_model.get_output_embeddings(), None

    @torch.inference_mode()
    def propose(self, ids: list[int], gamma: int, *, greedy: bool, temperature: float,
                gen: torch.Generator | None) -> tuple[list[int], torch.Tensor | None]:
        t, n = self.target, len(ids)
        if t is None or t.feats is None or n < 2 or t.held[:n - 1] != ids[:n - 1]:
            return [], None  # no verified features yet: the round is a plain target step
        f, nxt = t.feats[:n - 1], list(ids[1:])  # f_0..f_{n−2} paired with x_1..x_{n−1}
        dev = f.device
        drafts, qs = [], []
        for _ in range(gamma):
            f_hat = self.head(f[None], torch.tensor([nxt], device=dev))[0, -1]
            logits = self.lm_head(f_hat.to(self.lm_head.weight.dtype)).float()
            x = pick(logits, greedy=greedy, temperature=temperature, gen=gen, qs=qs)
            drafts.append(x)
            f, nxt = torch.cat([f, f_hat[None]]), nxt + [x]
        return drafts, (torch.stack(qs) if qs else None)


@dataclass(frozen=True, eq=False)
class TokenBlocks:
    """`train_eagle`'s task on a checkpoint: rows of `blocks` (n, T) token ids drawn with replacement, the loss on
    every position (a corpus of plain text has no prompt to mask)."""

    blocks: torch.Tensor

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        ids = self.blocks[torch.randint(len(self.blocks), (n,), generator=generator)]
        return {"input_ids": ids, "labels": ids.clone()}


# ---------------------------------------------------------------------------------------- the toy's K = 6

def datastore(task, rows: int, seed: int = 0) -> list[list[int]]:
    """REST's datastore for the toy: the answers (labelled tokens) of `rows` sequences of the task's training mix,
    drawn apart from the prompts (REST's chat datastore encodes whole conversations; a toy question adds nothing)."""
    b = task.batch(rows, torch.Generator().manual_seed(7000 + seed))
    return [row[lab != -100].tolist() for row, lab in zip(b["input_ids"], b["labels"])]


def with_paper_arms(models: dict, cfg, seed: int = 0, quiet: bool | None = None) -> dict:
    """The toy's models plus an EAGLE head trained on its target ("eagle", "eagle_losses") and REST's datastore."""
    head, losses = train_eagle(models["target"], models["task"], steps=cfg.eagle_steps, lr=cfg.eagle_lr, seed=seed,
                               quiet=quiet)
    store = datastore(models["task"], cfg.rest_rows, seed)
    return {**models, "eagle": head, "eagle_losses": losses, "datastore": store}


def paper_arms(models: dict, L: int, vocab_size: int) -> list[Arm]:
    """K = 6: `banditspec_bench.arms_of` (prompt lookup, draft-E, draft-G, suffix tree) + REST + EAGLE, all at γ = L;
    fresh for each policy run, like `arms_of`."""
    from lab.reasoning.banditspec_bench import arms_of

    return arms_of(models, L, vocab_size) + [
        Arm("REST", Retrieval(models["datastore"], vocab_size=vocab_size), L),
        Arm("EAGLE", EagleDrafter(models["eagle"], models["target"]), L)]
