"""Over-Tokenized Transformer (Huang et al., ICML 2025): Over-Encoding, hashed n-gram input vocabularies.

arXiv 2501.16975; no official code — the paper's Appendix A pseudocode (Algorithm 1, Over-Encoding) is followed.
The input vocabulary is scaled while the output vocabulary (the LM head) stays the base tokenizer's V.

- n-gram ids (method section): x_i^{(−n)} = Σ_{j=1..n} x_{i−j+1} V^{j−1}, the current token the least
  significant digit, positions before the sequence start read as token 0 (a right shift with left zero-padding:
  only past tokens).
- Tiled / sliced embedders (method section): 𝔼^{m×d}(x) = E(x mod m); 𝔼^{m×d|k}(x) = Σ_{i=1..k} 𝔼_i(x) W_i, the
  k slices with distinct moduli.
- Over-Encoding as Algorithm 1 writes it: x = wte(x^{(−1)}); for every order i = 2..n and slice j = 0..k−1,
  idx = (i−2)k + j, x += W_idx E_idx(x^{(−i)} mod (m + 2·idx)), E_idx ∈ R^{(m+2 idx) × D/(k(n−1))},
  W_idx: Linear(D/(k(n−1)) → D); finally x /= 1 + k(n−1). (The method section's OE equation gives each order
  width d/n; the appendix's per-table width D/(k(n−1)) is used, so the n-gram tables hold ≈ m·D parameters, the
  paper's "OE-m".) The 1-gram table is the model's own input embedding.
- The hash is computed incrementally in int64 as Σ_j x_{i−j+1}·(V^{j−1} mod M) mod M, a sum of residues equal
  to the exact big-int id mod M (`ngram_id_exact`) without overflow for any n.

Choices the paper leaves open, made here: tables initialised N(0, σ²) with σ the base model's
`initializer_range`; projections are `nn.Linear` with bias (PyTorch's default in the pseudocode); no reset of the
n-gram history inside a packed sequence (one document per sequence in the toy). `OverTokenizedLM` feeds
OE(x) to any `transformers` causal LM through `inputs_embeds`; `save` / `load` write the base with
`save_pretrained` (its config carries the OE settings) and the n-gram tables in `over_encoding.safetensors`.
Over-Decoding (Appendix A, Algorithm 2) is `OverDecodingLM`: extra heads for the tokens after the next one; the
MTP-DS head of the full OT model is not built.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lab.core import params

IDS = ("ngram", "leak", "unigram")  # how the tables are indexed: the paper's / a left shift / the current token
CONTROLS = {  # the substitutions a skeptic would make; the notebook declares which claims each must break
    "unigram_ids": "every n-gram table indexed by the current token alone: as many embedding parameters, no context",
}
WEIGHTS = "over_encoding.safetensors"


def check_control(control: str) -> str:
    """`""` or one of Over-Encoding's `CONTROLS` (else one `ParamError` sentence naming them)."""
    return params.check_control(control, CONTROLS)


# ------------------------------------------------------------------------ n-gram ids

def shift(ids: Tensor, j: int) -> Tensor:
    """ids moved j positions right along the last dim, 0 filled in on the left (j < 0: moved left, the leak)."""
    if j == 0:
        return ids
    T = ids.shape[-1]
    if abs(j) >= T:
        return torch.zeros_like(ids)
    return F.pad(ids[..., :-j], (j, 0)) if j > 0 else F.pad(ids[..., -j:], (0, -j))


def ngram_id(ids: Tensor, order: int, vocab: int, modulus: int, *, ids_mode: str = "ngram") -> Tensor:
    """x^{(−order)} mod `modulus` (same shape as ids, int64): Σ_{j<order} shift(ids, j)·(V^j mod M) mod M.

    `ids_mode` "leak" shifts left (x_{t+j}: a known-wrong variant); "unigram" returns x_t mod M."""
    if ids_mode not in IDS:
        raise ValueError(f"ids_mode={ids_mode!r}; use one of {IDS}.")
    ids = ids.long()
    g = ids % modulus
    if ids_mode == "unigram":
        return g
    for j in range(1, order):
        s = shift(ids, -j if ids_mode == "leak" else j)
        g = (g + s * pow(vocab, j, modulus)) % modulus
    return g


