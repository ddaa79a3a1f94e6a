r"""TLM's toy (Hu et al., ICML 2025; the method is `lab.adapt.tlm`): a 2-layer Llama pre-trained on a source Markov
domain and an unrelated retention domain (`lab.data.domains.RetentionDomains`) meets an unlabeled stream from a
shifted target domain; each arm (TLM, TLM w/o SEL, Tent, EATA, COME, full-parameter TLM, online TLM with and without
SEL) adapts a fresh copy of the base model on the stream and is scored on the stream's answers, on held-out target
questions and on the retention domain (`Config`, `build`, `run_arms`).

Baselines (not in the official repository; the paper's Sec. 5 description), in `lab.adapt.entropy_tta`: Tent, the
entropy of the model's own greedy continuation; EATA (official `mr-eggplant/EATA`): that entropy on reliable
(E < E0) and non-redundant (cosine filter against a moving average) inputs, weighted 1/exp(E − E0), plus its Fisher
regulariser; COME (official `BlueWhaleLab/COME`): Tent with the entropy of an opinion that keeps an uncertainty mass.
All three adapt the same LoRA weights, and their backward passes are counted.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from lab.adapt import entropy_tta as E
from lab.adapt.loop import AdaptLog, Objective, adapt, adapt_online
from lab.adapt.tlm import add_lora, base_ce, pool_scores, sample_ce, tlm_objective
from lab.core.stages import stage
from lab.data.domains import MarkovDomains, RetentionDomains, answer_scores
from lab.models import TinyLM, TrainResult

CONTROLS = {"no_sel": "TLM and online TLM adapt on every input with weight 1 (TLM without the SEL score)",
            "no_adapt": "TLM and online TLM run at learning rate 0, i.e. they are the base model",
            "entropy_as_ppl": "Tent, EATA and COME minimise the input perplexity (TLM w/o SEL's loss) in their own "
                              "loops",
            "source_inputs": "TLM and online TLM adapt on unlabeled source-domain inputs (as many, log P0 set on them "
                             "the same way) instead of the target stream; every score is still on the target",
            "source_answers": "the held-out target questions are scored against the answers the source chain gives "
                              "them (same questions, same adaptation): output PPL on a domain the inputs do not share"}


@dataclass(frozen=True)
class Config:
    """Every size and knob of the toy: domains (with the retention domain in pre-training), base model and its
    pre-training, test streams, LoRA (r = 8, α = 16, on W_q, W_v, W_o and the MLP: a larger step than the paper's q/v,
    which the arm "TLM, LoRA on q/v (the paper's)" runs beside it), SEL (log P0 from `select_frac`, λ), the
    baselines, online TLM's chunk, the control."""

    domains: MarkovDomains = field(default_factory=RetentionDomains)
    base: TinyLM = TinyLM(d_model=64, n_layers=2, n_heads=4, max_len=32, steps=500, batch_size=64, lr=3e-3)
    n_stream: int = 250  # the target test stream: its inputs are all test-time learning sees; answers only score
    n_held: int = 200  # held-out target questions with answers
    n_retain: int = 200  # retention-domain questions (forgetting, Fig. 2)
    n_fisher: int = 64  # source questions for EATA's Fisher (in-distribution data, pseudo-labels)
    data_seed: int = 3000  # the test streams' generator is seeded data_seed + seed
    lora_r: int = 8
    lora_alpha: int = 16
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    select_frac: float = 0.9  # log P0: the base-CE quantile above which this share of the stream lies
    lamb: float = 0.1
    lr: float = 1e-3
    eata_frac: float = 0.4  # EATA's E0 = eata_frac · ln V (EATA's 0.4 · ln C)
    eata_margin: float = 0.4  # EATA's redundancy margin ε on |cos(p̄, m)| (EATA: 0.4 on CIFAR-10, 0.05 on ImageNet)
    eata_alpha: float = 2000.0  # EATA's Fisher weight β (official default)
    full_lr_div: int = 10  # "TLM, full parameters": every weight, at lr / full_lr_div
    probe_every: int = 50  # Obs. 1: TLM's input and output perplexity every this many inputs
    chunk: int = 8  # online TLM (the official online_ttl.yaml's streaming_batch_size)
    control: str = ""  # a name in CONTROLS

    @classmethod
    def for_scale(cls, scale: str, *, select_frac: float = 0.9, lr: float = 1e-3, control: str = "") -> Config:
        """Smoke: 250 test inputs, 500 pre-training steps; full: 1,000 and 1,500. The notebook's knobs and a
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
def perplexities(model, data: dict[str, Tensor], *, device) -> dict[str, float]:
    """Obs. 1's two numbers: the reference answers' output PPL and the questions' own input PPL exp(mean_i CE_i)."""
    x, y = data["input"].to(device), data["answer"].to(device)
    logp = model(input_ids=torch.cat([x, y], 1)).logits[:, x.shape[1] - 1:-1].float().log_softmax(-1)
    return {"out_ppl": (-logp.gather(-1, y[..., None]).mean()).exp().item(),
            "in_ppl": sample_ce(model, x).mean().exp().item()}


