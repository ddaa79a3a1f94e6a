r"""TLM on a researcher's causal LM and target-domain inputs (notebook 03's `model=<folder or hub id>` path).

Test-time learning as the paper runs it (Hu et al., ICML 2025; official `Fhujinwu/TLM`, its offline setting):
the given model meets unlabeled target-domain inputs, each templated as one user turn (the tokenizer's chat
template when it has one, the raw text otherwise), and adapts LoRA weights (r = 8, α = 16 on W_q, W_v, Eq. 7) by
minimising the inputs' own perplexity, one epoch at batch 1 with AdamW, cosine schedule and 10 % warm-up.
The objective and the selection are `lab.adapt.tlm`'s, unchanged from the toy: per input the mean NLL CE of its
tokens (log P, Eq. 2); the Sample Efficient Learning score S = λ·exp(CE₀ − log P0)·1[CE₀ > log P0] (Eq. 6) from
the *base* model's CE₀ (adapters off), minimising S·CE as the official `compute_loss` (the paper's Eq. 5 reads
S·P), unselected inputs skipped (no backward). The baselines that make sense on text run in the same loop, each on
its own adapter of the same `PeftModel`: no adaptation (the adapters disabled), TLM without SEL (every input, weight
1, Table 4), Tent (the entropy of the model's own k-token greedy continuation, `lab.adapt.entropy_tta`; the
paper's Tent reads 80 tokens) and COME (Tent's loop with the entropy of opinion). EATA (it needs a Fisher on
in-distribution data) and online TLM are not run here.

The loop (`adapt`) is `lab.adapt.loop.adapt` run through `accelerate.Accelerator` (mixed precision, device placement
of the inputs, `accelerate launch` over several GPUs; with more than one process every input is back-propagated,
its weight 0 when unselected, as the official trainer does, so the processes stay in step).

Metrics on held-out target inputs (the last `held_out` rows; the paper's offline protocol answers the very inputs it
adapted on, which this path does not score): the input perplexity exp(mean_i CE_i) (Obs. 1's input PPL, as the toy);
given reference answers, the output perplexity exp(token-mean NLL of the answers given the templated input), the
greedy answers' exact match (final answers as `lab.data.answers` reads them — after "####", in \boxed{}, else the
last number — when the reference's is a number, as GSM8K-style EM) and word ROUGE-L F1 (the paper's R-Lsum family).
Forgetting (Fig. 2): the perplexity of `orig_data` text blocks before (adapters off) and after each arm.
Measurements only: nothing here is a claim.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from lab.adapt import tlm
from lab.adapt.entropy_tta import come_objective, tent_objective
from lab.adapt.loop import AdaptLog, Objective
from lab.align import hf_batch, hf_prefs
from lab.core import progress
from lab.core.params import ParamError
from lab.data.answers import answer_of, reference_answer

INPUTS = ("question", "problem", "instruction", "prompt", "text")  # the input column: the first of these present
ANSWERS = ("answer", "output", "response")  # the reference answer column, if any


@dataclass(frozen=True)
class Config:
    """The checkpoint path's knobs (paper values where it gives them)."""

    n_inputs: int = 64  # target inputs adapted on
    held_out: int = 16  # further target inputs scored
    lr: float = 5e-5  # AdamW (paper: 5e-5 DomainBench / InstructionBench, 1e-6 ReasoningBench)
    lora_r: int = 8
    lora_alpha: int = 16
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    log_p0: float = 3.0  # SEL's threshold in nats (paper: 3); ≤ 0: the base-CE quantile that selects `select_frac`
    select_frac: float = 0.9
    lamb: float = 0.1  # SEL's λ
    tent_tokens: int = 8  # Tent's and COME's continuation length k (paper: 80); 0 skips both
    max_len: int = 512  # tokens per templated input (its end kept, as `hf_batch.encode_prompt`)
    max_new_tokens: int = 64  # greedy answer length
    orig_blocks: int = 16  # forgetting: blocks of `orig_data`
    block_len: int = 128
    batch_size: int = 8  # evaluation batch
    mixed_precision: str = "no"
    seed: int = 0

    @classmethod
    def for_scale(cls, scale: str, device: str = "cpu", **knobs) -> Config:
        """Sizes of `scale` ("smoke": a quick look; "full": a real run, bf16 on CUDA); knobs given as None keep the
        scale's value."""
        full = dict(n_inputs=1000, held_out=200, max_len=2048, max_new_tokens=256, orig_blocks=64, block_len=512,
                    mixed_precision="bf16" if device == "cuda" else "no")
        return cls(**(full if scale == "full" else {}) | {k: v for k, v in knobs.items() if v is not None})