def ngram_id_exact(tokens: list[int], t: int, order: int, vocab: int) -> int:
    """The exact big-int n-gram id Σ_{j=1..order} x_{t−j+1} V^{j−1} at position t (positions < 0 read as 0)."""
    return sum((tokens[t - j] if t - j >= 0 else 0) * vocab ** j for j in range(order))


# ------------------------------------------------------------------------ Over-Encoding (Algorithm 1)

class OverEncoding(nn.Module):
    """OE(x) = (wte(x) + Σ_{i=2..n} Σ_{j<k} W_idx E_idx(x^{(−i)} mod (m + 2 idx))) / (1 + k(n−1)).

    `wte` is the model's own input embedding (the 1-gram table, shared, not copied); `unigram=False` drops it
    (the paper's "bad choice", then divided by k(n−1))."""

    def __init__(self, wte: nn.Embedding | None, vocab: int, d_model: int, *, n: int = 2, k: int = 1,
                 m: int = 1021, unigram: bool = True, ids_mode: str = "ngram", init_std: float = 0.02):
        super().__init__()
        n_tables = k * (n - 1)
        if n < 2 or k < 1 or d_model % n_tables:
            raise ValueError(f"n={n}, k={k}: need n ≥ 2, k ≥ 1 and k(n−1) dividing d_model={d_model}.")
        if unigram and wte is None:
            raise ValueError("unigram=True needs the model's input embedding `wte`.")
        self.vocab, self.n, self.k, self.m, self.unigram, self.ids_mode = vocab, n, k, m, unigram, ids_mode
        self.wte = wte if unigram else None
        width = d_model // n_tables
        self.tables = nn.ModuleList(nn.Embedding(m + 2 * idx, width) for idx in range(n_tables))
        self.proj = nn.ModuleList(nn.Linear(width, d_model) for _ in range(n_tables))
        for t in self.tables:
            nn.init.normal_(t.weight, std=init_std)

    def moduli(self) -> list[int]:
        return [t.num_embeddings for t in self.tables]

    def table_ids(self, ids: Tensor) -> list[Tensor]:
        """The row read in each table (n_tables × ids.shape): order i = 2 + idx // k, modulus m + 2 idx."""
        return [ngram_id(ids, 2 + idx // self.k, self.vocab, M, ids_mode=self.ids_mode)
                for idx, M in enumerate(self.moduli())]

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) if self.unigram else 0.0
        for rows, table, proj in zip(self.table_ids(ids), self.tables, self.proj):
            x = x + proj(table(rows))
        return x / (len(self.tables) + int(self.unigram))

    def spec(self) -> dict:
        """What rebuilds this module on a model (stored in the model's config as `over_encoding`)."""
        return {"n": self.n, "k": self.k, "m": self.m, "unigram": self.unigram, "ids_mode": self.ids_mode}

    def n_params(self) -> int:
        """Parameters of the n-gram tables and projections (the 1-gram table belongs to the model)."""
        return sum(p.numel() for mod in (self.tables, self.proj) for p in mod.parameters())


class OverTokenizedLM(nn.Module):
    """A `transformers` causal LM fed OE(input_ids) through `inputs_embeds`; its LM head (output vocabulary V)
    is untouched, so the loss is the base model's next-token loss. `config` is the base model's config."""

    def __init__(self, lm: nn.Module, oe: OverEncoding):
        super().__init__()
        self.lm, self.oe = lm, oe

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, **kw):
        return self.lm(inputs_embeds=self.oe(input_ids), labels=labels, **kw)


