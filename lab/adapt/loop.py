"""The test-time adaptation loops every arm of `lab.adapt` runs: offline (one pass over the unlabeled inputs) and
online (answer each chunk of the stream, then learn from it), after the official TLM code (`Fhujinwu/TLM`, a
LLaMA-Factory fork: its offline trainer config and `forward_for_online`). An `Objective` maps (model, one input)
to (loss, selected); the loops back-propagate only selected inputs (unless told otherwise) and count the backward
passes, so methods that skip inputs (TLM's SEL, EATA's filters) are compared at their real cost."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lab.core import progress


@dataclass
class AdaptLog:
    """What an adaptation run did: per-step loss (None when skipped), selected flags, backward passes."""

    losses: list[float | None] = field(default_factory=list)
    selected: list[bool] = field(default_factory=list)
    backward_passes: int = 0
    checkpoints: list[dict] = field(default_factory=list)  # whatever `probe` returned at each `every`


Objective = Callable[[object, Tensor], tuple[Tensor, Tensor]]  # (model, x (1, T)) -> (loss, selected (bool))


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
                 predict: Callable[[list[Tensor]], list], grad_clip: float = 1.0,
                 quiet: bool | None = None) -> tuple[list, AdaptLog]:
    """Online TTL (the official `forward_for_online`): for each chunk of the stream, answer it with the current
    model (`predict(chunk)`, whose outputs are collected), then adapt on the chunk's inputs with a *fresh* AdamW at
    constant lr (the official code builds a new trainer, hence a new optimiser, per chunk); the objective sees the
    current model, so inputs it has learned drop out."""
    predictions, total = [], AdaptLog()
    for start in progress(range(0, len(inputs), chunk), quiet=quiet, desc="online"):
        part = inputs[start:start + chunk]
        model.eval()
        predictions += predict(part)
        log = adapt(model, part, objective, lr=lr, schedule="constant", grad_clip=grad_clip, quiet=True)
        total.losses += log.losses
        total.selected += log.selected
        total.backward_passes += log.backward_passes
    model.eval()
    return predictions, total
