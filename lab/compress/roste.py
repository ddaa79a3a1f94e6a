"""RoSTE (Wei et al., ICML 2025): quantization-aware SFT with rotated straight-through estimation, W4A4KV4.

arXiv 2502.09003, official code OptimAI-Lab/RoSTE (also published as Hong-Lab-UMN-ECE/RoSTE). A rotated
quantized linear is LIN(X; W, R) = Q_x(X·R)·Q_w(Rᵀ·W) (Sec. 3.1, Eq. 5), with the asymmetric fake quantizer of
`lab.compress.quant.fake_quant` (weights per output channel, activations per token, the KV cache per token and
head) and the straight-through estimator (identity backward, official `quant_utils/quant_linear.py`). RoSTE
solves the bilevel problem of Sec. 3.2: the lower level picks the rotations R* ∈ argmin E(W, R), with
E = Σ_i ||Q_w(R_iᵀW_i) − R_iᵀW_i||² + (1/n)Σ_ij ||Q_x(X_ij R_i) − X_ij R_i||² (Eq. 12), over R_i ∈ {I, H}, H a
random Hadamard; the upper level trains W by STE on the SFT loss with R* fixed (Algorithm 1, K = 1).

As in the official code: R1 (d × d) is always applied, fused offline into the residual stream after RMSNorm
folding (`lab.compress.rotate`); only R2 (per head, v → o), R3 (head dim, q and k after RoPE, online) and R4
(before down_proj, online) are chosen per layer, by comparing two calibration passes (all off, all on) on the
MSE version of Eq. 12: R2 ← value-cache + o_proj error, R3 ← key-cache error, R4 ← down_proj error.
Embeddings and lm_head stay full precision. Queries are not quantized (only K/V, as the official attention).
The rotated fake-quantized model itself (Hadamards, norm folding, `QuantLinear`, the "roste" attention) is
`lab.compress.rotate`; this module holds the rotation search and the tiny-Llama arms; `lab.compress.roste_theory`
the theory toy (Sec. 4); `lab.compress.roste_checkpoint` the checkpoint path (rotation + QA-SFT through
`accelerate`, saved with what the fake quantizer needs to reload).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lab.compress import rotate
from lab.compress.gptq import gptq_model
from lab.compress.rotate import KINDS, QuantSpec, Rotations, linears, quantize_model

# ------------------------------------------------------------------------ Eq. 12 on calibration data, and the choice

@torch.no_grad()
def layer_errors(qmodel: nn.Module, ids: Tensor, batch: int = 64) -> list[dict]:
    """Per layer, on calibration ids (N, T): the MSE parts of Eq. 12 attributed to R2 (value cache + o_proj weight
    and input), R3 (key cache) and R4 (down_proj weight and input), the total over all linears and the cache, the
    relative input error of every linear off each token's largest channel (`rotate.rest_error`), and the mean
    |input| per channel of every linear (for the outlier explorer)."""
    layers = qmodel.model.layers
    for layer in layers:
        for lin in linears(layer).values():
            lin.log = []
        layer.self_attn.roste["log"] = []
    for i in range(0, len(ids), batch):
        qmodel(input_ids=ids[i:i + batch])
    out = []
    for layer in layers:
        L, A = {k: v.log for k, v in linears(layer).items()}, layer.self_attn.roste["log"]
        mean = lambda xs, k: sum(x[k] for x in xs) / len(xs)
        lin_err = {k: mean(v, "err_w") + mean(v, "err_x") for k, v in L.items()}
        rec = {"R2": mean(A, "err_v") + lin_err["o"], "R3": mean(A, "err_k"), "R4": lin_err["down"],
               "total": sum(lin_err.values()) + mean(A, "err_k") + mean(A, "err_v"),
               "rest": {k: mean(v, "rest") for k, v in L.items()},
               "channels": {k: (sum(x["x"] for x in v) / len(v)).tolist() for k, v in L.items()}}
        rec["channels"]["k cache"] = (sum(x["k"] for x in A) / len(A)).tolist()
        out.append(rec)
        for lin in linears(layer).values():
            lin.log = None
        layer.self_attn.roste["log"] = None
    return out


def select(err_off: list[dict], err_on: list[dict]) -> list[dict[str, bool]]:
    """Algorithm 1's layer-wise rule: R_i = H where the all-on pass has the lower logged error, else I."""
    return [{k: on[k] < off[k] for k in KINDS} for off, on in zip(err_off, err_on)]