class OverDecodingLM(nn.Module):
    """Over-Decoding (Algorithm 2): beside the LM's own next-token head, head j = 2..n predicts token t + j from the
    last hidden state h_t (after the final norm) through Linear(D → d) (an identity when d = D, as Algorithm 2
    writes it) → Linear(d → V) with a bias (PyTorch's default there), no extra layer; training
    minimises CE_1 + λ Σ_{j≥2} CE_j (λ_1 = 1, the paper's λ_2 ∈ {0.1 … 1}). Inference and every held-out loss use
    the next-token head alone, so its loss compares with a plain model's. A `transformers` causal LM with `.model`
    (the decoder, returning `last_hidden_state`) and `.lm_head`, as Llama; the settings go into
    `config.over_decoding` (and so into the trained-model cache key)."""

    def __init__(self, lm: nn.Module, *, n: int = 2, lam: float = 0.1, d: int | None = None):
        super().__init__()
        D, V = lm.config.hidden_size, lm.config.vocab_size
        d = d or D
        self.lm, self.lam = lm, lam
        self.heads = nn.ModuleList(nn.Sequential(nn.Identity() if d == D else nn.Linear(D, d), nn.Linear(d, V))
                                   for _ in range(n - 1))
        lm.config.over_decoding = {"n": n, "lam": lam, "d": d, "head": "algorithm 2"}

    @property
    def config(self):
        return self.lm.config

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, **kw):
        from transformers.modeling_outputs import CausalLMOutput

        h = self.lm.model(input_ids=input_ids, **kw).last_hidden_state
        logits = self.lm.lm_head(h)
        if labels is None:
            return CausalLMOutput(logits=logits)
        ce = lambda z, y: F.cross_entropy(z.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
        loss = ce(logits[:, :-1], labels[:, 1:])
        for j, head in enumerate(self.heads, start=2):
            loss = loss + self.lam * ce(head(h[:, :-j]), labels[:, j:])
        return CausalLMOutput(loss=loss, logits=logits)


def attach(lm: nn.Module, *, n: int = 2, k: int = 1, m: int = 1021, unigram: bool = True,
           ids_mode: str = "ngram") -> OverTokenizedLM:
    """Over-Encoding on a loaded causal LM: its input embedding becomes the 1-gram table, n-gram tables are added,
    and the settings go into `lm.config.over_encoding` (saved with `save_pretrained`)."""
    cfg = lm.config
    wte = lm.get_input_embeddings()
    oe = OverEncoding(wte, cfg.vocab_size, cfg.hidden_size, n=n, k=k, m=m, unigram=unigram, ids_mode=ids_mode,
                      init_std=getattr(cfg, "initializer_range", 0.02))
    oe.to(device=wte.weight.device, dtype=wte.weight.dtype)
    cfg.over_encoding = oe.spec()
    return OverTokenizedLM(lm, oe)


def save(model: OverTokenizedLM, folder: str | Path, tokenizer=None) -> Path:
    """`save_pretrained` of the base model (+ tokenizer) and the n-gram tables/projections in safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    model.lm.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    state = {k: v.detach().contiguous() for k, v in model.oe.state_dict().items() if not k.startswith("wte.")}
    save_file(state, str(folder / WEIGHTS))
    return folder


def load(folder: str | Path, **kw) -> OverTokenizedLM:
    """The inverse of `save`: `AutoModelForCausalLM.from_pretrained(folder, **kw)` and its OE tables."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(folder, **kw)
    spec = getattr(lm.config, "over_encoding", None)
    if not spec:
        raise ValueError(f"{folder} holds no Over-Encoding settings (config.over_encoding); save it with `save`.")
    model = attach(lm, **spec)
    state = load_file(str(Path(folder) / WEIGHTS), device=str(lm.get_input_embeddings().weight.device))
    missing, unexpected = model.oe.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if not k.startswith("wte.")]:
        raise ValueError(f"{folder}/{WEIGHTS} does not match the OE settings {spec}.")
    return model


# ------------------------------------------------------------------------ table statistics

def coprime_modulus(target: int, vocab: int) -> int:
    """The smallest prime m ≥ target that does not divide V, so m and V are coprime — the paper's advice against
    moduli that are multiples of V (Table 4). The other slices' moduli m + 2·idx are not checked."""
    m = max(3, target)
    while any(m % p == 0 for p in range(2, math.isqrt(m) + 1)) or vocab % m == 0:
        m += 1
    return m


def table_params(d_model: int, *, n: int, k: int, m: int) -> int:
    """Parameters of Algorithm 1's n-gram tables + projections: Σ_idx (m + 2 idx)·w + k(n−1)·(w·D + D)."""
    n_tables = k * (n - 1)
    w = d_model // n_tables
    return sum((m + 2 * i) * w for i in range(n_tables)) + n_tables * (w * d_model + d_model)
