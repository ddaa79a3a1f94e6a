r"""Preference training of a `transformers` causal LM on text pairs: the checkpoint path of the preference papers.

Rows come from `lab.data.load` (`{prompt, chosen, rejected}` or `{prompt, responses, rewards}`, ranked best first).
`lab.align.hf_batch.tokenize` turns them into the padded batch `lab.align.train.preference_loss` reads, as TRL's DPO
trainer builds it (the prompt's end and the response's start kept):

    input_ids, attention_mask, response_mask: (B, n, T)   rewards: (B, n) (plain pairs: (1, 0))

The policy is the checkpoint with a LoRA adapter (`peft`); π_ref is **the same model with its adapters
disabled** (`DisabledAdapter`), so a large model is held once. Each arm is a named adapter on that one
`PeftModel`, so a notebook trains EXPO, DPO, IPO, HPS... side by side and switches between them by name. The loop
runs through `accelerate.Accelerator` (gradient accumulation, mixed precision): one process on a laptop or in
CI, `accelerate launch` over several GPUs. Any loss of `lab.align.LOSSES` trains; EXPO gets its KL term as
`preference_loss` gives it (the token KL summed along the chosen responses), TDPO the same sum along each response,
HPS its rewards from the rows.

Evaluation on held-out rows (`evaluate`), for the reference and each arm:
- the implicit reward margin β·[(log π_θ − log π_ref)(y_w) − (log π_θ − log π_ref)(y_l)] and the share of rows where
  it is positive (ranked rows: y_w against each lower-ranked response);
- the policy's own preference accuracy, log π_θ(y_w) > log π_θ(y_l);
- KL(π_ref ‖ π_θ) estimated as `lab.align.expo.reference_kl` does on the toy: the token KL summed along responses
  *sampled from π_ref* (`generate`, pure ancestral sampling), unbiased by the chain rule;
- given a reward model (a sequence-classification folder), the win rate of policy samples against reference
  samples for the same prompts (ties count one half).
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from lab.align.hf_batch import encode_prompt, pad_batch, pad_id, render_prompt, tokenize
from lab.align.train import chosen_token_kl, preference_loss, sequence_logprobs
from lab.core import progress


@dataclass(frozen=True)
class Config:
    """One training arm: its loss and options, LoRA, and the loop's sizes."""

    loss: str = "dpo"  # a `lab.align.LOSSES` name
    beta: float = 0.1  # β of the DPO family and HPS
    lam: float = 1.0  # EXPO's λ, the weight of its KL(π_ref‖π_θ) term
    gamma: float = 5.0  # HPS's hardness γ (ranked rows; plain pairs have one negative)
    label_smoothing: float = 0.0  # ε of DPO / HPS (the HPS release trains ε = 0.1)
    steps: int = 50  # optimizer steps
    lr: float = 5e-4  # AdamW learning rate of the adapter
    batch_size: int = 4  # rows per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    grad_clip: float = 1.0
    lora_r: int = 8  # LoRA rank r
    lora_alpha: int = 16  # LoRA scale α (the update is α/r · BA)
    target_modules: str = "all-linear"  # peft's shorthand: every linear layer but the output head
    max_len: int = 256  # tokens per prompt + response
    max_prompt_len: int = 0  # prompt tokens kept (its end); 0: half of max_len
    mixed_precision: str = "no"  # accelerate's "no" | "fp16" | "bf16"
    n_samples: int = 4  # evaluation: responses sampled from π_ref per prompt for the KL (and the win rate's prompts)
    max_new_tokens: int = 64  # evaluation: length limit of sampled responses
    seed: int = 0

    @classmethod
    def for_scale(cls, scale: str, device: str = "cpu", **knobs) -> Config:
        """The sizes of `scale` ("smoke": a quick look; "full": a real run, bf16 on CUDA); `knobs` given as None
        keep the scale's value."""
        full = dict(steps=300, batch_size=8, grad_accum=4, max_len=512, n_samples=8, max_new_tokens=256,
                    mixed_precision="bf16" if device == "cuda" else "no")
        return cls(**(full if scale == "full" else {}) | {k: v for k, v in knobs.items() if v is not None})

    @property
    def prompt_len(self) -> int:
        return self.max_prompt_len or self.max_len // 2

    def options(self, device) -> dict:
        """The keyword options of `self.loss` (HPS's negative sampler seeded on `device`)."""
        if self.loss == "expo":
            return {"lam": self.lam}
        if self.loss in ("dpo", "hps") and self.label_smoothing:
            out = {"beta": self.beta, "label_smoothing": self.label_smoothing}
        else:
            out = {"beta": self.beta}
        if self.loss == "hps":
            out |= {"gamma": self.gamma, "generator": torch.Generator(device=device).manual_seed(self.seed)}
        return out