def adaptive(model: nn.Module, qs: QuantSpec, rot: Rotations, ids: Tensor, *, r1: bool = True,
             wrong_side: bool = False) -> dict:
    """RoSTE's rotation search from `model` (K = 1): the two calibration passes (R2/R3/R4 all off / all on, R1
    always on) and the chosen configuration; also the errors re-measured with the chosen configuration."""
    off = layer_errors(quantize_model(model, qs, rot, r1=r1, wrong_side=wrong_side), ids)
    on = layer_errors(quantize_model(model, qs, rot, r1=r1, wrong_side=wrong_side,
                                     choice=[dict.fromkeys(KINDS, True) for _ in off]), ids)
    choice = select(off, on)
    mixed = layer_errors(quantize_model(model, qs, rot, r1=r1, wrong_side=wrong_side, choice=choice), ids)
    return {"off": off, "on": on, "choice": choice, "mixed": mixed}


# ------------------------------------------------------------------------ the notebook's controls and sizes

CONTROLS = {
    "no_rotation": "every Hadamard switched off: RoSTE and the QuaRot-like PTQ run without R1–R4, the theory toy "
                   "with R = I",
    "no_outlier": "no planted massive activation in the tiny Llama and no outlier coordinates in w* of the theory toy",
    "rotation_wrong_side": "R1 multiplied onto the readers' weights from the wrong side (W·Qᵀ instead of W·Q)",
    "permuted_r1": "R1 a random signed permutation instead of a random Hadamard (orthogonal and exact like it, but it "
                   "moves the massive channel whole instead of spreading it); R2–R4 and the theory toy unchanged",
}


def check_control(control: str) -> str:
    from lab.core import params
    return params.check_control(control, CONTROLS)


@dataclass(frozen=True)
class Config:
    """Every size: the least-squares theory toy (Sec. 4) and the tiny Llama (1 layer, d = 64, 4 heads of 16,
    SwiGLU 128) with a planted massive activation, pre-trained on COPY and fine-tuned on ROT1 with the embeddings
    frozen. One layer: its only attention reads the residual stream the outlier rides; with two, STE routes around
    it (see the notebook)."""

    # theory toy
    ls_d: int = 256
    ls_n: int = 128
    ls_outliers: int = 4
    ls_scales: tuple[float, ...] = (1.0, 10.0, 50.0)
    ls_plant: bool = True  # False under `no_outlier`: w* has no outlier coordinates whatever the scale
    ls_steps: int = 4000
    ls_batch: int = 32
    ls_lr: float = 15.0
    ls_wbits: int = 4
    ls_xbits: int = 8
    # tiny Llama
    d_model: int = 64
    n_layers: int = 1
    n_heads: int = 4
    d_ff: int = 128
    n_digits: int = 6
    outlier: float = 50.0  # the massive activation: + outlier on one residual channel of every embedding
    outlier_channel: int = 5
    embed_std: float = 0.5  # token embeddings ~ N(0, 0.5²): the outlier is `outlier` / 0.5 = 100× a typical channel
    pre_op: str = "rot0"  # pre-training task: COPY
    sft_op: str = "rot1"  # SFT task: ROT1
    pre_steps: int = 800
    sft_steps: int = 1000
    batch_size: int = 32
    pre_lr: float = 3e-3
    lrs: tuple[float, ...] = (1e-3, 3e-3)  # each fine-tuning arm's grid (largest first, until one is perfect)
    stop_loss: float = 1e-3  # every fine-tuning run stops once converged (sft_steps: the cap)
    n_calib: int = 128
    n_eval: int = 256
    w_bits: int = 4
    a_bits: int = 4
    kv_bits: int = 4
    clip: float = 1.0
    complete: bool = False  # also fine-tune the complete-rotation arm (Table 3's ablation; costs one more run)
    rotate: bool = True  # False under `no_rotation`
    wrong_side: bool = False  # True under `rotation_wrong_side`
    permuted_r1: bool = False  # True under `permuted_r1`

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        from lab.core import params
        if scale not in params.SCALES:
            raise ValueError(f"scale={scale!r} is unknown; use one of {', '.join(params.SCALES)}.")
        control = check_control(control)
        sizes = {} if scale == "smoke" else dict(pre_steps=2000, sft_steps=2000, n_eval=1024, ls_steps=10000,
                                                  lrs=(3e-4, 1e-3, 3e-3))
        if control == "no_outlier":
            sizes.update(outlier=0.0, ls_plant=False)
        return cls(**sizes, rotate=control != "no_rotation", wrong_side=control == "rotation_wrong_side",
                   permuted_r1=control == "permuted_r1")

    def quant(self) -> QuantSpec:
        return QuantSpec(self.w_bits, self.a_bits, self.kv_bits, self.clip, self.clip, self.clip)