# ------------------------------------------------------------------ data

def target_rows(data: str, *, n: int, seed: int = 0) -> list[dict]:
    """`{input, answer}` rows (answer None without an answer column) from a .txt file, a cached `datasets` name or a
    table with one of `INPUTS` (alpaca rows: instruction + input) and optionally one of `ANSWERS`."""
    from lab.data import load
    from lab.data.text import load_texts

    if not data:
        raise ParamError("a checkpoint needs target-domain inputs: pass -p data <a .txt/.jsonl file or a "
                         "datasets name>.")
    try:
        ds = load.load_dataset(data)
    except load.DataNotAvailable:  # plain text (.txt) or unreadable: `load_texts` reads it or says why
        return [{"input": t, "answer": None} for t in load_texts(data, n=n, seed=seed)]
    col = next((c for c in INPUTS if c in ds.column_names), None)
    if col is None:
        raise ParamError(f"data={data!r} has none of the input columns {', '.join(INPUTS)} (it has "
                         f"{', '.join(ds.column_names)}).")
    ans = next((c for c in ANSWERS if c in ds.column_names), None)
    ds = ds.shuffle(seed=seed)
    rows = []
    for r in ds.select(range(min(n, len(ds)))):
        x = r[col] + (f"\n{r['input']}" if col == "instruction" and r.get("input") else "")
        rows.append({"input": x, "answer": r[ans] if ans else None})
    return rows


def encode(tokenizer, text: str, max_len: int) -> list[int]:
    """The input as one user turn (chat template when the tokenizer has one), its last `max_len` tokens."""
    prompt = [{"role": "user", "content": text}] if getattr(tokenizer, "chat_template", None) else text
    return hf_batch.encode_prompt(tokenizer, prompt, max_len)


def exact_match(pred: str, ref: str) -> bool:
    """A numeric reference answer (`lab.data.answers.reference_answer`: after GSM8K's "####" or in \\boxed{}) against
    the prediction's final answer (`answer_of`: after its "####", in its \\boxed{}, else its last number); otherwise
    the whitespace-normalised, lower-cased texts."""
    want = reference_answer(ref)
    if re.fullmatch(r"-?\d+(\.\d+)?", want):
        return answer_of(pred) == want
    norm = lambda s: " ".join(s.lower().split()).strip(" .")
    return norm(pred) == norm(ref)


# ------------------------------------------------------------------ the loop, through accelerate

def _device(model) -> torch.device:
    return next(model.parameters()).device


def _first(batch: list[Tensor]) -> Tensor:
    return batch[0]


def lr_scale(step: int, total: int, warmup_frac: float = 0.1, schedule: str = "cosine") -> float:
    """`lab.adapt.loop.adapt`'s schedule: linear warm-up over `warmup_frac` of the steps, then cosine to 0."""
    warm = max(1, round(warmup_frac * total))
    if schedule == "constant":
        return 1.0
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, total - warm)))


