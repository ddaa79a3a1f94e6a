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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lab.core import progress


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
