r"""TLM — Hu, Zhang, Chen et al., "Test-Time Learning for Large Language Models", ICML 2025 (arXiv
2505.20633; code: Fhujinwu/TLM, a LLaMA-Factory fork).

Adapt a model to a shifted domain from its *unlabeled test inputs* by minimising their perplexity,
P(x; Θ) = exp(−(1/T) Σ_t log p(x_t | x_<t)) (Eq. 2), with LoRA on W_q and W_v (r = 8, α = 16), and
emphasise the informative high-perplexity inputs by the Sample Efficient Learning score (Eq. 6)

    S(x) = λ · exp(log P(x) − log P0) · 1[P(x) > P0],      λ = 0.1, log P0 = 3  (computed without gradient).

**Code vs paper.** Eq. 5 minimises S(x)·P(x); the official `compute_loss` minimises S(x)·log P(x): the
per-sample mean NLL CE_i, weighted by coeff_i = λ·exp(CE_i − threshold) on samples with CE_i > threshold,
summed and divided by the number selected (0 if none). That is the default here (`objective="code"`;
`"paper"` uses the perplexity itself). Offline, CE_i comes from the base model (adapters disabled) once;
online, from the current model per chunk (predict, then train). The official trainer back-propagates a
zero loss for unselected samples; here they are truly skipped (`skip_unselected=True`), and the count of
backward passes is returned either way.

Baselines: Tent (entropy of the model's own greedy continuation) and an EATA-style filter and weight
(entropy < E0, weight exp(−(E − E0))).

The toy (`Config`, `build`, `run_arms`): a 2-layer Llama pre-trained on a source Markov domain
(`lab.data.domains`) meets an unlabeled stream from a shifted target domain; each arm (TLM, its ablations,
Tent, EATA, full-parameter TLM, online TLM) adapts a fresh copy of the base model on the stream and is scored
on held-out target and source questions.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from lab.core import progress
from lab.data.domains import MarkovDomains, answer_scores
from lab.models import TinyLM, TrainResult


def add_lora(model, *, r: int = 8, alpha: int = 16, targets: tuple[str, ...] = ("q_proj", "v_proj")):
    """The paper's adapter: LoRA (B = 0, A Gaussian) on the listed projections, dropout 0 (`peft`)."""
    import peft

    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets))
    return peft.get_peft_model(model, cfg)


