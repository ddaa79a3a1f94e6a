"""A compact trainer for tiny causal LMs, with an on-disk cache of trained weights.

`fit(build, task, cfg)` seeds, builds the model, and either loads its trained weights from the cache
or trains it (AdamW, linear warm-up then cosine decay, gradient clipping, a progress bar) and stores
them. The cache key hashes everything that determines the weights: the model's config, the task's
spec (its dataclass fields), the training config (steps, seed, ...) and the library versions. An
entry is `<LAB_CACHE>/models/<key>/{model.safetensors, meta.json}`; the meta holds the weights'
sha256, so a truncated or corrupt entry is detected, logged, deleted and rebuilt.

`optimize(params, step_loss, ...)` is the one plain gradient loop (backward, optional clip, step, clear)
that the papers' own training runs on: a paper says what a step's loss is, the loop is shared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from lab.core import progress

log = logging.getLogger(__name__)
CACHE_VERSION = 1


class Task(Protocol):
    """A procedural task: a frozen dataclass (its fields are its spec) that samples batches."""

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`input_ids` (n, T) and `labels` (n, T) with -100 where no loss is taken."""
        ...


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_frac: float = 0.05  # linear warm-up over this fraction of the steps
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac
    grad_clip: float = 1.0
    seed: int = 0
    stop_loss: float | None = None  # converged: stop once the mean loss of the last 25 steps is below it (a cap: steps)


@dataclass
class TrainResult:
    model: torch.nn.Module
    losses: list[float]  # per step (loaded from the cache when cached)
    cached: bool
    key: str
    seconds: float  # wall time of the training run that produced the weights
    meta: dict[str, Any] = field(default_factory=dict)

    def __stage_key__(self) -> torch.nn.Module:
        """What identifies the result for `lab.core.stages`: the weights, not how long they took or whether they
        came from the cache."""
        return self.model


def optimize(params, step_loss: Callable[[int], torch.Tensor], *, steps: int, lr: float, grad_clip: float | None = None,
             optimizer: type[torch.optim.Optimizer] = torch.optim.Adam, desc: str = "train",
             quiet: bool | None = None) -> list[float]:
    """`steps` optimizer steps on `params`: each backpropagates `step_loss(step)` (a scalar), clips the
    gradient norm to `grad_clip` when given, steps and clears the gradients. Returns the per-step loss."""
    params = list(params)
    opt = optimizer(params, lr=lr)
    losses = []
    for step in progress(range(steps), quiet=quiet, desc=desc):
        value = step_loss(step)
        value.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(value.item())
    return losses


def cache_dir() -> Path:
    """`$LAB_CACHE`, else `$XDG_CACHE_HOME/icml25-lab`, else `~/.cache/icml25-lab`."""
    if os.environ.get("LAB_CACHE"):
        return Path(os.environ["LAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "icml25-lab"


def task_spec(task: Any) -> dict:
    """The task's identity for the cache: its class and dataclass fields."""
    if not dataclasses.is_dataclass(task):
        raise TypeError("a task must be a dataclass so its spec can key the cache.")
    return {"type": type(task).__qualname__, **dataclasses.asdict(task)}


def cache_key(model: torch.nn.Module, task: Any, cfg: TrainConfig, penalty: Any = None) -> str:
    import transformers

    spec = {"v": CACHE_VERSION, "arch": type(model).__name__, "model": model.config.to_dict(),
            "task": task_spec(task), "train": _train_spec(cfg),
            "penalty": None if penalty is None else task_spec(penalty),
            "torch": torch.__version__, "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _train_spec(cfg: TrainConfig) -> dict:
    """The training config's identity for the cache; an unset `stop_loss` is left out, so the keys of runs that
    never stop early do not depend on the field's existence."""
    spec = dataclasses.asdict(cfg)
    if spec["stop_loss"] is None:
        del spec["stop_loss"]
    return spec


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the base lr at a step: linear warm-up, then cosine decay to `min_lr_frac`."""
    warmup = max(1, round(cfg.warmup_frac * cfg.steps))

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, cfg.steps - warmup)
        return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


def train(model: torch.nn.Module, task: Task, cfg: TrainConfig, *, penalty: Callable | None = None,
          quiet: bool | None = None) -> list[float]:
    """Train `model` in place on batches from `task`; returns the loss of every step (fewer than `cfg.steps` when
    `cfg.stop_loss` is set and reached: training to convergence with `steps` as the cap).

    `penalty(model) -> scalar` is added to the loss (e.g. a sparsity prior); the recorded losses
    are the task loss alone. A penalty with a `prox(model, lr, step)` method also gets a proximal
    step after every optimizer step (for non-smooth priors that should reach exact zeros)."""
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    model.train()
    losses = []
    bar = progress(range(cfg.steps), quiet=quiet, desc="train", leave=True)
    for step in bar:
        batch = {k: v.to(device) for k, v in task.batch(cfg.batch_size, gen).items()}
        loss = model(**batch).loss
        (loss + penalty(model) if penalty is not None else loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        if hasattr(penalty, "prox"):
            penalty.prox(model, sched.get_last_lr()[0], step)
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 50 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if cfg.stop_loss is not None and len(losses) >= 25 and sum(losses[-25:]) / 25 < cfg.stop_loss:
            break
    model.eval()
    return losses


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_entry(model: torch.nn.Module, entry: Path) -> dict | None:
    """Load a cache entry into `model`; None if absent; a corrupt entry is logged and deleted."""
    from safetensors.torch import load_model

    if not entry.exists():
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        weights = entry / "model.safetensors"
        if _sha256(weights) != meta["sha256"]:
            raise ValueError("weights do not match their recorded sha256")
        load_model(model, str(weights))
        return meta
    except Exception as e:  # any failure means the entry cannot be trusted
        log.warning("cache entry %s is corrupt (%s); deleting it and training again", entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _store_entry(model: torch.nn.Module, entry: Path, meta: dict) -> None:
    """Write weights + meta into a temp folder beside `entry`, then rename: never a half entry."""
    from safetensors.torch import save_model

    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".tmp-"))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        meta = {**meta, "sha256": _sha256(tmp / "model.safetensors")}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(entry, ignore_errors=True)
        try:
            os.replace(tmp, entry)
        except OSError:  # another process (a parallel test or sweep) stored the same key meanwhile
            if not (entry / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fit(build: Callable[[], torch.nn.Module], task: Task, cfg: TrainConfig, *, device: str = "cpu",
        penalty: Callable | None = None, cache: bool = True, quiet: bool | None = None) -> TrainResult:
    """Build a model (seeded by `cfg.seed`) and train it on `task`, or load it from the cache.

    A `penalty` must be a dataclass (its fields join the cache key), called as `penalty(model)`."""
    torch.manual_seed(cfg.seed)
    model = build().to(device)
    key = cache_key(model, task, cfg, penalty)
    entry = cache_dir() / "models" / key
    meta = _load_entry(model, entry) if cache else None
    if meta is not None:
        log.info("loaded trained weights from cache %s", entry)
        model.eval()
        return TrainResult(model, meta["losses"], True, key, meta["seconds"], meta)
    t0 = time.perf_counter()
    losses = train(model, task, cfg, penalty=penalty, quiet=quiet)
    seconds = time.perf_counter() - t0
    meta = {"key": key, "losses": losses, "seconds": seconds, "task": task_spec(task),
            "train": dataclasses.asdict(cfg), "arch": type(model).__name__}
    if cache:
        _store_entry(model, entry, meta)
        log.info("trained in %.1f s; cached at %s", seconds, entry)
    return TrainResult(model, losses, False, key, seconds, meta)