# ------------------------------------------------------------------------ the tiny Llama's tasks

@dataclass(frozen=True)
class Digits:
    """<bos> <op k> d_1..d_L <sep> (d cyclically shifted by k); loss on the completion only. `op` "mix"
    (pre-training: k uniform in 0..5) or "rot<k>" (SFT: one k, e.g. "rot3"). Ids: pad 0, bos 1, sep 2,
    digits 3–12, op tokens 13–18."""

    op: str = "mix"
    n_digits: int = 6
    vocab_size: int = 20

    def batch(self, n: int, generator: torch.Generator) -> dict[str, Tensor]:
        d = torch.randint(0, 10, (n, self.n_digits), generator=generator) + 3
        if self.op == "mix":
            k = torch.randint(0, 6, (n,), generator=generator)
        else:
            k = torch.full((n,), int(self.op.removeprefix("rot")))
        idx = (torch.arange(self.n_digits)[None] + k[:, None]) % self.n_digits
        tgt = d.gather(1, idx)
        ids = torch.cat([torch.ones(n, 1, dtype=torch.long), 13 + k[:, None], d, torch.full((n, 1), 2), tgt], 1)
        labels = ids.clone()
        labels[:, : self.n_digits + 3] = -100
        return {"input_ids": ids, "labels": labels}


@torch.no_grad()
def evaluate(model: nn.Module, batch: dict[str, Tensor], chunk: int = 128) -> dict:
    """Teacher-forced completion token accuracy and NLL (nats per token)."""
    hits = nll = count = 0
    for i in range(0, len(batch["input_ids"]), chunk):
        ids, lab = batch["input_ids"][i:i + chunk], batch["labels"][i:i + chunk]
        logits = model(input_ids=ids).logits[:, :-1].float()
        lab = lab[:, 1:]
        m = lab != -100
        hits += (logits.argmax(-1) == lab)[m].sum().item()
        nll += F.cross_entropy(logits[m], lab[m], reduction="sum").item()
        count += m.sum().item()
    return {"acc": hits / count, "nll": nll / count}


# ------------------------------------------------------------------------ the tiny Llama: every arm