# ------------------------------------------------------------------ rows

def preference_rows(data: str, *, n: int, seed: int = 0, ranked: bool = False, policy=None, tokenizer=None,
                    reward_model=None, rm_tokenizer=None, N: int = 8, max_new_tokens: int = 64) -> list[dict]:
    """Rows of `data` for the checkpoint paths: ranked responses `{prompt, responses, rewards}` (best first) when it
    has them, pairs `{prompt, chosen, rejected}` when it has those (unless `ranked`), else an on-policy pool: N
    responses per prompt sampled from `policy` at temperature 1 and scored by `reward_model` (which must then be
    given), ranked best first (a stable sort: equal rewards keep the sampling order) — the paper's own data of HPS and
    RIP (K samples of the policy scored by a reward model)."""
    from lab.align import infalign_checkpoint as ic
    from lab.core.params import ParamError
    from lab.data import load
    from lab.data.text import load_texts

    cols = set(load.load_dataset(data).column_names)
    if {"responses", "rewards"} <= cols:
        return load.ranked_responses(data, n=n, seed=seed)
    if not ranked and {"chosen", "rejected"} <= cols:
        return load.preference_pairs(data, n=n, seed=seed)
    if reward_model is None:
        want = "'responses'/'rewards'" + ("" if ranked else " or 'chosen'/'rejected'")
        raise ParamError(f"data={data!r} has no {want} columns (it has {', '.join(sorted(cols))}); pass -p "
                         "reward_model <folder or hub id> to sample and score responses to its prompts.")
    prompts = load_texts(data, column="prompt", n=n, seed=seed)
    responses = ic.sample(policy, tokenizer, prompts, N, max_new_tokens=max_new_tokens, seed=seed)
    rewards = ic.score(reward_model, rm_tokenizer, prompts, responses)
    rows = []
    for p, rs, r in zip(prompts, responses, rewards.tolist()):
        order = sorted(range(len(rs)), key=lambda i: -r[i])
        rows.append({"prompt": p, "responses": [rs[i] for i in order], "rewards": [r[i] for i in order]})
    return rows


def max_min_pairs(rows: list[dict]) -> list[dict]:
    """Ranked rows as (best, lowest-reward) pairs, RLHFlow's default for DPO; pairs are returned unchanged."""
    return [r if "chosen" in r else {"prompt": r["prompt"], "chosen": r["responses"][0], "rejected": r["responses"][-1]}
            for r in rows]


# ------------------------------------------------------------------ the reference and the adapters