def adapt(model, inputs: list[Tensor], objective: Objective, *, lr: float, mixed_precision: str = "no",
          grad_clip: float = 1.0, skip_unselected: bool = True, quiet: bool | None = None,
          desc: str = "adapt") -> AdaptLog:
    """`lab.adapt.loop.adapt` (one pass, batch 1, AdamW, per-input schedule, unselected inputs skipped) with
    `accelerate`: the inputs ((1, T) each) come through a prepared DataLoader, so `accelerate launch` shards them."""
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    acc = Accelerator(mixed_precision=mixed_precision, cpu=_device(model).type == "cpu")
    skip = skip_unselected and acc.num_processes == 1
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    loader = DataLoader(inputs, batch_size=1, shuffle=False, collate_fn=_first)
    policy, opt, loader = acc.prepare(model, opt, loader)
    log, total = AdaptLog(), len(loader)
    model.train()
    for step, x in enumerate(progress(loader, quiet=quiet, desc=desc)):
        for group in opt.param_groups:  # the schedule advances per input, selected or not (as the repo's)
            group["lr"] = lr * lr_scale(step, total)
        loss, selected = objective(policy, x)
        log.selected.append(bool(selected))
        if selected or not skip:
            acc.backward(loss)
            log.backward_passes += 1
            acc.clip_grad_norm_(params, grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            log.losses.append(loss.item())
        else:
            log.losses.append(None)
    acc.unwrap_model(policy, keep_fp32_wrapper=False)  # mixed precision's autocast forward removed: the arms are
    model.eval()  # scored at the precision the base was
    return log


# ------------------------------------------------------------------ evaluation

@contextlib.contextmanager
def active(model, adapter: str | None):
    """The model with arm `adapter` active; None: every adapter disabled (the base model)."""
    if adapter is None:
        with model.disable_adapter() if hasattr(model, "disable_adapter") else contextlib.nullcontext():
            yield model
    else:
        model.set_adapter(adapter)
        yield model


def _pad(seqs: list[list[int]], pad: int, device, *, left: bool = False) -> tuple[Tensor, Tensor]:
    T = max(map(len, seqs))
    fill = lambda s, v: [v] * (T - len(s)) + s if left else s + [v] * (T - len(s))
    return (torch.tensor([fill(s, pad) for s in seqs], device=device),
            torch.tensor([fill([1] * len(s), 0) for s in seqs], device=device))


@torch.no_grad()
def input_ce(model, ids: list[list[int]], *, pad: int = 0, batch_size: int = 8) -> Tensor:
    """Per-input mean NLL of its own tokens (`tlm.sample_ce`, right-padded batches): (N,)."""
    dev = _device(model)
    return torch.cat([tlm.sample_ce(model, *_pad(ids[i:i + batch_size], pad, dev)).float().cpu()
                      for i in range(0, len(ids), batch_size)])


@torch.no_grad()
def answer_nll(model, ids: list[list[int]], answers: list[list[int]], *, pad: int = 0,
               batch_size: int = 8) -> tuple[float, int]:
    """(Σ NLL of the answer tokens given their input, number of answer tokens) over the rows."""
    from lab.align.train import sequence_logprobs

    nll, count, dev = 0.0, 0, _device(model)
    for i in range(0, len(ids), batch_size):
        batch = hf_batch.pad_batch([[(p, a)] for p, a in zip(ids[i:i + batch_size], answers[i:i + batch_size])], pad)
        nll -= sequence_logprobs(model, {k: v.to(dev) for k, v in batch.items()}).sum().item()
        count += int(batch["response_mask"].sum())
    return nll, count


@torch.no_grad()
def greedy(model, tokenizer, ids: list[list[int]], *, max_new_tokens: int, batch_size: int = 8) -> list[str]:
    """Greedy answers (left-padded `generate`, cut at EOS), decoded."""
    pad, out = hf_batch.pad_id(tokenizer), []
    for i in range(0, len(ids), batch_size):
        x, mask = _pad(ids[i:i + batch_size], pad, _device(model), left=True)
        y = model.generate(input_ids=x, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                           pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        out += tokenizer.batch_decode(y[:, x.shape[1]:], skip_special_tokens=True)
    return out


def scores(model, tokenizer, held: list[dict], cfg: Config, orig: Tensor | None = None) -> dict[str, float]:
    """The paper's metrics of the active model on held-out rows (module docstring) and the `orig` blocks' PPL."""
    from lab.data.domains import rouge_l

    pad, bs = hf_batch.pad_id(tokenizer), cfg.batch_size
    ids = [encode(tokenizer, r["input"], cfg.max_len) for r in held]
    out = {"input PPL": input_ce(model, ids, pad=pad, batch_size=bs).mean().exp().item()}
    if held and held[0]["answer"] is not None:
        answers = [hf_batch.encode_response(tokenizer, r["answer"])[:cfg.max_new_tokens] for r in held]
        nll, count = answer_nll(model, ids, answers, pad=pad, batch_size=bs)
        preds = greedy(model, tokenizer, ids, max_new_tokens=cfg.max_new_tokens, batch_size=bs)
        out |= {"output PPL": math.exp(nll / count),
                "exact match": sum(exact_match(p, r["answer"]) for p, r in zip(preds, held)) / len(held),
                "ROUGE-L": sum(rouge_l(p.split(), r["answer"].split()) for p, r in zip(preds, held)) / len(held)}
    if orig is not None:
        out["orig PPL"] = input_ce(model, orig.tolist(), batch_size=bs).mean().exp().item()  # equal-length blocks
    return out


# ------------------------------------------------------------------ the study

ARMS = ("TLM", "TLM w/o SEL", "Tent", "COME")


def objective(model, name: str, cfg: Config, threshold: float) -> Objective:
    """Arm `name`'s objective on `model` (the `PeftModel` whose disabled adapters give TLM's base CE)."""
    if name == "TLM":
        return tlm.tlm_objective(threshold=threshold, lamb=cfg.lamb, base_ce=tlm.base_ce(model))
    if name == "TLM w/o SEL":
        return tlm.tlm_objective(sel=False)
    return tent_objective(cfg.tent_tokens) if name == "Tent" else come_objective(cfg.tent_tokens)


def orig_blocks(orig_data: str, tokenizer, cfg: Config) -> Tensor | None:
    """Token blocks of the forgetting text (`lab.data.text`), None without one."""
    from lab.data.text import load_texts, token_blocks

    return token_blocks(load_texts(orig_data, seed=cfg.seed), tokenizer, cfg.orig_blocks, cfg.block_len) \
        if orig_data else None


def study(model, tokenizer, rows: list[dict], cfg: Config, *, orig: Tensor | None = None,
          quiet: bool | None = None) -> tuple:
    """Adapt one LoRA arm per method (`ARMS`, a named adapter each on one `PeftModel`) on the first rows and score the
    base model (adapters off) and every arm on the held-out rows; returns (the `PeftModel`, the measurements)."""
    if len(rows) <= cfg.held_out:
        raise ParamError(f"data gives {len(rows)} target inputs; TLM needs more than held_out = {cfg.held_out} "
                         "(some to adapt on, the rest held out).")
    if tokenizer is None:
        raise ParamError("the model folder has no tokenizer; save one beside the weights (tokenizer.save_pretrained).")
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    if not set(cfg.targets) <= leaves:
        raise ParamError(f"the model has no {'/'.join(sorted(set(cfg.targets) - leaves))} layers, the paper's LoRA "
                         "targets (W_q, W_v of a Llama-style attention).")
    train, held = rows[:-cfg.held_out], rows[-cfg.held_out:]
    dev, pad = _device(model), hf_batch.pad_id(tokenizer)
    ids = [encode(tokenizer, r["input"], cfg.max_len) for r in train]
    ce0 = input_ce(model, ids, pad=pad, batch_size=cfg.batch_size)
    threshold = cfg.log_p0 if cfg.log_p0 > 0 else torch.quantile(ce0, 1 - cfg.select_frac).item()
    results = {"base": scores(model, tokenizer, held, cfg, orig)}
    lora = hf_prefs.Config(lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=list(cfg.targets),
                           seed=cfg.seed)
    inputs = [torch.tensor([x]) for x in ids]
    for name in ARMS if cfg.tent_tokens else ARMS[:2]:
        model = hf_prefs.add_adapter(model, lora, name)
        log = adapt(model, [x.to(dev) for x in inputs], objective(model, name, cfg, threshold), lr=cfg.lr,
                    mixed_precision=cfg.mixed_precision, quiet=quiet, desc=name)
        with active(model, name):
            results[name] = scores(model, tokenizer, held, cfg, orig) | {"backward passes": log.backward_passes}
    inputs_seen = {"adapted": len(train), "held out": len(held), "with answers": held[0]["answer"] is not None}
    return model, {"inputs": inputs_seen, "log P0": threshold,
                   "selected by the base model": float((ce0 > threshold).float().mean()),
                   "base CE of the adapted inputs": {"mean": ce0.mean().item(), "min": ce0.min().item(),
                                                     "max": ce0.max().item()},
                   "arms": results}