@torch.no_grad()
def evaluate(model, data: dict[str, Tensor], *, generator: torch.Generator, device) -> dict[str, float]:
    """Greedy answers vs the references (`acc`, `rougeL`), the reference answers' output PPL (`answer_scores`),
    and the questions' own input PPL exp(mean_i CE_i) (`in_ppl`, Obs. 1)."""
    scores = answer_scores(model, data, generator=generator, device=device)
    return {**scores, "in_ppl": sample_ce(model, data["input"].to(device)).mean().exp().item()}


@dataclass
class Toy:
    """The built experiment: the pre-trained base model, the target test stream (`inputs`, (1, T) each, are what
    adaptation sees; `stream` adds their answers, used only to score the answers given), held-out target
    questions, retention-domain questions, source batches for EATA's Fisher, the base CE on the stream, log P0."""

    cfg: Config
    run: TrainResult
    inputs: list[Tensor]
    stream: dict[str, Tensor]
    held: dict[str, Tensor]
    retain: dict[str, Tensor]
    fisher_inputs: list[Tensor]
    ce0: Tensor
    threshold: float
    generator: torch.Generator
    device: str
    source_inputs: list[Tensor] = field(default_factory=list)  # the `source_inputs` control's stream ...
    source_threshold: float = 0.0  # ... and its log P0

    def adaptation_stream(self) -> tuple[list[Tensor], float]:
        """What TLM and online TLM learn from, and its log P0: the target inputs, or under `source_inputs` the
        source ones (the other arms never see that control)."""
        if self.cfg.control == "source_inputs":
            return self.source_inputs, self.source_threshold
        return self.inputs, self.threshold

    @property
    def base(self):
        return self.run.model

    def lora_copy(self, targets: tuple[str, ...] | None = None):
        """A copy of the base model with fresh LoRA adapters (the only trainable weights) on `targets` (default:
        the config's)."""
        c = self.cfg
        return add_lora(copy.deepcopy(self.base), r=c.lora_r, alpha=c.lora_alpha, targets=targets or c.lora_targets)

    def answers(self, model, data: dict[str, Tensor]) -> dict[str, float]:
        return answer_scores(model, data, generator=self.generator, device=self.device)

    def score(self, model, log: AdaptLog | None = None, *, entropy: bool = False) -> dict:
        """{"target": held-out target output and input PPL (`perplexities`; with `entropy`, also the mean entropy of
        the greedy continuation: what Tent minimises), "stream": the stream's answers given by the final model (the
        offline protocol: adapt, then answer; `answer_scores`), "retention": retention-domain answers (forgetting),
        "backward", "selected"}."""
        target = perplexities(model, self.held, device=self.device)
        if entropy:
            with torch.no_grad():
                x = self.held["input"].to(self.device)
                target["entropy"] = E.entropy_of_continuation(model, x, self.cfg.domains.answer).mean().item()
        return {"target": target, "stream": self.answers(model, self.stream),
                "retention": self.answers(model, self.retain),
                "backward": log.backward_passes if log else 0, "selected": sum(log.selected) if log else 0}


