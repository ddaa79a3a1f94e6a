"""The tour: the lab's anatomy on one small, real experiment.

A two-layer Llama-style transformer learns in-context key-value recall (`lab.data.KVRecall`): after
reading `k3 v7 k1 v2 k9 v0 ? k1` it must answer `v2`. We measure (1) recall accuracy against chance
1/n_values, and (2) *how* it recalls: induction-style retrieval predicts that at the query position
some head attends to the answer's position in the context, i.e. for head h of layer l

    a_{l,h} = E_examples[ A_{l,h}[T, pos(answer)] ]      (A: softmax attention, T: last position)

is large for one head and ~1/T for the rest. Every paper module follows this shape: a frozen Config
with sizes per scale, pure functions returning tensors, no display code.

Training runs to a convergence criterion with a step cap: a run of `steps` steps is accepted when its recall
accuracy on held-out validation prompts reaches `target_acc`; a run stuck on a loss plateau (induction heads
sometimes fail to form from an unlucky initialisation) is restarted from a fresh initialisation and data order,
at most `max_restarts` times. Every attempt is cached by the trainer, so a re-run costs no training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lab.data import KVRecall
from lab.models import TrainConfig, fit, tiny_llama
from lab.models.score import choice_logprobs

CONTROLS = {"untrained": "the same architecture at its random initialisation, never trained (the method's baseline)"}


@dataclass(frozen=True)
class Config:
    n_pairs: int = 3  # key-value pairs per context
    n_keys: int = 16
    n_values: int = 16  # chance accuracy = 1 / n_values
    n_queries: int = 6  # queries per training sequence (denser signal, faster induction)
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3
    n_eval: int = 500
    target_acc: float = 0.98  # convergence criterion: validation recall accuracy of an accepted run
    n_val: int = 200  # validation prompts (their own seed, apart from the evaluation prompts)
    max_restarts: int = 3  # step cap: (1 + max_restarts) * steps

    @classmethod
    def for_scale(cls, scale: str) -> Config:
        """Smoke: ~15 s of training on one CPU thread. Full: longer contexts, a wider model."""
        if scale == "smoke":
            return cls()
        return cls(n_pairs=8, n_keys=64, n_values=64, d_model=256, n_layers=4, n_heads=8, steps=3000,
                   batch_size=128, n_eval=2000)

    def task(self) -> KVRecall:
        return KVRecall(self.n_pairs, self.n_keys, self.n_values, self.n_queries)

    def train_config(self, seed: int, attempt: int = 0) -> TrainConfig:
        """Attempt 0 trains from `seed`; a restart k > 0 from seed + 1000 k (fresh init and data order)."""
        return TrainConfig(steps=self.steps, batch_size=self.batch_size, lr=self.lr, seed=seed + 1000 * attempt)

    def build(self):
        """A fresh, untrained model for this config (the trainer seeds before calling it)."""
        task = self.task()
        return tiny_llama(vocab_size=len(task.tokenizer), d_model=self.d_model, n_layers=self.n_layers,
                          n_heads=self.n_heads, max_len=2 * task.seq_len)


@dataclass
class Trained:
    """The accepted model and how it was reached: one (attempt, validation accuracy, cached) per attempt."""

    model: torch.nn.Module
    losses: list[float]  # of the accepted attempt (empty for an untrained model)
    attempts: list[tuple[int, float, bool]] = field(default_factory=list)
    converged: bool = False  # the criterion was met within the step cap
    seconds: float = 0.0  # training time of all attempts (as recorded when each was trained)

    @property
    def steps(self) -> int:
        """Training steps spent, restarts included."""
        return len(self.losses) * len(self.attempts)


def converge(attempt: Callable[[int], tuple[torch.nn.Module, list[float], bool, float]],
             score: Callable[[torch.nn.Module], float], target: float, max_restarts: int) -> Trained:
    """Run `attempt(k)` for k = 0, 1, ... until `score(model) >= target` or `max_restarts` restarts are spent.

    `attempt(k)` returns (model, losses, cached, seconds). Returns the first run that meets the criterion,
    else the best-scoring one (with `converged=False`)."""
    best, best_score, history, seconds = None, float("-inf"), [], 0.0
    for k in range(max_restarts + 1):
        model, losses, cached, secs = attempt(k)
        acc = score(model)
        history.append((k, acc, cached))
        seconds += secs
        if acc > best_score:
            best, best_score = (model, losses), acc
        if acc >= target:
            break
    return Trained(best[0], best[1], history, best_score >= target, seconds)


def train(cfg: Config, seed: int, device: str = "cpu", control: str = "") -> Trained:
    """The tour's model for `seed`, trained to the convergence criterion (see the module docstring).

    `control="untrained"` returns the same architecture, seeded the same way, without any training."""
    task = cfg.task()
    if control == "untrained":
        torch.manual_seed(seed)
        return Trained(cfg.build().to(device).eval(), [])
    if control:
        raise ValueError(f"control={control!r} is not a control of the tour; use one of {', '.join(CONTROLS)}.")
    val = task.examples(cfg.n_val, torch.Generator().manual_seed(30_000 + seed))

    def attempt(k: int):
        run = fit(cfg.build, task, cfg.train_config(seed, k), device=device)
        return run.model, run.losses, run.cached, run.seconds

    return converge(attempt, lambda m: recall(m, task.tokenizer, val, task.values)[0], cfg.target_acc,
                    cfg.max_restarts)


def describe(model, cfg: Config, run: Trained | None = None, control: str = "", name: str = "") -> str:
    """One line on the model the tour measures: its parameter count and how it was reached — trained (attempts,
    validation recall per attempt, from the cache or trained), left untrained (`control`), or loaded (`name`,
    when `run` is None)."""
    n = sum(p.numel() for p in model.parameters())
    if run is None:
        return f"loaded {name}: {n:,} parameters"
    if control:
        return f"{n:,} parameters; control {control!r}: left at its random initialisation"
    accs = ", ".join(f"{v:.3f}" for _, v, _ in run.attempts)
    return (f"{n:,} parameters; {'converged' if run.converged else 'NOT converged'} in {len(run.attempts)} attempt(s) "
            f"of {cfg.steps} steps (validation recall per attempt: {accs}; "
            f"{'from the cache' if all(c for *_, c in run.attempts) else f'trained in {run.seconds:.1f} s'})")


def recall(model, tokenizer, examples: list[dict], choices: list[str]) -> tuple[float, torch.Tensor]:
    """Accuracy of argmax over `choices`, and the (N, C) choice log-probs it was taken from."""
    logp = choice_logprobs(model, tokenizer, [e["prompt"] for e in examples], choices)  # (N, C)
    target = torch.tensor([choices.index(e["answer"]) for e in examples])  # (N,)
    return (logp.argmax(-1) == target).float().mean().item(), logp


@torch.no_grad()
def answer_attention(model, tokenizer, examples: list[dict]) -> torch.Tensor:
    """a_{l,h}: mean attention weight from the last prompt token onto the answer's token(s): (L, H).

    Token positions come from the tokenizer's character offsets, so this works for any fast
    tokenizer (the answer may span several tokens; their weights are summed). Needs eager attention.
    """
    device = next(model.parameters()).device
    total = None
    for e in examples:
        enc = tokenizer(e["prompt"], add_special_tokens=False, return_offsets_mapping=True)
        s, t = e["answer_span"]
        pos = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < t and b > s]
        att = model(input_ids=torch.tensor([enc["input_ids"]], device=device), output_attentions=True).attentions
        a = torch.stack([layer[0, :, -1, pos].sum(-1) for layer in att]).float().cpu()  # (L, H)
        total = a if total is None else total + a
    return total / len(examples)
