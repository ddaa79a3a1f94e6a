"""Token Assorted: mixing latent and text tokens in reasoning traces (Su et al., ICML 2025, arXiv 2502.03275).

No official repository exists (the paper gives no code link); this follows the paper's notation (its Table of
notation, Fig. 3.1, Sec. 3) and says where a detail is not in the paper text.

**Stage 1 — VQ-VAE over chunks of L text tokens** (Sec. 3.1). f_enc maps a chunk to L/r vectors
x̄_1..x̄_{L/r}; q(·) replaces each by its nearest codebook entry e_k ∈ E (|E| = K); g(P) maps the prompt to one
vector; f_dec(q(X̄), g(P)) decodes the L tokens. Loss: reconstruction + VQ + β·commitment, β = 0.25. The
quantizer is `vector_quantize_pytorch.VectorQuantize` with the straight-through estimator (`rotation_trick=False`),
k-means initialisation and dead-code restart; its codebook is updated by exponential moving averages, the
standard replacement for the ‖sg[x̄] − e‖² codebook term (van den Oord et al. 2017, App. A.1). The encoder sees the
chunk only, so identical chunks get identical codes; the prompt enters through g(P) in the decoder. Trained on the
L-token chunks of P, C and S, each chunked from its own start so that a trace chunk is one step (the paper chunks the
whole X = P ⊕ C ⊕ S), applied to C only (Sec. 3.1).

**Stage 2 — mixed traces** (Sec. 3.2, Fig. 3.1): for each example draw m (a multiple of L), encode the first m
trace tokens chunk by chunk into m/r latent tokens, keep the rest as text:
X̃ = P ⊕ <boLatent> z_1 .. z_{m/r} <eoLatent> ⊕ c_{m+1:t_c} ⊕ S ("randomized replacement": m resampled per
example, uniform over {0, L, .., t_c} here; the paper's set for math is not a set of chunk multiples). The LM's
vocabulary is extended by K latent tokens and the two delimiters; next-token cross-entropy on the response,
latent tokens included, so the model can emit them.

Inference (constrained greedy decoding, forced-m decoding, the length metric) and the studies are in
`lab.reasoning.latent_tokens_study`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.nn import functional as F
from vector_quantize_pytorch import VectorQuantize

from lab.core.stages import stage
from lab.data.automaton import STEP_LEN, Automaton
from lab.models.spec import TinyLM
from lab.reasoning.icot import ICoTTask


@dataclass(frozen=True)
class Config:
    task: Automaton = field(default_factory=lambda: Automaton(n_states=4, n_actions=4, n_steps=5))
    L: int = STEP_LEN  # chunk size (text tokens)
    r: int = STEP_LEN  # compression rate t_c / t_z: L / r latent tokens a chunk
    K: int = 64  # codebook size |E|
    d_embed: int = 32
    d_latent: int = 16
    d_hidden: int = 128
    beta: float = 0.25  # commitment weight
    dead_code: int = 2  # restart codes whose EMA usage falls below this
    vq_steps: int = 150  # held-out reconstruction is exact, every distinct chunk its own code, by 150 on seeds 0-9
    vq_batch: int = 32  # problems a step (each gives all its chunks of P ⊕ C ⊕ S)
    vq_lr: float = 3e-3
    lm: TinyLM = TinyLM("llama", d_model=64, n_layers=2, n_heads=4, max_len=96, d_ff=128, steps=250, batch_size=32)
    # The latent model must learn its new tokens' meaning, in and out: with 32 sequences a step its latent mode was at
    # 53-87 % after 400 steps (5 seeds) and 99-100 % after 500 (4 seeds); 16 sequences a step for 800 steps reach
    # 100 % with fewer sequences in all (seeds 0-9). CoT is at 100 % by 250 steps of 32.
    latent_steps: int = 800
    latent_batch: int = 16
    sol_steps: int = 150  # Sol-Only is at chance however long it trains (28 % after 1000 steps on seeds 0 and 7)
    icot_steps: int = 400  # iCoT: C deleted from the left over the first 3/4 (`lab.reasoning.icot`), then P ⊕ S
    n_eval: int = 500
    forced_frac: float = 0.75  # forced-m decoding: k = ⌈forced_frac · n⌉ chunks (m = kL)
    shuffled: bool = False  # control: latent tokens replaced by random codebook ids in training

    @classmethod
    def for_scale(cls, scale: str = "smoke", control: str = "") -> Config:
        """One automaton (`Automaton.seed` 0) at every seed: a seed varies the models, the data order and the held-out
        draws, not the task. (Automata drawn per seed were tried: seed 3's repeats one map for three of its four
        actions, so the answer follows from counts and answer-only reaches 69 %; it is no longer a serial task.)"""
        cfg = cls() if scale == "smoke" else cls(task=Automaton(n_states=5, n_actions=6, n_steps=8), vq_steps=1500,
                                                 n_eval=2000, latent_steps=3000, latent_batch=32, sol_steps=3000,
                                                 icot_steps=3000,
                                                 lm=replace(cls.lm, d_model=128, n_layers=3, d_ff=256, steps=3000))
        if control == "shuffled_codes":
            cfg = replace(cfg, shuffled=True)
        elif control == "no_compression":  # m text tokens -> m latent tokens (r = 1): no length reduction
            cfg = replace(cfg, r=1)
        return cfg

    @property
    def n_z(self) -> int:
        return self.L // self.r

    def vq_only(self) -> Config:
        """This config with the fields the VQ-VAE does not read at their defaults: what keys its stage cache, so a
        control that changes only the LM (`shuffled_codes`) reuses the trained VQ-VAE."""
        return replace(self, lm=Config.lm, latent_steps=0, latent_batch=0, sol_steps=0, icot_steps=0, n_eval=0,
                       forced_frac=0.0, shuffled=False)


@dataclass(frozen=True)
class Vocab:
    """Ids of the extended vocabulary: the text vocabulary V, then <boLatent>, <eoLatent>, then K latents."""

    n_text: int
    K: int
    eos: int
    ans: int
    pad: int = 0

    @property
    def bol(self) -> int:
        return self.n_text

    @property
    def eol(self) -> int:
        return self.n_text + 1

    @property
    def first_latent(self) -> int:
        return self.n_text + 2

    @property
    def size(self) -> int:
        return self.n_text + 2 + self.K


def vocab_of(cfg: Config) -> Vocab:
    ids = cfg.task.ids
    return Vocab(cfg.task.vocab_size, cfg.K, ids["<eos>"], ids["ans"], ids["<pad>"])


# ---------------------------------------------------------------- Stage 1: the VQ-VAE
class VQVAE(nn.Module):
    """f_enc (chunk -> L/r vectors), q (nearest codebook entry), g (prompt -> vector), f_dec (codes, g(P) -> chunk)."""

    def __init__(self, cfg: Config, vocab_size: int):
        super().__init__()
        self.L, self.n_z, self.d = cfg.L, cfg.n_z, cfg.d_latent
        self.emb = nn.Embedding(vocab_size, cfg.d_embed)
        self.f_enc = nn.Sequential(nn.Linear(cfg.L * cfg.d_embed, cfg.d_hidden), nn.GELU(),
                                   nn.Linear(cfg.d_hidden, self.n_z * cfg.d_latent))
        self.q = VectorQuantize(dim=cfg.d_latent, codebook_size=cfg.K, commitment_weight=cfg.beta, kmeans_init=True,
                                kmeans_iters=10, threshold_ema_dead_code=cfg.dead_code, rotation_trick=False)
        self.g = nn.Sequential(nn.Linear(cfg.d_embed, cfg.d_hidden), nn.GELU(), nn.Linear(cfg.d_hidden, cfg.d_hidden))
        self.f_dec = nn.Sequential(nn.Linear(self.n_z * cfg.d_latent + cfg.d_hidden, cfg.d_hidden), nn.GELU(),
                                   nn.Linear(cfg.d_hidden, cfg.L * vocab_size))
        self.vocab_size = vocab_size

    def x_bar(self, chunks: torch.Tensor) -> torch.Tensor:
        """f_enc: (B, L) token ids -> (B, L/r, d)."""
        return self.f_enc(self.emb(chunks).flatten(1)).view(len(chunks), self.n_z, self.d)

    def g_of(self, prompt: torch.Tensor, pad: int = 0) -> torch.Tensor:
        """g(P): mean of the prompt's token embeddings (pads excluded) through an MLP, (B, d_hidden)."""
        keep = (prompt != pad).unsqueeze(-1).float()
        return self.g((self.emb(prompt) * keep).sum(1) / keep.sum(1).clamp_min(1))

    def decode(self, zq: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """f_dec: quantised vectors (B, L/r, d) and the prompt -> logits (B, L, V)."""
        return self.f_dec(torch.cat([zq.flatten(1), self.g_of(prompt)], 1)).view(len(zq), self.L, self.vocab_size)

    def forward(self, chunks: torch.Tensor, prompt: torch.Tensor):
        """Logits (B, L, V), codes (B, L/r) and the VQ loss (commitment; the codebook follows by EMA)."""
        zq, codes, vq_loss = self.q(self.x_bar(chunks))
        return self.decode(zq, prompt), codes, vq_loss.sum()

    @torch.no_grad()
    def codes(self, chunks: torch.Tensor) -> torch.Tensor:
        """q(f_enc(chunk)): codebook indices (B, L/r), the argmin_k ‖x̄ − e_k‖."""
        was = self.training
        self.eval()
        _, idx, _ = self.q(self.x_bar(chunks))
        self.train(was)
        return idx

    @torch.no_grad()
    def decode_codes(self, codes: torch.Tensor, prompt: torch.Tensor) -> torch.Tensor:
        """Text token ids (B, L) that f_dec reads from codebook indices (B, L/r) — to audit latent tokens."""
        return self.decode(self.q.get_output_from_indices(codes), prompt).argmax(-1)


def chunks_of(x: torch.Tensor, L: int, pad: int = 0) -> torch.Tensor:
    """(B, T) -> (B·⌈T/L⌉, L): consecutive L-token chunks, the last padded with `pad`."""
    B, T = x.shape
    x = F.pad(x, (0, -T % L), value=pad)
    return x.reshape(-1, L)


def vq_batch(task: Automaton, n: int, L: int, g: torch.Generator):
    """Chunks of P, C and S (each chunked from its own start) of `n` problems, with each chunk's prompt."""
    P, C, S = task.encode(task.sample(n, g))
    parts = [chunks_of(x, L).view(n, -1, L) for x in (P, C, S)]
    ch = torch.cat(parts, 1)  # (n, chunks, L)
    return ch.reshape(-1, L), P.repeat_interleave(ch.shape[1], 0)


def train_vqvae(cfg: Config, seed: int) -> tuple[VQVAE, list[float]]:
    """Stage 1: reconstruction cross-entropy + β·commitment on chunks of X = P ⊕ C ⊕ S, Adam (stage-cached)."""
    return _train_vqvae(cfg.vq_only(), seed)


@stage
def _train_vqvae(cfg: Config, seed: int) -> tuple[VQVAE, list[float]]:
    torch.manual_seed(seed)
    vq = VQVAE(cfg, cfg.task.vocab_size)
    opt = torch.optim.Adam(vq.parameters(), lr=cfg.vq_lr)
    g, losses = torch.Generator().manual_seed(seed), []
    for _ in range(cfg.vq_steps):
        ch, P = vq_batch(cfg.task, cfg.vq_batch, cfg.L, g)
        logits, _, vq_loss = vq(ch, P)
        loss = F.cross_entropy(logits.flatten(0, 1), ch.flatten()) + vq_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return vq.eval(), losses


@torch.no_grad()
def vq_report(vq: VQVAE, cfg: Config, seed: int, n: int = 500) -> dict:
    """Held-out trace chunks: token reconstruction accuracy, codebook usage histogram and perplexity."""
    P, C, _ = cfg.task.encode(cfg.task.sample(n, torch.Generator().manual_seed(10_000 + seed), split="test"))
    ch = chunks_of(C, cfg.L)
    codes = vq.codes(ch)
    rec = vq.decode_codes(codes, P.repeat_interleave(C.shape[1] // cfg.L, 0))
    counts = torch.bincount(codes.flatten(), minlength=cfg.K).float()
    p = counts / counts.sum()
    return {"recon_acc": (rec == ch).float().mean().item(), "usage": counts.long().tolist(),
            "perplexity": math.exp(-(p[p > 0] * p[p > 0].log()).sum().item()), "used": int((counts > 0).sum())}


def code_table(vq: VQVAE, cfg: Config) -> torch.Tensor:
    """Codes of every possible trace chunk `T_t -> s ;`: (n_steps, n_states, L/r). The encoder sees the chunk only,
    so this table is what encoding any trace gives."""
    t = cfg.task
    v = t.ids
    T, S = torch.meshgrid(torch.arange(t.n_steps), torch.arange(t.n_states), indexing="ij")
    ch = torch.stack([v["T1"] + T, torch.full_like(T, v["->"]), v["s0"] + S, torch.full_like(T, v[";"])], -1)
    return vq.codes(ch.reshape(-1, cfg.L)).view(t.n_steps, t.n_states, cfg.n_z)


# ---------------------------------------------------------------- Stage 2: mixed traces and the LM
def mix_trace(prompt: torch.Tensor, trace: torch.Tensor, solution: torch.Tensor, z: torch.Tensor, k: int, *,
              L: int, vocab: Vocab) -> torch.Tensor:
    """X̃ = P ⊕ <boLatent> z_1..z_{k·L/r} <eoLatent> ⊕ C[kL:] ⊕ S for one example: the first k chunks (m = kL
    tokens) replaced by their latent tokens `z` (codebook ids, (n_chunks·L/r,)); k = 0 gives X unchanged."""
    n_z = len(z) // max(1, len(trace) // L)
    latent = [vocab.bol, *(vocab.first_latent + z[: k * n_z]).tolist(), vocab.eol] if k else []
    return torch.cat([prompt, torch.tensor(latent, dtype=torch.long), trace[k * L:], solution])


@dataclass(frozen=True)
class TraceTask:
    """Training data of one LM: `mode` "sol" (P ⊕ S), "cot" (P ⊕ C ⊕ S), "pause" (P ⊕ <pause>×|C| ⊕ S: the Pause
    Token baseline of Goyal et al. 2023, as many pauses as the trace has tokens, no loss on them; <pause> is id
    `Vocab.bol` of a text-only model) or "latent" (X̃, k = m/L uniform in 0..n per example). Its fields key the
    trained-model cache, so Sol-Only, CoT and Pause do not depend on the VQ-VAE."""

    task: Automaton
    mode: str = "cot"
    L: int = STEP_LEN
    n_z: int = 1  # latent tokens a chunk (L / r)
    K: int = 64
    codes: tuple[int, ...] = ()  # code_table flattened: (n_steps, n_states, L/r)
    shuffled: bool = False  # control: random codebook ids instead of the VQ codes

    @classmethod
    def of(cls, cfg: Config, mode: str, codes: tuple[int, ...] = ()) -> TraceTask:
        if mode != "latent":
            return cls(cfg.task, mode, cfg.L, K=cfg.K)
        return cls(cfg.task, mode, cfg.L, cfg.n_z, cfg.K, tuple(codes), cfg.shuffled)

    @property
    def vocab(self) -> Vocab:
        ids = self.task.ids
        return Vocab(self.task.vocab_size, self.K, ids["<eos>"], ids["ans"], ids["<pad>"])

    def z_of(self, states: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """Latent codes (B, n_steps·L/r) of the traces with these states (random ids under `shuffled`)."""
        t = self.task
        if self.shuffled:
            return torch.randint(self.K, (len(states), t.n_steps * self.n_z), generator=g)
        table = torch.tensor(self.codes).view(t.n_steps, t.n_states, self.n_z)
        return table[torch.arange(t.n_steps), states].flatten(1)

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        t, vocab = self.task, self.vocab
        ex = t.sample(n, generator)
        P, C, S = t.encode(ex)
        if self.mode == "latent":
            z = self.z_of(ex["states"], generator)
            k = torch.randint(t.n_steps + 1, (n,), generator=generator)
            seqs = [mix_trace(P[i], C[i], S[i], z[i], int(k[i]), L=self.L, vocab=vocab) for i in range(n)]
        else:
            mid = {"sol": C[:, :0], "cot": C, "pause": torch.full_like(C, vocab.bol)}[self.mode]
            seqs = list(torch.cat([P, mid, S], 1))
        x = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=vocab.pad)
        labels = x.masked_fill(x == vocab.pad, -100)
        labels[:, : P.shape[1] + (C.shape[1] if self.mode == "pause" else 0)] = -100  # loss on the response only
        return {"input_ids": x, "labels": labels}


def extend_vocab(model, n_new: int, tokenizer=None, names=None):
    """Add `n_new` rows to the input and output embeddings (`resize_token_embeddings`, new rows drawn around the
    mean of the old ones — the paper does not say how it initialises them); with a tokenizer, also add `names` as
    tokens so ids agree. Returns the model."""
    if tokenizer is not None:
        tokenizer.add_tokens(list(names), special_tokens=True)
    model.resize_token_embeddings(model.get_input_embeddings().num_embeddings + n_new, mean_resizing=True)
    return model


def train_lm(cfg: Config, mode: str, seed: int, *, codes: tuple[int, ...] = (), device: str = "cpu"):
    """One LM from scratch through the cached trainer (`TinyLM.fit`), as the paper's Table 4.1 models: Sol-Only, CoT
    and iCoT (`lab.reasoning.icot`) on the text vocabulary, Latent on the vocabulary extended by the two delimiters
    and K latent tokens (the extension of a pretrained model is `extend_vocab`)."""
    vocab, task = vocab_of(cfg), TraceTask.of(cfg, mode, codes)
    if mode == "icot":  # a fresh task: it counts the trainer's steps
        task = ICoTTask(cfg.task, cfg.icot_steps, pad=vocab.pad)
        return replace(cfg.lm, steps=cfg.icot_steps).fit(task, vocab.n_text, seed=seed, device=device)
    if mode == "latent":
        lm, n_vocab = replace(cfg.lm, steps=cfg.latent_steps, batch_size=cfg.latent_batch), vocab.size
    elif mode == "pause":
        lm, n_vocab = cfg.lm, vocab.n_text + 1  # <pause> = vocab.bol
    else:
        lm, n_vocab = replace(cfg.lm, steps=cfg.sol_steps) if mode == "sol" else cfg.lm, vocab.n_text
    return lm.fit(task, n_vocab, seed=seed, device=device)
