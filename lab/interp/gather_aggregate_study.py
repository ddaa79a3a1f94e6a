"""What the Gather & Aggregate protocol studies (`lab.interp.gather_aggregate`; Bick, Xing & Gu, ICML 2025, §3):
the two toys (a Llama-style Transformer and a Mamba-2, plus two Mamba-2/attention hybrids for step 5) trained, or
loaded from the cache, on the mini-MMLU letter task, or a checkpoint on English category MCQs, each with its
held-out letter, cloze and verification prompts.

`train_toys` gives the toys their (gather, aggregate) layer pair (0, 1) and lets the head sweep find G and A;
`load_checkpoint` leaves the pair to `locate` and gives the paper's G and A where it reports them (`paper_heads`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from lab.data.letters import LetterRetrieval
from lab.data.mcq import CategoryMCQ
from lab.interp.ablation import Evaluate
from lab.interp.gather_aggregate import Config, paper_heads
from lab.models import TrainConfig, fit, load_model, tiny_hybrid, tiny_llama, tiny_mamba2
from lab.models.score import choice_accuracy


@dataclass
class Study:
    """The models under study, their tokenizer and task, held-out prompts (seeded by 10 000 + seed; the
    verification prompts by 30 000 + seed), each model's (gather, aggregate) layer pair (a checkpoint's
    comes from `locate`) and its given G and A."""

    models: dict[str, nn.Module]
    tokenizer: object
    task: LetterRetrieval | CategoryMCQ
    letter_ex: list[dict]
    cloze_ex: list[dict]
    pairs: dict[str, tuple[int, int]]
    heads: dict[str, tuple[tuple[int, int], tuple[int, int]] | None]  # None: the sweep finds G and A
    info: dict[str, dict]  # per model: what was built or loaded
    verify_ex: list[dict] = field(default_factory=list)  # letter prompts that did not choose G and A
    hybrids: dict[str, nn.Module] = field(default_factory=dict)  # step 5's toy hybrids by layout

    def letter(self, model: nn.Module) -> Evaluate:  # retrieval
        return partial(choice_accuracy, model, self.tokenizer, self.letter_ex, self.task.letters)

    def verify(self, model: nn.Module) -> Evaluate:  # retrieval, on the verification prompts
        return partial(choice_accuracy, model, self.tokenizer, self.verify_ex, self.task.letters)

    def cloze(self, model: nn.Module) -> Evaluate:  # the knowledge alone (None: each example's choices)
        return partial(choice_accuracy, model, self.tokenizer, self.cloze_ex, self.task.choices("cloze"))


def train_toys(cfg: Config, seed: int, *, device: str = "cpu") -> Study:
    """The Transformer, the Mamba-2 and the hybrids trained (or loaded from the cache) on the same letter batches."""
    g = torch.Generator().manual_seed(10_000 + seed)
    task = LetterRetrieval(max_filler=0, n_questions=cfg.n_questions, n_labels=cfg.n_labels,
                           n_options=cfg.n_options, min_options=cfg.min_options)
    V = len(task.tokenizer)
    builds = {"transformer": (partial(tiny_llama, vocab_size=V, d_model=cfg.d_model, n_layers=cfg.n_layers,
                                      n_heads=cfg.n_heads), cfg.transformer_steps, cfg.batch_size),
              "mamba2": (partial(tiny_mamba2, vocab_size=V, d_model=cfg.d_model, n_layers=cfg.n_layers,
                                 head_dim=cfg.head_dim), cfg.mamba2_steps, cfg.batch_size),
              **{f"hybrid {lay}": (partial(tiny_hybrid, vocab_size=V, d_model=cfg.d_model, layout=lay,
                                             n_heads=cfg.n_heads, head_dim=cfg.head_dim), cfg.hybrid_steps,
                                   cfg.hybrid_batch_size) for lay in cfg.hybrid_layouts}}
    models, info = {}, {}
    for name, (build, steps, batch) in builds.items():
        res = fit(build, task, TrainConfig(steps=steps, batch_size=batch, lr=cfg.lr, seed=seed), device=device)
        models[name] = res.model
        info[name] = {"parameters": sum(p.numel() for p in res.model.parameters()), "steps": steps,
                      "final loss": round(res.losses[-1], 4) if steps else float("nan"), "from the cache": res.cached,
                      "seconds": round(res.seconds)}
    letter_ex = task.examples(cfg.n_letter, g, "letter", n_options=cfg.eval_options)
    cloze_ex = task.examples(cfg.n_cloze, g, "cloze")
    verify_ex = task.examples(cfg.n_verify, torch.Generator().manual_seed(30_000 + seed), "letter",
                              n_options=cfg.eval_options)
    hybrids = {lay: models.pop(f"hybrid {lay}") for lay in cfg.hybrid_layouts}
    return Study(models, task.tokenizer, task, letter_ex, cloze_ex, {name: (0, 1) for name in models},
                 {name: None for name in models}, info, verify_ex, hybrids)


def load_checkpoint(cfg: Config, model: str, seed: int, *, device: str = "cpu") -> Study:
    """A checkpoint (`load_model`) on English category MCQs, with the paper's heads where it reports them."""
    g = torch.Generator().manual_seed(10_000 + seed)
    net, tok = load_model(model, device=device)
    task = CategoryMCQ()
    letter_ex = task.examples(cfg.n_checkpoint, g, "letter")
    cloze_ex = task.examples(cfg.n_checkpoint, g, "cloze")
    verify_ex = task.examples(cfg.n_checkpoint, torch.Generator().manual_seed(30_000 + seed), "letter")
    heads = paper_heads(model)
    return Study({"checkpoint": net}, tok, task, letter_ex, cloze_ex, {}, {"checkpoint": heads},
                 {"checkpoint": {"parameters": sum(p.numel() for p in net.parameters()), "paper's heads": heads}},
                 verify_ex)