def planted_llama(cfg: Config, vocab_size: int) -> nn.Module:
    """A tiny Llama whose every token embedding carries + `outlier` on one residual channel: a massive activation
    that rides the residual stream through every layer, as in real LLMs (the QuaRot / SpinQuant motivation)."""
    from lab.models.zoo import tiny_llama

    m = tiny_llama(vocab_size=vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                   d_ff=cfg.d_ff, max_len=2 * cfg.n_digits + 5)
    with torch.no_grad():
        m.model.embed_tokens.weight.normal_(0.0, cfg.embed_std)
        m.model.embed_tokens.weight[:, cfg.outlier_channel] += cfg.outlier
    m.config.roste_planted = {"channel": cfg.outlier_channel, "magnitude": cfg.outlier, "embed_std": cfg.embed_std}
    return m


def _arm(base, name: str, make=None) -> nn.Module:
    """The starting point of a fine-tuning arm: `make()` (a fake-quantized model) or a copy of base's model, its
    token embeddings frozen: the planted outlier lives in that table, and fine-tuning it lets any arm out-grow the
    outlier (STE then catches up on some seeds), which an LLM's massive activations, made by its own layers, do not
    allow. Embeddings stay full precision, as in the paper."""
    m = make() if make is not None else copy.deepcopy(base.model)
    m.config.roste_arm = {"arm": name, "base": base.key, "frozen_embeddings": True}  # joins the cache key
    m.model.embed_tokens.weight.requires_grad_(False)
    return m