def build(cfg: Config, seed: int, device: str = "cpu") -> Toy:
    """Pre-train (or load from the cache) the base model on the source and retention domains, draw the test
    streams, and set log P0 so that `cfg.select_frac` of the stream is selected by the base model's CE."""
    dom = cfg.domains
    run = cfg.base.fit(dom, len(dom.tokenizer), seed=seed, device=device)
    g = torch.Generator().manual_seed(cfg.data_seed + seed)
    stream = dom.sample(cfg.n_stream, "target", g)
    held, retain = dom.sample(cfg.n_held, "target", g), dom.retained(cfg.n_retain, g)
    if cfg.control == "source_answers":
        held = {**held, "answer": dom.answers_of(held["input"], "source")}
    fisher = dom.sample(cfg.n_fisher, "source", g)["input"].to(device).split(16)
    inputs = [stream["input"][i:i + 1].to(device) for i in range(len(stream["input"]))]
    with torch.no_grad():
        ce0 = sample_ce(run.model, torch.cat(inputs))
    threshold = torch.quantile(ce0, 1 - cfg.select_frac).item()  # log P0
    src = dom.sample(cfg.n_stream, "source", torch.Generator().manual_seed(cfg.data_seed + 50_000 + seed))["input"]
    with torch.no_grad():
        src_th = torch.quantile(sample_ce(run.model, src.to(device)), 1 - cfg.select_frac).item()
    return Toy(cfg, run, inputs, stream, held, retain, list(fisher), ce0, threshold, g, device,
               [src[i:i + 1].to(device) for i in range(len(src))], src_th)


QV = ("q_proj", "v_proj")  # the paper's LoRA targets (official offline_ttl.yaml: lora_target q_proj,v_proj)


def arms(toy: Toy) -> dict[str, tuple[Callable[[object], Objective], tuple[str, ...] | None, float]]:
    """The offline arms: name -> (objective of the adapted copy m, its LoRA targets (None: every weight), lr).
    Controls substitute in TLM (`no_sel`, `no_adapt`, `source_inputs`) or in Tent, EATA and COME (`entropy_as_ppl`:
    each loop's per-input loss becomes the input's NLL; EATA keeps its entropy filters, weights and Fisher term)."""
    cfg, th, base, k, lt = toy.cfg, toy.adaptation_stream()[1], toy.base, toy.cfg.domains.answer, toy.cfg.lora_targets
    e0 = cfg.eata_frac * math.log(len(cfg.domains.tokenizer))
    ppl = cfg.control == "entropy_as_ppl"
    eata = lambda m: E.eata_objective(e0, k, d_margin=cfg.eata_margin, alpha=cfg.eata_alpha,
                                    fishers=E.fisher_information(m, toy.fisher_inputs, k),
                                    per_sample=sample_ce if ppl else None)
    tlm = lambda m: tlm_objective(threshold=th, lamb=cfg.lamb, base_ce=base_ce(m), sel=cfg.sel)
    return {"TLM": (tlm, lt, cfg.tlm_lr),
            "TLM w/o SEL": (lambda m: tlm_objective(sel=False), lt, cfg.lr),
            "Tent": (lambda m: tlm_objective(sel=False) if ppl else E.tent_objective(k), lt, cfg.lr),
            "EATA": (eata, lt, cfg.lr),
            "COME": (lambda m: tlm_objective(sel=False) if ppl else E.come_objective(k), lt, cfg.lr),
            "TLM, LoRA on q/v (the paper's)": (tlm, QV, cfg.tlm_lr),
            "TLM, full parameters": (lambda m: tlm_objective(threshold=th, lamb=cfg.lamb,
                                                             base_ce=lambda x: sample_ce(base, x).detach()),
                                     None, cfg.lr / cfg.full_lr_div)}


