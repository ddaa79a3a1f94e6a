"""The over-tokenized notebook's experiments: the toy study and the checkpoint path (the method itself is in
`lab.adapt.over_tokenized`).

Toy: a sparse 2nd-order Markov language (`lab.data.sparse_markov`, known entropy), a tiny Llama trained for the
same steps with the plain 1-gram embedding (baseline) and with Over-Encoding (Algorithm 1 of Huang et al.,
ICML 2025) at several table sizes m, the 8V modulus, without the 1-gram table, and with 1+2+3-grams in k = 2
slices. Held-out loss is measured on fresh draws beside the true per-token NLL of the same tokens, so excess
loss = CE − H* estimates the KL to the source. Checkpoint: OE attached to a loaded causal LM, trained further on
text blocks (through `accelerate`) beside the same training without OE, saved and loaded back.
"""

from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from lab.adapt import over_tokenized as ot
from lab.core import params
from lab.core.params import ParamError
from lab.data.sparse_markov import SparseMarkov
from lab.models import zoo
from lab.models.train import TrainConfig, fit


@dataclass(frozen=True)
class Config:
    """Every size of the toy. Smoke: V = 64 (4,096 contexts), a 1-layer Llama (d = 32), 80 steps of 64 × 32
    tokens; full: the V = 128 (16,384 contexts), 2-layer d = 64, 600 × 64 × 64 setting."""

    vocab: int = 64
    support: int = 4  # tokens with non-zero probability after each context
    seq_len: int = 32
    d_model: int = 32
    n_layers: int = 1
    n_heads: int = 4
    steps: int = 80
    batch_size: int = 64
    lr: float = 1e-2  # the same for every run (baseline best of 3e-3 / 1e-2 / 3e-2 within 0.05 nats)
    ms: tuple[int, ...] = (127, 509, 2039, 4093)  # the n = 2 sweep, primes up to ≈ the number of contexts
    m_pair: int = 509  # the prime beside 8V, and the table of the "no 1-gram" run
    eval_batches: int = 4
    eval_size: int = 64
    ids_mode: str = "ngram"  # "unigram" under `unigram_ids` ("leak", a left shift, only in the tests)
    od_lam: float = 0.1  # Over-Decoding: λ of the next-2 head (the paper's smallest; smaller is better downstream)
    dense_lrs: tuple[float, ...] = (3e-3, 1e-2, 3e-2)  # the 2×-layer dense baseline keeps its best of these

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        if scale not in params.SCALES:
            raise ValueError(f"scale={scale!r} is unknown; use one of {', '.join(params.SCALES)}.")
        control = ot.check_control(control)
        sizes = {} if scale == "smoke" else dict(vocab=128, seq_len=64, d_model=64, n_layers=2, steps=600,
                                                  lr=3e-3, ms=(251, 1021, 4093, 16381), m_pair=1021)
        ids = "unigram" if control == "unigram_ids" else "ngram"
        return cls(**sizes, ids_mode=ids)

    @property
    def m_main(self) -> int:
        return self.ms[-1]

    @property
    def m_trap(self) -> int:
        return 8 * self.vocab

    def task(self, seed: int) -> SparseMarkov:
        return SparseMarkov(vocab=self.vocab, order=2, support=self.support, length=self.seq_len, seed=seed)

    def runs(self) -> dict[str, dict | None]:
        """Name → OE settings (None: the baseline's plain embedding)."""
        r: dict[str, dict | None] = {"baseline": None}
        r.update({f"OE m={m}": dict(n=2, k=1, m=m) for m in self.ms})
        r[f"OE m=8V={self.m_trap}"] = dict(n=2, k=1, m=self.m_trap)
        r[f"OE m={self.m_pair}"] = dict(n=2, k=1, m=self.m_pair)
        r[f"2-gram only m={self.m_pair}"] = dict(n=2, k=1, m=self.m_pair, unigram=False)
        r[f"1+2+3-gram k=2 m={self.m_main}"] = dict(n=3, k=2, m=self.m_main)
        return {k: v if v is None else {**v, "ids_mode": self.ids_mode} for k, v in r.items()}


