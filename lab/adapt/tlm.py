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
online, from the current model per chunk: each chunk of the stream is answered first, then learned from
with a fresh optimiser (the official `forward_for_online` builds a new trainer per chunk), and online TLM is
scored on those answers. The official trainer back-propagates a zero loss for unselected samples; here they
are truly skipped (`skip_unselected=True`), and the count of backward passes is returned either way.

The offline and online loops (`adapt`, `adapt_online`) are `lab.adapt.loop`; the entropy baselines
`lab.adapt.entropy_tta`; the notebook's toy and its arms `lab.adapt.tlm_study`; the checkpoint path
`lab.adapt.tlm_checkpoint`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from lab.adapt.loop import Objective


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


def pool_scores(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """Scores of a stream answered in parts [(n_i, answer_scores of part i)]: accuracy and ROUGE-L averaged
    with weights n_i, output PPL as exp of the n_i-weighted mean log PPL (every answer has the same length, so
    this equals scoring all answers at once)."""
    n = sum(k for k, _ in parts)
    out = {key: sum(k * s[key] for k, s in parts) / n for key in ("acc", "rougeL")}
    out["out_ppl"] = math.exp(sum(k * math.log(s["out_ppl"]) for k, s in parts) / n)
    return out


def base_ce(model) -> Callable[[Tensor], Tensor]:
    """Offline TLM's selecting CE: the LoRA model's with its adapters disabled (the base model), no gradient."""

    def ce(x):
        with model.disable_adapter(), torch.no_grad():
            return sample_ce(model, x)

    return ce
