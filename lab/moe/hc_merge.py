"""HC-SMoE's studies (`lab.moe.hc_smoe` is the method): the toy scenarios, every method and baseline run
side by side on one model, and the checkpoint path.

Toy scenarios on permutation chains (`lab.data.chains`, the FloE toy's data), a 3-layer Mixtral:
- A, independent experts: 8 experts trained from random initialisation (no redundancy to find);
- B, upcycled: a 4-expert MoE trained, each expert and its router row duplicated with small noise (8 experts,
  as real MoEs are upcycled from dense models), then fine-tuned briefly — the true groups are the copies;
- C, permuted duplicates: B with every copy's intermediate neurons permuted — the same function, other weights.
A `Study` holds a model with its calibration MoE inputs, usage frequencies, held-out batch and (toys) the true
groups; `compare` runs HC-SMoE and every baseline on it for one r.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from lab.core.params import ParamError
from lab.data.chains import PermutationChains
from lab.models.train import TrainConfig, fit
from lab.models.zoo import tiny_mixtral
from lab.moe import hc_smoe as hc
from lab.moe.blocks import moe_blocks, moe_inputs

FAMILIES = ("mixtral", "qwen2_moe")


@dataclass
class Study:
    """One model under compression: calibration MoE inputs xs (per layer (N, H)), frequencies f, a held-out batch,
    and `truth` (E,) — the true groups — when known (toys)."""

    name: str
    model: nn.Module
    xs: list[Tensor]
    freqs: list[Tensor]
    batch: dict[str, Tensor]
    truth: np.ndarray | None = None

    def loss(self, model: nn.Module | None = None) -> float:
        with torch.no_grad():
            return (model or self.model)(**self.batch).loss.item()

    def feats(self, kind: str) -> list[Tensor]:
        if kind not in getattr(self, "_feats", {}):
            self._feats = {**getattr(self, "_feats", {}),
                           kind: [hc.features(m, x, kind) for m, x in zip(moe_blocks(self.model), self.xs)]}
        return self._feats[kind]


def make_study(name: str, model: nn.Module, cal: Tensor, batch: dict[str, Tensor], truth=None) -> Study:
    xs = moe_inputs(model, cal)
    return Study(name, model, xs, [hc.usage_frequencies(m, x) for m, x in zip(moe_blocks(model), xs)], batch, truth)


# ------------------------------------------------------------------------ the toy scenarios

def _arch(cfg: hc.Config, vocab: int, n_experts: int) -> dict:
    return dict(vocab_size=vocab, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, d_ff=cfg.d_ff,
                n_experts=n_experts, top_k=cfg.top_k)


@torch.no_grad()
def upcycle(model: nn.Module, n_copies: int, noise: float, generator: torch.Generator) -> nn.Module:
    """Every expert and its router row copied `n_copies` times (copy c of expert j is expert j + c·n), each copy
    after the first plus noise · std(W) · N(0, 1) per matrix. Returns a new Mixtral with n·n_copies experts."""
    cfg = copy.deepcopy(model.config)
    n = cfg.num_local_experts
    cfg.num_local_experts = n * n_copies
    new = type(model)(cfg)
    sd = model.state_dict()

    def noisy(w: Tensor, c: int) -> Tensor:
        return w if c == 0 else w + noise * w.std() * torch.randn(w.shape, generator=generator)

    for mlp in moe_blocks(model):
        name = [k for k, v in model.named_modules() if v is mlp][0]
        for key in ("experts.gate_up_proj", "experts.down_proj", "gate.weight"):
            w = sd[f"{name}.{key}"]
            sd[f"{name}.{key}"] = torch.cat([noisy(w, c) for c in range(n_copies)])
    new.load_state_dict(sd)
    new.config.hc_smoe_upcycled = {"noise": noise, "copies": n_copies}  # part of the fine-tune's cache key
    return new


def _upcycled(cfg: hc.Config, task, seed: int, device: str) -> nn.Module:
    base = fit(partial(tiny_mixtral, **_arch(cfg, task.vocab_size, cfg.n_base)), task,
               TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, seed=seed), device="cpu", quiet=True)
    m = upcycle(base.model, cfg.n_experts // cfg.n_base, cfg.noise, torch.Generator().manual_seed(7 + seed))
    m.config.hc_smoe_upcycled["base"] = base.key
    return m


@torch.no_grad()
def permute_copies(model: nn.Module, n_base: int, generator: torch.Generator) -> nn.Module:
    """Scenario C: a copy whose experts j ≥ n_base have their F intermediate neurons randomly permuted (gate and
    up rows, down columns alike): each expert computes the same function with other weights."""
    new = copy.deepcopy(model)
    for mlp in moe_blocks(new):
        gu, d = mlp.experts.gate_up_proj, mlp.experts.down_proj
        F = d.shape[-1]
        for e in range(n_base, gu.shape[0]):
            p = torch.randperm(F, generator=generator)
            gu[e] = torch.cat([gu[e, :F][p], gu[e, F:][p]])
            d[e] = d[e][:, p]
    return new


@torch.no_grad()
def top2_one_group(st: Study) -> list[float]:
    """Per MoE layer, the share of calibration tokens whose two top-k picks (router logits) are both in one true
    group: in scenario B, where each copy also copies its router row, most tokens send both slots to one pair."""
    truth = torch.as_tensor(st.truth)
    picks = [(x @ m.gate.weight.T).topk(2, -1).indices for m, x in zip(moe_blocks(st.model), st.xs)]
    return [(truth[i[:, 0]] == truth[i[:, 1]]).float().mean().item() for i in picks]


def toy_studies(cfg: hc.Config, seed: int = 0, device: str = "cpu", quiet: bool | None = None) -> dict[str, Study]:
    """Scenarios A, B, C on permutation chains: trained (or loaded from the cache), with calibration and held-out
    sequences from one generator (1000 + seed). Also returns the training runs under key "runs" of `.info`."""
    task = PermutationChains(length=cfg.seq_len)
    ft = TrainConfig(steps=cfg.ft_steps, batch_size=cfg.batch_size, lr=cfg.ft_lr, seed=100 + seed)
    B = fit(partial(_upcycled, cfg, task, seed, device), task, ft, device=device, quiet=quiet)
    A = fit(partial(tiny_mixtral, **_arch(cfg, task.vocab_size, cfg.n_experts)), task,
            TrainConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr, seed=seed),
            device=device, quiet=quiet)
    C = permute_copies(B.model, cfg.n_base, torch.Generator().manual_seed(11 + seed))
    g = torch.Generator().manual_seed(1000 + seed)
    cal = task.batch(cfg.n_seq, g)["input_ids"].to(device)
    batch = {k: v.to(device) for k, v in task.batch(cfg.n_seq, g).items()}
    truth = np.arange(cfg.n_experts) % cfg.n_base
    out = {"A": make_study("A · independent", A.model.eval(), cal, batch),
           "B": make_study("B · upcycled", B.model.eval(), cal, batch, truth),
           "C": make_study("C · permuted copies", C.eval(), cal, batch, truth)}
    out["A"].run, out["B"].run, out["task"] = A, B, task
    return out


# ------------------------------------------------------------------------ every method on one study

def ari(labels: list, truth) -> float:
    """The smallest adjusted Rand index over layers between the groups and the true groups."""
    from sklearn.metrics import adjusted_rand_score
    return min(adjusted_rand_score(truth, lab) for lab in labels)


def group(st: Study, r: int, kind: str = "output", **kw) -> list[np.ndarray]:
    return [hc.cluster(f, r, **kw) for f in st.feats(kind)]


def compare(st: Study, r: int, cfg: hc.Config, seed: int = 0, *, which: str = "all") -> dict[str, dict]:
    """Eval loss (and, with true groups, min-over-layers ARI) of HC-SMoE and the baselines at r experts a layer.

    "HC-SMoE" uses `cfg.feature` and `cfg.method` (the controls change them); merges are evaluated with the
    published semantics (router unchanged, `aliased`), "HC-SMoE, smaller model" is the really smaller model.
    Random groups and k-means++ are means over `cfg.n_random` seeds. `which`: "all" (every ablation), "core"
    (HC-SMoE, random groups, pruning), "checkpoint" (no full-size copies: the smaller model and pruning only)."""
    res: dict[str, dict] = {"original": {"loss": st.loss()}}

    def add(name, labels, align=False, smaller=False):
        m = (hc.smaller if smaller else hc.aliased)(st.model, labels, st.freqs, align=align)
        res[name] = {"loss": st.loss(m), "labels": [lab.tolist() for lab in labels]}
        if st.truth is not None:
            res[name]["ari"] = ari(labels, st.truth)

    def add_mean(name, runs):
        losses = [st.loss(hc.aliased(st.model, labels, st.freqs)) for labels in runs]
        res[name] = {"loss": float(np.mean(losses)), "losses": losses}
        if st.truth is not None:
            res[name]["ari"] = float(np.mean([ari(labels, st.truth) for labels in runs]))

    hc_labels = group(st, r, cfg.feature, method=cfg.method, seed=seed)
    if which != "checkpoint":
        add("HC-SMoE", hc_labels)
    add("HC-SMoE, smaller model", hc_labels, smaller=True)
    if which != "checkpoint":
        add("HC-SMoE + neuron alignment", hc_labels, align=cfg.align)
        add_mean("random groups", [group(st, r, method="random", seed=1000 * seed + i) for i in range(cfg.n_random)])
    if which == "all":
        add("router-logit features", group(st, r, "router"))
        add("weight features", group(st, r, "weight"))
        add("single linkage", group(st, r, link="single"))
        add("complete linkage", group(st, r, link="complete"))
        add_mean("k-means++ (random init)", [group(st, r, method="kmeans", seed=1000 * seed + i)
                                              for i in range(cfg.n_random)])
        init = [sorted(f.argsort(descending=True)[:r].tolist()) for f in st.freqs]  # the r most used experts
        add("k-means (fixed init)", [hc.cluster(f, r, method="kmeans_fixed", init=i)
                                     for f, i in zip(st.feats("output"), init)])
        add("M-SMoE (dominant experts, router cosine, aligned)",
            [hc.dominant_groups(f, fr, r) for f, fr in zip(st.feats("router"), st.freqs)], align=True)
    for how in "FSO":
        keep = [hc.prune_keep(m, x, r, how) for m, x in zip(moe_blocks(st.model), st.xs)]
        res[f"{how}-prune"] = {"loss": st.loss(hc.pruned(st.model, keep)), "keep": keep}
    return res


def distances(st: Study, kinds: tuple[str, ...] = hc.FEATURES) -> dict[str, list[np.ndarray]]:
    """Pairwise Euclidean distances (E, E) between experts per layer, for each feature kind (the explorer's)."""
    from scipy.spatial.distance import pdist, squareform
    return {k: [squareform(pdist(f.double().cpu().numpy())) for f in st.feats(k)] for k in kinds}


# ------------------------------------------------------------------------ the checkpoint path

def file_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def original_bytes(model) -> int:
    """The original model's weight files: its checkpoint folder's *.safetensors when it was loaded from one (not
    written again to measure them: 93 GB for Mixtral-8x7B), else its parameters' bytes (shared ones once)."""
    src = Path(getattr(model.config, "_name_or_path", "") or "")
    if src.is_dir() and (n := file_size(src)):
        return n
    return sum(p.numel() * p.element_size() for p in model.parameters())


def checkpoint_study(model: str, data: str, n_blocks: int, block_len: int, seed: int, device: str = "cpu"):
    """A checkpoint (`load_model`) of an MoE family, calibrated and evaluated on `data` (`lab.data.text`): the
    first n_blocks token blocks calibrate, the next n_blocks are held out. Returns (Study, tokenizer)."""
    from lab.data.text import halves
    from lab.models import load_model

    if not data:
        raise ParamError("a checkpoint needs calibration text: pass -p data <a .txt/.jsonl file or a datasets name>.")
    net, tok = load_model(model, device=device)
    if net.config.model_type not in FAMILIES or not all(hasattr(m, "experts") for m in moe_blocks(net)):
        raise ParamError(f"model={model!r} is a {net.config.model_type!r} model; HC-SMoE needs a sparse MoE of "
                         f"the Mixtral or Qwen-MoE family with experts in every layer.")
    if tok is None:
        raise ParamError(f"model={model!r} has no tokenizer in its folder; save one beside the weights.")
    dev = next(net.parameters()).device
    cal, ev = (x.to(dev) for x in halves(data, tok, n_blocks, block_len, seed=seed, method="HC-SMoE"))
    return make_study(Path(model).name, net, cal, {"input_ids": ev, "labels": ev}), tok


def save_smaller(st: Study, labels: list, tokenizer, out_dir: str = "", *, keep: bool = True) -> dict:
    """HC-SMoE's smaller model written with `save_pretrained` to `out_dir` (a temp folder when empty, deleted
    afterwards unless `keep`), reloaded by plain `from_pretrained`; parameter counts, file sizes, the reload's
    max |Δ logits| and held-out losses."""
    from transformers import AutoModelForCausalLM

    small = hc.smaller(st.model, labels, st.freqs)
    out = Path(out_dir or tempfile.mkdtemp(prefix="hc_smoe-"))
    small.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    orig_bytes = original_bytes(st.model)
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation=small.config._attn_implementation)
    back = back.to(next(small.parameters()).device).eval()  # the same attention kernel: in bf16 they differ
    x = st.batch["input_ids"][:2]
    with torch.no_grad():
        dlogit = (back(input_ids=x).logits - small(input_ids=x).logits).abs().max().item()
    count = lambda m: sum(p.numel() for p in m.parameters())
    merged_bytes = file_size(out)
    if not (keep or out_dir):
        shutil.rmtree(out, ignore_errors=True)
        out = "(a temporary folder, deleted)"
    return {"out_dir": str(out), "params": {"original": count(st.model), "merged": count(back)},
            "bytes": {"original": orig_bytes, "merged": merged_bytes}, "reload_max_abs_logit_diff": dlogit,
            "experts": hc.n_experts_key(back.config) + f" = {getattr(back.config, hc.n_experts_key(back.config))}",
            "loss": {"original": st.loss(), "merged (smaller model)": st.loss(back)}}