def build(cfg: Config, spec: dict | None, n_layers: int | None = None):
    """A fresh tiny Llama (`n_layers` deep, default the toy's), with OE attached when `spec` is given (seed torch
    first)."""
    lm = zoo.tiny_llama(vocab_size=cfg.vocab, d_model=cfg.d_model, n_layers=n_layers or cfg.n_layers,
                        n_heads=cfg.n_heads, d_ff=2 * cfg.d_model, max_len=cfg.seq_len)
    return lm if spec is None else ot.attach(lm, **spec)


def eval_batch(cfg: Config, seed: int) -> torch.Tensor:
    """Held-out sequences (eval_batches · eval_size, seq_len), drawn fresh from a generator apart from training."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.cat([cfg.task(seed).batch(cfg.eval_size, g)["input_ids"] for _ in range(cfg.eval_batches)])


@torch.no_grad()
def held_out(model, task: SparseMarkov, x: torch.Tensor) -> dict:
    """Mean next-token CE of `model` on x beside the true NLL of the same tokens; excess = CE − H*."""
    dev = next(model.parameters()).device
    logits = model(input_ids=x.to(dev)).logits[:, :-1].float().cpu()
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    h = task.true_nll(x).mean()
    return {"loss": float(ce), "entropy": float(h), "excess": float(ce - h)}


def contexts(x: torch.Tensor, order: int, vocab: int) -> torch.Tensor:
    """Exact n-gram ids at every position of x (as the model's tables see them, BOS zero-padding included)."""
    return sum(ot.shift(x, j) * vocab ** j for j in range(order))


def collisions(x: torch.Tensor, vocab: int, *, n: int = 2, k: int = 1, m: int) -> dict:
    """Over the distinct n-grams of x, with Algorithm 1's tables (order 2 + idx // k, modulus m + 2 idx): the
    share whose row tuple across all tables is shared with another n-gram (`rate`), and among the colliding
    pairs the share ending in the same token (`same_last`: what the 1-gram table cannot tell apart)."""
    c = torch.unique(contexts(x, n, vocab))
    rows = torch.stack([(c % vocab ** (2 + i // k)) % (m + 2 * i) for i in range(k * (n - 1))])
    _, group, count = torch.unique(rows, dim=1, return_inverse=True, return_counts=True)
    _, count_last = torch.unique(torch.stack([group, c % vocab]), dim=1, return_counts=True)
    pairs, same = (count * (count - 1)).sum() / 2, (count_last * (count_last - 1)).sum() / 2
    return {"rate": float((count[group] > 1).double().mean()), "same_last": float(same / pairs) if pairs else 0.0}


def size_table(cfg: Config, x: torch.Tensor, ms, shapes=((2, 1), (3, 1), (3, 2))) -> list[dict]:
    """For every (n, k) in `shapes` and m in `ms`: OE parameters (`ot.table_params`) and `collisions` on x."""
    return [{"m": m, "n": n, "k": k, "params": ot.table_params(cfg.d_model, n=n, k=k, m=m),
             **collisions(x, cfg.vocab, n=n, k=k, m=m)} for n, k in shapes for m in ms]


def toy_study(cfg: Config, seed: int, device: str = "cpu") -> dict:
    """Train (or load from the cache) every run of `cfg.runs()` for the same steps, the dense baseline with twice
    the layers (`dense_name`: twice the non-embedding parameters, the abstract's "double-sized baseline") and the
    baseline with Over-Decoding's next-2 head (`od_name`; the output side of the paper's input-vs-output comparison);
    held-out metrics of each (next-token loss: OD's extra head is not read). The deeper dense baseline is trained at
    each of `cfg.dense_lrs` and keeps the lowest held-out loss (a choice that can only favour it)."""
    task, x = cfg.task(seed), eval_batch(cfg, seed)
    tc = TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, weight_decay=0.0, seed=seed)
    out = {}
    builds = {name: (spec, partial(build, cfg, spec)) for name, spec in cfg.runs().items()}
    builds[dense_name(cfg)] = (None, partial(build, cfg, None, 2 * cfg.n_layers))
    builds[od_name(cfg)] = (None, partial(build_od, cfg))
    for name, (spec, make) in builds.items():
        lrs = cfg.dense_lrs if name == dense_name(cfg) else (cfg.lr,)  # the deeper model: its own lr, the best held-out
        fits = {lr: fit(make, task, replace(tc, lr=lr), device=device) for lr in lrs}
        evals = {lr: held_out(r.model, task, x) for lr, r in fits.items()}
        lr = min(evals, key=lambda k: evals[k]["loss"])
        run, oe = fits[lr], getattr(fits[lr].model, "oe", None)
        out[name] = {**evals[lr], "lr": lr, "spec": spec, "losses": run.losses, "seconds": run.seconds,
                     "cached": run.cached, "oe_params": oe.n_params() if oe else 0, "model": run.model}
    return {"runs": out, "task": task, "x": x}


def build_od(cfg: Config):
    """The baseline tiny Llama with Over-Decoding's next-2 head (`ot.OverDecodingLM`, λ = `cfg.od_lam`)."""
    return ot.OverDecodingLM(build(cfg, None), n=2, lam=cfg.od_lam)


def od_name(cfg: Config) -> str:
    return f"OD next-2 head λ={cfg.od_lam:g}"


def dense_name(cfg: Config) -> str:
    return f"dense, {2 * cfg.n_layers} layers (2x)"


def training_length(cfg: Config, seed: int, *, steps=(80, 400, 1600), lrs=(1e-2, 3e-3), device: str = "cpu") -> list:
    """Is the baseline merely under-trained? The baseline and OE at the largest m, each trained for every `steps`
    at every `lr` (the toy trains 80 steps at 1e-2): rows of held-out excess loss and OE's cut of it."""
    task, x, rows = cfg.task(seed), eval_batch(cfg, seed), []
    oe = {**cfg.runs()[f"OE m={cfg.m_main}"]}
    for n_steps in steps:
        for lr in lrs:
            tc = TrainConfig(steps=n_steps, batch_size=cfg.batch_size, lr=lr, weight_decay=0.0, seed=seed)
            ex = {name: held_out(fit(partial(build, cfg, spec), task, tc, device=device).model, task, x)["excess"]
                  for name, spec in (("baseline", None), ("OE", oe))}
            rows.append({"steps": n_steps, "lr": lr, **ex, "cut": 1 - ex["OE"] / ex["baseline"]})
    return rows


def sweep_fit(ms, excess) -> dict:
    """Least-squares line excess = a + b·log10 m and the Spearman ρ of (log10 m, excess)."""
    from scipy.stats import linregress, spearmanr

    lx = [math.log10(m) for m in ms]
    fitted = linregress(lx, excess)
    return {"slope": float(fitted.slope), "intercept": float(fitted.intercept),
            "rho": float(spearmanr(lx, excess).statistic)}


@torch.no_grad()
def causality_gap(oe: ot.OverEncoding, x: torch.Tensor, t: int) -> float:
    """max |OE(x)_{≤t} − OE(x')_{≤t}| where x' changes only x_{t+1} (0 when OE reads no future token)."""
    x = x.to(next(oe.parameters()).device)
    x2 = x.clone()
    x2[:, t + 1] = (x2[:, t + 1] % (oe.vocab - 1)) + 1 if oe.vocab > 2 else 1 - x2[:, t + 1]
    return float((oe(x)[:, :t + 1] - oe(x2)[:, :t + 1]).abs().max())


# ------------------------------------------------------------------------ checkpoint path

def checkpoint_study(model: str, data: str, *, n: int, k: int, m: int, steps: int, lr: float, n_blocks: int,
                     block_len: int, seed: int, device: str = "cpu", out_dir: str = "") -> dict:
    """OE on a loaded causal LM: held-out loss of the checkpoint, of OE attached (untrained tables), and after
    `steps` of further training with OE and, as the baseline, without it (same steps, lr, blocks); the OE model
    is written with `ot.save` to `out_dir` (a temp folder when empty) and loaded back with `ot.load`. `m` ≤ 0
    picks the first prime from 2V up that is coprime with V."""
    from accelerate import Accelerator

    from lab.data.text import load_texts, token_blocks
    from lab.models import load_model

    if not data:
        raise ParamError("a checkpoint needs training text: pass -p data <a .txt/.jsonl file or a datasets name>.")
    net, tok = load_model(model, device=device)
    if tok is None:
        raise ParamError(f"model={model!r} has no tokenizer in its folder; save one beside the weights.")
    if net.get_input_embeddings() is None or getattr(net.config, "is_encoder_decoder", False):
        raise ParamError(f"model={model!r} is a {net.config.model_type!r} model; Over-Encoding needs a decoder-only "
                         "causal LM that accepts `inputs_embeds`.")
    ids = token_blocks(load_texts(data, seed=seed), tok, 2 * n_blocks, block_len)
    if len(ids) < 2:
        raise ParamError(f"data={data!r} gives {len(ids)} block(s) of {block_len} tokens; pass more text or a "
                         "smaller block_len.")
    tr, ev = ids[: len(ids) // 2], ids[len(ids) // 2:]
    acc = Accelerator(cpu=device == "cpu")

    def loss_of(mod) -> float:
        mod.eval()
        with torch.no_grad():
            return float(mod(input_ids=ev.to(acc.device), labels=ev.to(acc.device)).loss)

    def train(mod) -> list[float]:
        mod.train()
        opt = torch.optim.AdamW(mod.parameters(), lr=lr, weight_decay=0.0)
        mod, opt = acc.prepare(mod, opt)
        g, losses = torch.Generator().manual_seed(seed), []
        for _ in range(steps):
            b = tr[torch.randint(len(tr), (min(8, len(tr)),), generator=g)].to(acc.device)
            loss = mod(input_ids=b, labels=b).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses

    before = loss_of(net)
    base_state = {k_: v.detach().clone() for k_, v in net.state_dict().items()}
    torch.manual_seed(seed)
    m = m if m > 0 else ot.coprime_modulus(2 * net.config.vocab_size, net.config.vocab_size)
    oe_model = ot.attach(net, n=n, k=k, m=m)
    attached = loss_of(oe_model)
    t0 = time.perf_counter()
    oe_curve = train(oe_model)
    oe_seconds = time.perf_counter() - t0
    after_oe = loss_of(oe_model)
    out = Path(out_dir or tempfile.mkdtemp(prefix="over_tokenized-"))
    ot.save(acc.unwrap_model(oe_model, keep_fp32_wrapper=False), out, tok)
    back = ot.load(out, attn_implementation=net.config._attn_implementation).to(acc.device).eval()  # same kernel
    with torch.no_grad():
        x = ev[:2].to(acc.device)
        diff = float((back(input_ids=x).logits - oe_model(input_ids=x).logits).abs().max())
    plain, _ = load_model(model, device=device)
    plain.load_state_dict(base_state)
    base_curve = train(plain)
    return {"model": model, "data": data, "blocks": [len(tr), len(ev)], "block_len": block_len,
            "oe": {"n": n, "k": k, "m": m, "params": oe_model.oe.n_params()},
            "loss": {"checkpoint": before, "OE attached (untrained)": attached, f"OE, {steps} steps": after_oe,
                     f"no OE, {steps} steps": loss_of(plain)},
            "curves": {"OE": oe_curve, "no OE": base_curve}, "oe_train_seconds": oe_seconds,
            "out_dir": str(out), "reload_max_abs_logit_diff": diff}