def study(cfg: Config, seed: int = 0, device: str = "cpu", quiet: bool | None = None) -> dict:
    """Pre-train on COPY (cached), then every arm on ROT1 at W4A4KV4, evaluated on held-out prompts:
    FP SFT; FP SFT + RTN PTQ or GPTQ (`lab.compress.gptq`, calibrated on the calibration prompts, with QuaRot's MSE
    clip search or without, whichever the validation prompts prefer); FP SFT + QuaRot-like PTQ (R1 + all R2–R4,
    then RTN or GPTQ weights); STE QA-SFT (no rotation);
    RoSTE (R1 + the adaptive R2/R3/R4 chosen on the pre-trained model, then STE QA-SFT); complete rotation
    (R1 + all R2–R4, then STE QA-SFT; the ablation of Table 3). Each fine-tuning arm runs the lrs of `cfg.lrs`,
    largest first, until one is perfect on validation prompts apart from the test ones, and keeps the best of
    those it ran (validation accuracy, then NLL).
    Also the rotation search and the full-precision invariance of the rotated FP-SFT model."""
    from functools import partial

    from lab.models.train import TrainConfig, fit

    pre_task, sft_task = Digits(cfg.pre_op, cfg.n_digits), Digits(cfg.sft_op, cfg.n_digits)
    pre = fit(partial(planted_llama, cfg, pre_task.vocab_size), pre_task,
              TrainConfig(steps=cfg.pre_steps, batch_size=cfg.batch_size, lr=cfg.pre_lr, seed=seed), device=device,
              quiet=quiet)
    g = torch.Generator().manual_seed(1000 + seed)
    calib = sft_task.batch(cfg.n_calib, g)["input_ids"].to(device)
    ev = {k: v.to(device) for k, v in sft_task.batch(cfg.n_eval, g).items()}
    val = {k: v.to(device) for k, v in sft_task.batch(cfg.n_eval, g).items()}
    qs, rot, L = cfg.quant(), Rotations.draw(pre.model.config, seed, permuted_r1=cfg.permuted_r1), cfg.n_layers
    kw = dict(r1=cfg.rotate, wrong_side=cfg.wrong_side)
    on = [dict.fromkeys(KINDS, cfg.rotate) for _ in range(L)]
    search = adaptive(pre.model, qs, rot, calib, **kw)
    choice = search["choice"] if cfg.rotate else [dict.fromkeys(KINDS, False) for _ in range(L)]
    grid, best = {}, {}

    def run(arm, name, make):  # the lr grid, largest first, until a run is perfect on the validation prompts
        grid[arm], fits = {}, {}
        for lr in sorted(cfg.lrs, reverse=True):
            fits[lr] = fit(partial(_arm, pre, name, make), sft_task, TrainConfig(
                steps=cfg.sft_steps, batch_size=cfg.batch_size, lr=lr, seed=100 + seed, stop_loss=cfg.stop_loss),
                device=device, quiet=quiet)
            grid[arm][lr] = evaluate(fits[lr].model, val)
            if grid[arm][lr]["acc"] == 1.0:
                break
        best[arm] = max(grid[arm], key=lambda lr: (grid[arm][lr]["acc"], -grid[arm][lr]["nll"]))
        return fits[best[arm]]

    runs = {"FP SFT": run("FP SFT", "fp_sft", lambda: quantize_model(pre.model, qs.off(), rot, r1=True)),
            "STE": run("STE", "ste", lambda: quantize_model(pre.model, qs)),
            "RoSTE": run("RoSTE", "roste", lambda: quantize_model(pre.model, qs, rot, choice=choice, **kw))}
    if cfg.complete:
        runs["complete rotation"] = run("complete rotation", "complete",
                                        lambda: quantize_model(pre.model, qs, rot, choice=on, **kw))
    fp = rotate.rotate_r1(copy.deepcopy(runs["FP SFT"].model), rot.r1_matrix().T)  # back to the raw basis
    gptq_clip = {}

    def gptq(make, arm):  # QuaRot's MSE clip search or the plain min-max grid, whichever is better on validation
        cands = {mse: gptq_model(make(), calib, qs, mse=mse) for mse in (True, False)}
        score = {mse: evaluate(m, val) for mse, m in cands.items()}
        gptq_clip[arm] = max(score, key=lambda mse: (score[mse]["acc"], -score[mse]["nll"]))
        return cands[gptq_clip[arm]]

    models = {"FP SFT": fp, "RTN PTQ": quantize_model(fp, qs),
              "GPTQ PTQ": gptq(lambda: quantize_model(fp, qs.off()), "GPTQ PTQ"),
              "QuaRot-like PTQ": quantize_model(fp, qs, rot, choice=on, **kw),
              "QuaRot-like PTQ, GPTQ weights": gptq(lambda: quantize_model(fp, qs.off(), rot, choice=on, **kw),
                                                    "QuaRot-like PTQ, GPTQ weights"),
              **{k: r.model for k, r in runs.items() if k != "FP SFT"}}
    fp64 = copy.deepcopy(fp).double()  # invariance measured in float64 (rotations are done in float64)
    rotated_fp = quantize_model(fp64, qs.off(), rot, choice=on, **kw)
    with torch.no_grad():
        ref = fp64(input_ids=ev["input_ids"]).logits
        inv = (rotated_fp(input_ids=ev["input_ids"]).logits - ref).abs().max().item()
    errors = {k: layer_errors(m, calib) for k, m in models.items() if k != "FP SFT" and "GPTQ" not in k}
    return {"pre": pre, "runs": runs, "models": models, "search": search, "choice": choice, "calib": calib,
            "grid": grid, "lr": best, "gptq_mse_clip": gptq_clip,
            "eval": ev, "logit_scale": ref.abs().max().item(), "invariance": inv,
            "metrics": {k: evaluate(m, ev) for k, m in models.items()},
            "eq12": {k: sum(e["total"] for e in v) for k, v in errors.items()},
            "rest": {k: [e["rest"] for e in v] for k, v in errors.items()}, "rot": rot, "qs": qs}


def explorer_passes(S: dict, cfg: Config) -> dict[str, list[dict]]:
    """Per-layer channel magnitudes and errors on the calibration prompts of the pre-trained model under each
    configuration (for the outlier explorer): norms folded only, R1, R1 + all R2–R4, RoSTE's choice."""
    r1 = "R1" if cfg.rotate else "no R1 (control)"
    return {"no rotation": layer_errors(quantize_model(S["pre"].model, S["qs"]), S["calib"]),
            f"{r1} only": S["search"]["off"],
            f"{r1} + R2–R4": S["search"]["on"], "RoSTE choice": S["search"]["mixed"]}