class DisabledAdapter:
    """π_ref: calls the model with every LoRA adapter switched off (a model without adapters: itself)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **kw):
        off = self.model.disable_adapter() if hasattr(self.model, "disable_adapter") else contextlib.nullcontext()
        with off:
            return self.model(**kw)


def add_adapter(model, cfg: Config, name: str):
    """`model` with a fresh LoRA adapter `name`, active and alone trainable (a `PeftModel` gets one more)."""
    from peft import LoraConfig, PeftModel, get_peft_model

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=cfg.target_modules,
                      task_type="CAUSAL_LM")
    torch.manual_seed(cfg.seed)  # LoRA's A init; B = 0, so the arm starts at π_ref
    if isinstance(model, PeftModel):
        model.add_adapter(name, lora)
    else:
        model = get_peft_model(model, lora, adapter_name=name)
    use(model, name)
    for key, p in model.named_parameters():
        p.requires_grad_("lora_" in key and f".{name}." in key)
    return model


def use(model, adapter: str | None):
    """Activate arm `adapter` of a `PeftModel`; None: the reference (returns the callable to score with)."""
    if adapter is None:
        return DisabledAdapter(model)
    model.set_adapter(adapter)
    return model


# ------------------------------------------------------------------ training

def fit_adapter(model, data: list, cfg: Config, name: str, collate, loss_of, *, quiet: bool | None = None) -> tuple:
    """A new LoRA adapter `name` trained `cfg.steps` optimizer steps on `data` (batched by `collate`) by
    `loss_of(policy, model, batch)` — `policy` the prepared module, `model` the PeftModel (for its reference) —
    through `accelerate` (gradient accumulation, mixed precision, gradient clipping); returns (the PeftModel, the
    per-micro-batch losses). The one loop under the preference arms here and cDPO's adapters."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    model = add_adapter(model, cfg, name)
    params = [p for p in model.parameters() if p.requires_grad]
    acc = Accelerator(gradient_accumulation_steps=cfg.grad_accum, mixed_precision=cfg.mixed_precision)
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, drop_last=len(data) >= cfg.batch_size,
                        generator=torch.Generator().manual_seed(cfg.seed), collate_fn=collate)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    policy, opt, loader = acc.prepare(model, opt, loader)
    batches, losses = itertools.chain.from_iterable(itertools.repeat(loader)), []
    model.train()
    for _ in progress(range(cfg.steps * cfg.grad_accum), quiet=quiet, desc=name):
        with acc.accumulate(policy):
            loss = loss_of(policy, model, next(batches))
            acc.backward(loss)
            if acc.sync_gradients:
                acc.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    return acc.unwrap_model(policy, keep_fp32_wrapper=False), losses  # scored without autocast, as the base


def train(model, tokenizer, rows: list[dict], cfg: Config, *, name: str | None = None,
          quiet: bool | None = None) -> tuple:
    """Train a new LoRA arm `name` (default the loss's name) on `rows`; returns (the PeftModel, per-step losses)."""
    options = None

    def loss_of(policy, peft_model, batch):
        nonlocal options
        if options is None:  # once per arm, on the batches' device (HPS's sampler is seeded there)
            options = cfg.options(batch["input_ids"].device)
        return preference_loss(policy, DisabledAdapter(peft_model), batch, cfg.loss, **options)

    collate = partial(tokenize, tokenizer, max_len=cfg.max_len, max_prompt_len=cfg.prompt_len)
    return fit_adapter(model, rows, cfg, name or cfg.loss, collate, loss_of, quiet=quiet)


# ------------------------------------------------------------------ evaluation

def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def row_logprobs(model, tokenizer, rows: list[dict], adapter: str | None, *, batch_size: int = 8,
                 max_len: int = 256, max_prompt_len: int = 128) -> Tensor:
    """log π(y_k | x) of every response of every row under arm `adapter` (None: π_ref): (N, n)."""
    scorer, out = use(model, adapter), []
    for i in range(0, len(rows), batch_size):
        batch = tokenize(tokenizer, rows[i:i + batch_size], max_len=max_len, max_prompt_len=max_prompt_len)
        out.append(sequence_logprobs(scorer, {k: v.to(_device(model)) for k, v in batch.items()}).float().cpu())
    return torch.cat(out)