def run_online(toy: Toy, *, sel: bool, lr: float | None = None) -> dict:
    """Online TLM (`adapt_online`, chunks of `cfg.chunk`, the current model's CE selecting) on a LoRA copy, scored
    as the paper scores it: on the stream's own answers, each chunk answered before the model trains on it
    (`"stream"`, pooled over the chunks); `"target"` and `"retention"` are the final model's."""
    cfg, m, (inputs, th) = toy.cfg, toy.lora_copy(), toy.adaptation_stream()
    chunks = zip(torch.cat(toy.inputs).split(cfg.chunk), toy.stream["answer"].split(cfg.chunk))  # what is answered
    predict = lambda part: [(len(x), toy.answers(m, {"input": x, "answer": y})) for x, y in [next(chunks)]]
    parts, log = adapt_online(m, inputs, tlm_objective(threshold=th, lamb=cfg.lamb, sel=sel),
                              chunk=cfg.chunk, lr=cfg.lr if lr is None else lr, predict=predict)
    return {**toy.score(m, log), "stream": pool_scores(parts)}


ENTROPY_ARMS = ("Tent", "EATA", "COME")  # the entropy-minimisation baselines
ARM_CONTROLS = {"TLM": ("no_sel", "no_adapt", "source_inputs"),  # where each control substitutes
                "TLM, LoRA on q/v (the paper's)": ("no_sel", "no_adapt", "source_inputs"),
                "online TLM": ("no_sel", "no_adapt", "source_inputs"), **{a: ("entropy_as_ppl",) for a in ENTROPY_ARMS}}


def run_arms(toy: Toy) -> tuple[dict[str, dict], list[dict]]:
    """Adapt a fresh copy of the base model per arm on the unlabeled stream — offline (`adapt`, one epoch) for
    `arms`, then online TLM with and without SEL (`run_online`) — and score each (`Toy.score`). Returns {arm:
    scores} and TLM's Obs. 1 checkpoints ({"step", "out_ppl", "in_ppl"} on the held-out target questions). Every
    arm starts from the same random state (`arm_seed`): arms with the same LoRA targets start from the same adapters,
    so TLM − TLM w/o SEL is the objectives' difference, not two draws' (and adding or reordering arms changes no
    other arm's result). Each is a cached stage that sees the control only if it substitutes in that arm, so a
    control run reuses the arms it does not change."""
    results, curve = {}, []
    for name in (*arms(toy), "online TLM", "online TLM w/o SEL"):
        control = toy.cfg.control if toy.cfg.control in ARM_CONTROLS.get(name, ()) else ""
        torch.manual_seed(arm_seed(toy))
        results[name], checkpoints = run_arm(replace(toy, cfg=replace(toy.cfg, control=control)), name)
        curve = checkpoints if name == "TLM" else curve
    return results, curve


def arm_seed(toy: Toy) -> int:
    """The torch seed every arm starts from: the toy's data seed, nothing about the arm or the other arms."""
    return zlib.crc32(f"{toy.generator.initial_seed()}:arms".encode())


@stage
def run_arm(toy: Toy, name: str) -> tuple[dict, list[dict]]:
    """One arm of `run_arms`: its scores and, for offline arms, the probe's checkpoints (TLM's only)."""
    cfg = toy.cfg
    if name.startswith("online TLM"):
        sel = name == "online TLM" and cfg.sel
        return run_online(toy, sel=sel, lr=cfg.tlm_lr if name == "online TLM" else None), []
    objective, targets, lr = arms(toy)[name]
    m = toy.lora_copy(targets) if targets else copy.deepcopy(toy.base)
    probe = (lambda: perplexities(m, toy.held, device=toy.device)) if name == "TLM" else None
    inputs = toy.adaptation_stream()[0] if name == "TLM" else toy.inputs
    log = adapt(m, inputs, objective(m), lr=lr, probe=probe, every=cfg.probe_every if probe else 0)
    return toy.score(m, log, entropy=name in ENTROPY_ARMS), log.checkpoints if name == "TLM" else []