def sample_ce(model, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Per-sample mean NLL of the input's own tokens (labels = input_ids, padding ignored): (B,)."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    logp = model(input_ids=input_ids, attention_mask=mask.long()).logits[:, :-1].float().log_softmax(-1)
    nll = -logp.gather(-1, input_ids[:, 1:, None])[..., 0]  # (B, T−1): token t+1 from prefix ≤ t
    m = mask[:, 1:].float()
    return (nll * m).sum(-1) / m.sum(-1).clamp_min(1)


def sel_weights(ce: Tensor, *, threshold: float = 3.0, lamb: float = 0.1) -> tuple[Tensor, Tensor]:
    """(coeff, selected): coeff = λ·exp(CE − threshold) on CE > threshold (log P0 = threshold)."""
    ce = ce.detach()
    selected = ce > threshold
    return lamb * torch.exp(ce - threshold) * selected, selected


def tlm_loss(ce: Tensor, coeff: Tensor, selected: Tensor, *, objective: str = "code") -> Tensor:
    """Σ_i coeff_i · f(CE_i) over selected samples / number selected; f = CE (code) or exp(CE) (Eq. 5)."""
    if objective not in ("code", "paper"):
        raise ValueError(f"objective={objective!r} is not 'code' or 'paper'.")
    if not selected.any():
        return ce.sum() * 0.0
    f = ce if objective == "code" else ce.exp()
    return (coeff * selected * f).sum() / selected.sum()


def entropy_of_continuation(model, input_ids: Tensor, k: int) -> Tensor:
    """Mean predictive entropy (nats) over the model's own k greedy continuation tokens: (B,), with
    gradient through the distributions (the continuation itself is chosen without gradient)."""
    with torch.no_grad():
        x = input_ids
        for _ in range(k):
            x = torch.cat([x, model(input_ids=x).logits[:, -1:].argmax(-1)], 1)
    logp = model(input_ids=x).logits[:, input_ids.shape[1] - 1:-1].float().log_softmax(-1)  # (B, k, V)
    return -(logp.exp() * logp).sum(-1).mean(-1)


@dataclass
class AdaptLog:
    """What an adaptation run did: per-step loss (None when skipped), selected flags, backward passes."""

    losses: list[float | None] = field(default_factory=list)
    selected: list[bool] = field(default_factory=list)
    backward_passes: int = 0
    checkpoints: list[dict] = field(default_factory=list)  # whatever `probe` returned at each `every`


Objective = Callable[[object, Tensor], tuple[Tensor, Tensor]]  # (model, x (1, T)) -> (loss, selected (bool))


def tlm_objective(*, threshold: float = 3.0, lamb: float = 0.1, objective: str = "code", sel: bool = True,
                  base_ce: Callable[[Tensor], Tensor] | None = None) -> Objective:
    """The TLM loss of one input; `sel=False` weights every sample 1 (TLM w/o SEL). `base_ce(x)` gives
    the CE that selects and weights (offline: the base model's); default: the current model's."""

    def f(model, x):
        ce = sample_ce(model, x)
        if not sel:
            return ce.mean(), torch.tensor(True)
        ref = base_ce(x) if base_ce is not None else ce.detach()
        coeff, selected = sel_weights(ref, threshold=threshold, lamb=lamb)
        return tlm_loss(ce, coeff, selected, objective=objective), selected.any()

    return f


def tent_objective(k: int = 8) -> Objective:
    """Tent: minimise the entropy of the model's own k-token greedy continuation."""
    return lambda model, x: (entropy_of_continuation(model, x, k).mean(), torch.tensor(True))


def eata_objective(e0: float, k: int = 8) -> Objective:
    """EATA-style: entropy minimisation only on confident samples (E < E0), weighted exp(−(E − E0))."""

    def f(model, x):
        e = entropy_of_continuation(model, x, k)
        keep = e.detach() < e0
        return (torch.exp(-(e.detach() - e0)) * keep * e).sum() / keep.sum().clamp_min(1), keep.any()

    return f


def adapt(model, inputs: list[Tensor], objective: Objective, *, lr: float, steps_per_input: int = 1,
          skip_unselected: bool = True, schedule: str = "cosine", warmup_frac: float = 0.1, grad_clip: float = 1.0,
          probe: Callable[[], dict] | None = None, every: int = 0, quiet: bool | None = None) -> AdaptLog:
    """Offline TTL: one pass over the unlabeled inputs (each (1, T)), batch 1, AdamW on the trainable
    parameters, cosine schedule with warm-up (the repo's offline config) or constant (online)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    total = len(inputs) * steps_per_input
    warm = max(1, round(warmup_frac * total))

    def scale(step):
        if schedule == "constant":
            return 1.0
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))

    log = AdaptLog()
    model.train()
    step = 0
    for x in progress(inputs, quiet=quiet, desc="adapt"):
        for _ in range(steps_per_input):
            if probe is not None and every and step % every == 0:
                model.eval()
                log.checkpoints.append({"step": step, **probe()})
                model.train()
            for group in opt.param_groups:  # the schedule advances per input, selected or not (as the repo's)
                group["lr"] = lr * scale(step)
            loss, selected = objective(model, x)
            log.selected.append(bool(selected))
            if selected or not skip_unselected:
                loss.backward()
                log.backward_passes += 1
                torch.nn.utils.clip_grad_norm_(params, grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                log.losses.append(loss.item())
            else:
                log.losses.append(None)
            step += 1
    if probe is not None and every:
        model.eval()
        log.checkpoints.append({"step": step, **probe()})
    model.eval()
    return log


def adapt_online(model, inputs: list[Tensor], objective: Objective, *, chunk: int, lr: float,
                 predict: Callable[[list[Tensor]], list], quiet: bool | None = None) -> tuple[list, AdaptLog]:
    """Online TTL: for each chunk of the stream, predict with the current model, then adapt on the
    chunk's inputs (constant lr; the objective sees the current model, so easy inputs drop out)."""
    predictions, total = [], AdaptLog()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    for start in progress(range(0, len(inputs), chunk), quiet=quiet, desc="online"):
        part = inputs[start:start + chunk]
        model.eval()
        predictions += predict(part)
        model.train()
        for x in part:
            loss, selected = objective(model, x)
            total.selected.append(bool(selected))
            if selected:
                loss.backward()
                total.backward_passes += 1
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                total.losses.append(loss.item())
            else:
                total.losses.append(None)
    model.eval()
    return predictions, total


# ------------------------------------------------------------------ the toy of the notebook

CONTROLS = {"no_sel": "TLM and online TLM adapt on every input with weight 1 (TLM without the SEL score)",
            "no_adapt": "TLM and online TLM run at learning rate 0, i.e. they are the base model"}


@dataclass(frozen=True)
class Config:
    """Every size and knob of the toy: domains, base model and its source-domain pre-training, test streams,
    LoRA (r = 8, α = 16, on every linear layer: q/v alone cannot move this 2-layer model's word transitions),
    SEL (log P0 from `select_frac`, λ), the baselines, online TLM's chunk, and the control."""

    domains: MarkovDomains = field(default_factory=MarkovDomains)
    base: TinyLM = TinyLM(d_model=64, n_layers=2, n_heads=4, max_len=32, steps=500, batch_size=64, lr=3e-3)
    n_stream: int = 300  # unlabeled target inputs: what test-time learning sees
    n_held: int = 200  # held-out target questions with answers
    n_source: int = 200  # source questions (forgetting)
    data_seed: int = 3000  # the test streams' generator is seeded data_seed + seed
    lora_r: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    select_frac: float = 0.9  # log P0: the base-CE quantile above which this share of the stream lies
    lamb: float = 0.1
    lr: float = 1e-3
    half_quantile: float = 0.5  # "TLM, half selected": log P0 at this quantile (Fig. 3's P0 sweep)
    eata_frac: float = 0.4  # EATA's E0 = eata_frac · ln V
    full_lr_div: int = 10  # "TLM, full parameters": every weight, at lr / full_lr_div
    probe_every: int = 50  # Obs. 1: TLM's input and output perplexity every this many inputs
    chunk: int = 8  # online TLM
    control: str = ""  # "no_sel": TLM weights every input 1; "no_adapt": TLM at lr 0 (see CONTROLS)

    @classmethod
    def for_scale(cls, scale: str, *, select_frac: float = 0.9, lr: float = 1e-3, control: str = "") -> Config:
        """Smoke: 300 test inputs, 500 pre-training steps; full: 1,000 and 1,500. The notebook's knobs and a
        control pass through."""
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
        sizes = {} if scale == "smoke" else {"n_stream": 1000, "base": replace(cls.base, steps=1500)}
        return cls(**sizes, select_frac=select_frac, lr=lr, control=control)

    @property
    def sel(self) -> bool:
        return self.control != "no_sel"

    @property
    def tlm_lr(self) -> float:
        return 0.0 if self.control == "no_adapt" else self.lr


@torch.no_grad()
def evaluate(model, data: dict[str, Tensor], *, generator: torch.Generator, device) -> dict[str, float]:
    """Greedy answers vs the references (`acc`, `rougeL`), the reference answers' output PPL (`answer_scores`),
    and the questions' own input PPL exp(mean_i CE_i) (`in_ppl`, Obs. 1)."""
    scores = answer_scores(model, data, generator=generator, device=device)
    return {**scores, "in_ppl": sample_ce(model, data["input"].to(device)).mean().exp().item()}


@dataclass
class Toy:
    """The built experiment: the pre-trained base model, the unlabeled stream (inputs (1, T) each), held-out
    target and source questions, the base model's CE on the stream and log P0 (`threshold`)."""

    cfg: Config
    run: TrainResult
    inputs: list[Tensor]
    held: dict[str, Tensor]
    source: dict[str, Tensor]
    ce0: Tensor
    threshold: float
    generator: torch.Generator
    device: str

    @property
    def base(self):
        return self.run.model

    def lora_copy(self):
        """A copy of the base model with fresh LoRA adapters (the only trainable weights)."""
        c = self.cfg
        return add_lora(copy.deepcopy(self.base), r=c.lora_r, alpha=c.lora_alpha, targets=c.lora_targets)

    def score(self, model, log: AdaptLog | None = None) -> dict:
        """{"target": held-out target scores, "source": source scores (forgetting), "backward", "selected"}."""
        return {"target": evaluate(model, self.held, generator=self.generator, device=self.device),
                "source": evaluate(model, self.source, generator=self.generator, device=self.device),
                "backward": log.backward_passes if log else 0, "selected": sum(log.selected) if log else 0}


def build(cfg: Config, seed: int, device: str = "cpu") -> Toy:
    """Pre-train (or load from the cache) the base model on the source domain, draw the test streams, and set
    log P0 so that `cfg.select_frac` of the stream is selected by the base model's CE."""
    dom = cfg.domains
    run = cfg.base.fit(dom, len(dom.tokenizer), seed=seed, device=device)
    g = torch.Generator().manual_seed(cfg.data_seed + seed)
    stream = dom.sample(cfg.n_stream, "target", g)  # unlabeled: only stream["input"] is used
    held, source = dom.sample(cfg.n_held, "target", g), dom.sample(cfg.n_source, "source", g)
    inputs = [stream["input"][i:i + 1].to(device) for i in range(len(stream["input"]))]
    with torch.no_grad():
        ce0 = sample_ce(run.model, torch.cat(inputs))
    threshold = torch.quantile(ce0, 1 - cfg.select_frac).item()  # log P0
    return Toy(cfg, run, inputs, held, source, ce0, threshold, g, device)


def base_ce(model) -> Callable[[Tensor], Tensor]:
    """Offline TLM's selecting CE: the LoRA model's with its adapters disabled (the base model), no gradient."""

    def ce(x):
        with model.disable_adapter(), torch.no_grad():
            return sample_ce(model, x)

    return ce


def arms(toy: Toy) -> dict[str, tuple[Callable[[object], Objective], bool, float]]:
    """The offline arms: name -> (objective of the adapted copy m, LoRA (else every weight), lr). A control
    substitutes in TLM only: every input weighted 1 (`no_sel`) or lr 0 (`no_adapt`)."""
    cfg, th, base, k = toy.cfg, toy.threshold, toy.base, toy.cfg.domains.answer
    e0 = lambda: cfg.eata_frac * torch.log(torch.tensor(float(len(cfg.domains.tokenizer)))).item()
    half = lambda: torch.quantile(toy.ce0, cfg.half_quantile).item()
    return {"TLM": (lambda m: tlm_objective(threshold=th, lamb=cfg.lamb, base_ce=base_ce(m), sel=cfg.sel), True,
                    cfg.tlm_lr),
            "TLM w/o SEL": (lambda m: tlm_objective(sel=False), True, cfg.lr),
            "TLM, half selected": (lambda m: tlm_objective(threshold=half(), lamb=cfg.lamb, base_ce=base_ce(m)),
                                   True, cfg.lr),
            "Tent": (lambda m: tent_objective(k), True, cfg.lr),
            "EATA": (lambda m: eata_objective(e0(), k), True, cfg.lr),
            "TLM, full parameters": (lambda m: tlm_objective(threshold=th, lamb=cfg.lamb,
                                                             base_ce=lambda x: sample_ce(base, x).detach()),
                                     False, cfg.lr / cfg.full_lr_div)}


def run_arms(toy: Toy) -> tuple[dict[str, dict], list[dict]]:
    """Adapt a fresh copy of the base model per arm on the unlabeled stream — offline (`adapt`, one epoch) for
    `arms`, then online TLM (`adapt_online`, chunks of `cfg.chunk`, the current model's CE) — and score each
    (`Toy.score`). Returns {arm: scores} and TLM's Obs. 1 checkpoints ({"step", "out_ppl", "in_ppl"})."""
    cfg, results, curve = toy.cfg, {}, []
    ppl = lambda m: {k: v for k, v in evaluate(m, toy.held, generator=toy.generator, device=toy.device).items()
                     if k in ("out_ppl", "in_ppl")}  # Obs. 1's probe on the held-out target questions
    for name, (objective, lora, lr) in arms(toy).items():
        m = toy.lora_copy() if lora else copy.deepcopy(toy.base)
        probe = (lambda m=m: ppl(m)) if name == "TLM" else None
        log = adapt(m, toy.inputs, objective(m), lr=lr, probe=probe, every=cfg.probe_every if probe else 0)
        if name == "TLM":
            curve = log.checkpoints
        results[name] = toy.score(m, log)
    m = toy.lora_copy()
    # online TLM is scored after the stream, like the offline arms: its per-chunk predictions are not used
    _, log = adapt_online(m, toy.inputs, tlm_objective(threshold=toy.threshold, lamb=cfg.lamb, sel=cfg.sel),
                          chunk=cfg.chunk, lr=cfg.tlm_lr, predict=lambda part: [None] * len(part))
    results["online TLM"] = toy.score(m, log)
    return results, curve