@torch.no_grad()
def sample(model, tokenizer, prompts: list, adapter: str | None, *, n: int = 1, max_new_tokens: int = 64,
           max_prompt_len: int = 128, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """`n` responses per prompt from arm `adapter` (None: π_ref) by `generate` with pure ancestral sampling
    (temperature 1, no top-k / top-p): (prompt ids, response ids up to and with EOS) per sample."""
    enc = [encode_prompt(tokenizer, p, max_prompt_len) for p in prompts for _ in range(n)]
    P, pad = max(map(len, enc)), pad_id(tokenizer)
    ids = torch.tensor([[pad] * (P - len(e)) + e for e in enc], device=_device(model))  # left-padded (N, P)
    mask = torch.tensor([[0] * (P - len(e)) + [1] * len(e) for e in enc], device=_device(model))
    torch.manual_seed(seed)
    off = model.disable_adapter() if adapter is None and hasattr(model, "disable_adapter") else contextlib.nullcontext()
    with off:
        out = (model if adapter is None else use(model, adapter)).generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    samples = []
    for e, y in zip(enc, out[:, P:].tolist()):
        end = y.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in y else len(y)
        samples.append((e, y[:end]))
    return samples


@torch.no_grad()
def sampled_kl(model, samples: list[tuple[list[int], list[int]]], adapter: str, *, pad: int = 0,
               batch_size: int = 8) -> Tensor:
    """Σ_t KL(π_ref(·|x, y_<t) ‖ π_θ(·|x, y_<t)) along each sample y ~ π_ref (N,); its mean estimates
    KL(π_ref ‖ π_θ) without bias (chain rule), as `lab.align.expo.reference_kl` does on the toy."""
    out = []
    for i in range(0, len(samples), batch_size):
        batch = {k: v.to(_device(model)) for k, v in pad_batch([[s] for s in samples[i:i + batch_size]], pad).items()}
        _, ref = sequence_logprobs(use(model, None), batch, with_dists=True)
        _, pol = sequence_logprobs(use(model, adapter), batch, with_dists=True)
        out.append(chosen_token_kl(ref, pol, batch).cpu())
    return torch.cat(out)


@torch.no_grad()
def reward_scores(reward_model, rm_tokenizer, texts: list[str], *, batch_size: int = 8) -> Tensor:
    """The reward model's scalar score (logit 0) of each text: (N,)."""
    out = []
    for i in range(0, len(texts), batch_size):
        enc = rm_tokenizer(texts[i:i + batch_size], return_tensors="pt", padding=True, truncation=True)
        out.append(reward_model(**enc.to(_device(reward_model))).logits[:, 0].float().cpu())
    return torch.cat(out)


def win_rate(model, tokenizer, prompts: list, adapter: str, reward_model, rm_tokenizer, **sample_kw) -> float:
    """Share of prompts whose policy sample the reward model scores above the reference's (ties: 1/2)."""
    texts = {}
    for arm in (adapter, None):
        texts[arm] = [render_prompt(tokenizer, p) + tokenizer.decode(y, skip_special_tokens=True)
                      for p, (_, y) in zip(prompts, sample(model, tokenizer, prompts, arm, **sample_kw))]
    r_pol, r_ref = (reward_scores(reward_model, rm_tokenizer, texts[arm]) for arm in (adapter, None))
    return ((r_pol > r_ref).float() + 0.5 * (r_pol == r_ref).float()).mean().item()


def evaluate(model, tokenizer, rows: list[dict], arms: list[str], cfg: Config, *, reward_model=None,
             rm_tokenizer=None) -> dict[str, dict[str, float]]:
    """Per arm (and "reference"): mean margin (at `cfg.beta`), margin accuracy, log-prob accuracy, KL(π_ref‖π_θ)
    (mean and standard error over the samples), and the reward model's win rate against the reference if given."""
    sizes = {"max_len": cfg.max_len, "max_prompt_len": cfg.prompt_len}
    gen = {"max_new_tokens": cfg.max_new_tokens, "max_prompt_len": cfg.prompt_len}
    ref = row_logprobs(model, tokenizer, rows, None, **sizes)  # (N, n)
    prompts = [r["prompt"] for r in rows]
    samples = sample(model, tokenizer, prompts, None, n=cfg.n_samples, seed=cfg.seed, **gen)
    out = {}
    for arm in [None, *arms]:
        pi = ref if arm is None else row_logprobs(model, tokenizer, rows, arm, **sizes)
        h = pi - ref  # implicit reward log π_θ − log π_ref: (N, n)
        margin = cfg.beta * (h[:, :1] - h[:, 1:])  # best against each lower-ranked response
        kl = torch.zeros(len(samples)) if arm is None else sampled_kl(model, samples, arm, pad=pad_id(tokenizer))
        m = {"margin": margin.mean().item(), "margin accuracy": (margin > 0).float().mean().item(),
             "logp accuracy": (pi[:, :1] > pi[:, 1:]).float().mean().item(), "KL(π_ref‖π_θ)": kl.mean().item(),
             "KL s.e.": (kl.std() / len(kl) ** 0.5).item() if len(kl) > 1 else 0.0}
        if reward_model is not None:
            m["win rate vs reference"] = 0.5 if arm is None else win_rate(
                model, tokenizer, prompts, arm, reward_model, rm_tokenizer, seed=cfg.seed + 1, **gen)
        out["reference" if arm is None else arm] = m
    return out
