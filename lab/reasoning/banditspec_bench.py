"""BanditSpec on tiny LMs: the toy notebook 16 measures (Part B, a Table 1 analog) and `python -m lab bench
banditspec`.

`EditGenerate` is the mixed prompt set: "edit" prompts ask for the source span again with a fixed substitution
(input-grounded: prompt lookup and an edit-trained drafter win), "generate" prompts start a walk along a long
fixed cycle of tokens that never appears in the prompt (a generate-trained drafter wins; a suffix tree, once it
has seen an earlier generate answer). `toy` trains (or loads from the cache) the target and the two drafters; `mix`
decodes every prompt with each fixed arm, UCBSpec and
EXP3Spec, checks the greedy output against `generate`, and returns rounds (target calls) and MAT per prompt.
`bench` adds `transformers`' assisted generation (`assistant_model=`) and prompt lookup
(`prompt_lookup_num_tokens=`) on the same target, drafters and prompts, as ratios to plain `generate`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial

import numpy as np
import torch

from lab.core import bench as bench_registry
from lab.core.params import Params
from lab.models.spec import TinyLM
from lab.reasoning.banditspec import Config
from lab.reasoning.banditspec_decode import Arm, LMDrafter, PromptLookup, SuffixTree, bandit_generate

PAD, BOS, EOS, EDIT, GEN, SEP = range(6)
TARGET = TinyLM("llama", d_model=64, n_layers=2, n_heads=4, d_ff=128, max_len=256, steps=500, batch_size=32, lr=3e-3)
DRAFT = TinyLM("llama", d_model=32, n_layers=1, n_heads=2, d_ff=64, max_len=256, steps=300, batch_size=32, lr=3e-3)


@dataclass(frozen=True)
class EditGenerate:
    """Two domains of prompts. edit: [EDIT] s_1..s_n [SEP], then sub(s) repeated (sub maps `n_sub` source tokens
    to tokens never in a source, and is idempotent, so each token is sub of the token n+1 back); generate:
    [GEN] c_0..c_{m−1} [SEP], then c_m, c_{m+1}, ... along one fixed random cycle of `n_cycle` tokens."""

    n_src: int = 24
    n_edit: int = 40  # source alphabet
    n_sub: int = 10  # of which these are substituted
    n_cycle: int = 128
    m: int = 6  # cycle tokens shown in a generate prompt
    length: int = 96  # training sequence length
    domains: str = "both"  # "both" | "edit" | "generate": the training mix (drafters see one domain)
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        return 6 + self.n_edit + self.n_sub + self.n_cycle

    @cached_property
    def order(self) -> torch.Tensor:
        """The cycle: order[k+1] follows order[k] (mod n_cycle), through all n_cycle generate tokens."""
        g = torch.Generator().manual_seed(self.seed)
        return 6 + self.n_edit + self.n_sub + torch.randperm(self.n_cycle, generator=g)

    def sub(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where((x >= 6) & (x < 6 + self.n_sub), x + self.n_edit, x)

    def sequences(self, n: int, kind: str, generator: torch.Generator, length: int) -> tuple[torch.Tensor, int]:
        """(n, length) token rows — prompt then the task's answer — and the prompt length."""
        if kind == "edit":
            s = 6 + torch.randint(self.n_edit, (n, self.n_src), generator=generator)  # (n, n_src)
            sep, edit = torch.full((n, 1), SEP), torch.full((n, 1), EDIT)
            period = torch.cat([self.sub(s), sep], 1)  # the answer repeats sub(s) SEP
            reps = -(-length // (self.n_src + 1))
            rows = torch.cat([edit, s, sep, period.repeat(1, reps)], 1)
            return rows[:, :length], self.n_src + 2
        k0 = torch.randint(self.n_cycle, (n, 1), generator=generator)
        walk = self.order[(k0 + torch.arange(length)) % self.n_cycle]  # (n, length) along the cycle
        rows = torch.cat([torch.full((n, 1), GEN), walk[:, :self.m], torch.full((n, 1), SEP), walk[:, self.m:]], 1)
        return rows[:, :length], self.m + 2

    def prompts(self, n: int, kind: str, generator: torch.Generator) -> list[list[int]]:
        rows, p = self.sequences(n, kind, generator, self.length)
        return rows[:, :p].tolist()

    def continuation(self, prompt: list[int], n: int) -> list[int]:
        """The task's own answer (what a perfect target writes) for n new tokens."""
        seq = list(prompt)
        for _ in range(n):
            if prompt[0] == EDIT:
                seq.append(int(self.sub(torch.tensor(seq[-(self.n_src + 1)]))))
            else:
                pos = int((self.order == (seq[-2] if seq[-1] == SEP else seq[-1])).nonzero())
                seq.append(int(self.order[(pos + 1) % self.n_cycle]))
        return seq[len(prompt):]

    def batch(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """`input_ids` (n, length) of the training mix, `labels` with −100 on the prompt."""
        kinds = {"both": ("edit", "generate"), "edit": ("edit",), "generate": ("generate",)}[self.domains]
        n_e = int((torch.rand(n, generator=generator) < 1 / len(kinds)).sum()) if len(kinds) == 2 else n
        parts = [self.sequences(m, k, generator, self.length) for k, m in zip(kinds, (n_e, n - n_e)) if m]
        ids = torch.cat([r for r, _ in parts])
        labels = torch.cat([torch.where(torch.arange(self.length) < p, -100, r) for r, p in parts])
        return {"input_ids": ids, "labels": labels}


# ------------------------------------------------------------------------------------------ the toy

def toy(cfg: Config, seed: int = 0, device: str = "cpu", quiet: bool | None = None) -> dict:
    """The task, the trained target (both domains) and drafters draft-E (edit only) and draft-G (generate only)."""
    task = EditGenerate(seed=seed)
    V = task.vocab_size
    tgt = TinyLM(**{**TARGET.__dict__, "steps": cfg.target_steps})
    dft = TinyLM(**{**DRAFT.__dict__, "steps": cfg.draft_steps})
    runs = {"target": tgt.fit(task, V, seed=seed, device=device, quiet=quiet),
            "draft-E": dft.fit(EditGenerate(seed=seed, domains="edit"), V, seed=seed, device=device, quiet=quiet),
            "draft-G": dft.fit(EditGenerate(seed=seed, domains="generate"), V, seed=seed, device=device, quiet=quiet)}
    for r in runs.values():
        r.model.generation_config.eos_token_id = None  # the toy has no end of text; generate runs max_new_tokens
        r.model.generation_config.pad_token_id = PAD
    return {"task": task, "runs": runs, **{k: r.model.eval() for k, r in runs.items()}}


def arms_of(models: dict, L: int, vocab_size: int) -> list[Arm]:
    """K = 4 arms at speculation length L: prompt lookup (n-gram ≤ 3), draft-E, draft-G and a suffix tree (the
    paper's Table 1 arms are PLD, Suffix Tree and EAGLE-2; the two small LMs stand in for the trained drafter).
    Build them afresh for each policy run: the suffix tree remembers the outputs of the prompts before."""
    return [Arm("PLD", PromptLookup(3, vocab_size), L), Arm("draft-E", LMDrafter(models["draft-E"]), L),
            Arm("draft-G", LMDrafter(models["draft-G"]), L), Arm("suffix", SuffixTree(vocab_size=vocab_size), L)]


def mix_prompts(task: EditGenerate, n: int, seed: int = 0) -> tuple[list[list[int]], list[str]]:
    """n prompts, half edit and half generate, interleaved."""
    g = torch.Generator().manual_seed(3000 + seed)
    e, gg = task.prompts(n // 2, "edit", g), task.prompts(n - n // 2, "generate", g)
    ps, kinds = [], []
    for a, b in zip(e, gg):
        ps += [a, b]
        kinds += ["edit", "generate"]
    return ps, kinds


@torch.inference_mode()
def plain(model, prompt: list[int], n: int, **kw) -> list[int]:
    """Plain `generate` (greedy unless kw say otherwise): the new tokens."""
    x = torch.tensor([prompt], device=model.device)
    return model.generate(x, max_new_tokens=n, do_sample=False, **kw)[0, len(prompt):].tolist()


def mix(models: dict, prompts: list[list[int]], cfg: Config, seed: int = 0,
        policies: tuple[str, ...] | None = None, cr_scale: float | None = None, arms: Callable = arms_of) -> dict:
    """Greedy decoding of every prompt under each policy (default: every fixed arm, UCBSpec, EXP3Spec), the prompts
    in order with fresh arms per policy (`arms(models, L, V)`, default `arms_of`): {policy: [Trace per prompt]}, plus
    "identical": per policy, the share of prompts whose output equals plain greedy `generate`."""
    V = models["target"].config.vocab_size
    names = [a.name for a in arms(models, cfg.L_b, V)]
    policies = policies or tuple(f"fixed {i}" for i in range(len(names))) + ("UCBSpec", "EXP3Spec")
    ref = [plain(models["target"], p, cfg.gen_len) for p in prompts]
    out: dict = {"arms": names, "reference": ref}
    for pol in policies:
        fresh = arms(models, cfg.L_b, V)
        out[pol] = [bandit_generate(models["target"], fresh, p, cfg.gen_len, policy=pol, seed=seed * 1000 + j,
                                    cr_scale=cfg.cr_scale_b if cr_scale is None else cr_scale, delta=cfg.delta,
                                    radius=cfg.radius, bandit=cfg.bandit) for j, p in enumerate(prompts)]
    out["identical"] = {pol: float(np.mean([t.tokens == r for t, r in zip(out[pol], ref)])) for pol in policies}
    return out


def summary(res: dict, kinds: list[str], after: int = 20, near: float = 1.25) -> dict:
    """Total rounds per policy, the per-prompt oracle (best fixed arm per prompt), the best fixed arm, MAT, and
    the share of bandit pulls after round `after` on a near-best arm for the prompt: one whose fixed-arm run of that
    prompt took ≤ `near` × the best fixed arm's rounds (`kinds` names each prompt's domain for the record)."""
    fixed = [k for k in res if k.startswith("fixed")]
    rounds = {k: np.array([t.rounds for t in v]) for k, v in res.items()
              if isinstance(v, list) and k not in ("reference", "arms")}
    out = {"rounds": {k: int(v.sum()) for k, v in rounds.items()},
           "mat": {k: float(np.mean([t.mat for t in res[k]])) for k in rounds}}
    if fixed:
        out["oracle"] = int(np.min([rounds[k] for k in fixed], axis=0).sum())
        out["best fixed"] = min(fixed, key=lambda k: out["rounds"][k])
    if fixed:
        arm = [int(k.split()[1]) for k in fixed]
        per = np.array([rounds[k] for k in fixed])  # (fixed arms, prompts)
        good = [{arm[r] for r in np.flatnonzero(col <= near * col.min())} for col in per.T]
        out["near-best arms"] = {f"{kind} {j}": sorted(g) for j, (kind, g) in enumerate(zip(kinds, good))}
        for k in ("UCBSpec", "EXP3Spec"):
            if k in res:
                hits = [a in g for t, g in zip(res[k], good) for a in t.arms[after:]]
                out[f"near-best share {k}"] = float(np.mean(hits)) if hits else float("nan")
    return out


def rounds_table(res: dict, kinds: list[str], cfg: Config, theory: dict | None = None):
    """Part B's table (a DataFrame): rounds (target calls), MAT and "= greedy generate" per policy, the fixed arms by
    name, the per-prompt oracle, plain decoding and, given `theory` (a `mix` of UCBSpec at cr_scale 1), its rounds."""
    import pandas as pd

    S = summary(res, kinds)
    t = pd.DataFrame({"rounds (target calls)": S["rounds"], "MAT": S["mat"], "= greedy generate": res["identical"]})
    t.loc["per-prompt oracle", "rounds (target calls)"] = S["oracle"]
    t.loc["plain decoding", "rounds (target calls)"] = cfg.gen_len * len(res["reference"])
    if theory is not None:
        theory_rounds = summary(theory, kinds)["rounds"]["UCBSpec"]
        t.loc["UCBSpec, theory radius (cr_scale 1)", "rounds (target calls)"] = theory_rounds
    return t.rename(index={f"fixed {i}": f"fixed {a}" for i, a in enumerate(res["arms"])})


# ------------------------------------------------------------------------------------------ the bench

class CallCounter:
    """Counts forward calls of a model (a forward pre-hook), for target-call counts of any decoding method."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_pre_hook(self._hit)

    def _hit(self, *_):
        self.n += 1


def _timed(fn, counter: CallCounter, prompts: list, n_new: int) -> dict:
    counter.n = 0
    t0 = time.perf_counter()
    outs = [fn(p) for p in prompts]
    wall = time.perf_counter() - t0
    tokens = n_new * len(prompts)
    return {"calls": counter.n, "mat": tokens / max(counter.n, 1), "tok/s": tokens / wall, "outputs": outs}


def _ours(target, arms: list[Arm], n: int, prompt: list[int], **kw) -> list[int]:
    return bandit_generate(target, arms, prompt, n, **kw).tokens


def bench_run(cfg: Config, seed: int = 0, device: str = "cpu", n_prompts: int | None = None,
              n_new: int | None = None) -> dict:
    """Every decoder on the same toy target, drafters and mixed prompts: plain `generate`, `transformers`
    assisted generation with each drafter (γ = L, constant schedule, no confidence cut-off), `transformers`
    prompt lookup (γ = L, n-gram ≤ 3), each fixed arm of ours, UCBSpec and EXP3Spec. Target calls, MAT, tok/s."""
    T = toy(cfg, seed, device, quiet=True)
    target, n = T["target"], n_new or cfg.gen_len
    prompts, _ = mix_prompts(T["task"], n_prompts or cfg.n_prompts, seed)
    counter = CallCounter(target)
    for d in ("draft-E", "draft-G"):
        gc = T[d].generation_config
        gc.num_assistant_tokens, gc.num_assistant_tokens_schedule, gc.assistant_confidence_threshold = cfg.L_b, \
            "constant", 0.0
    arms = lambda: arms_of(T, cfg.L_b, target.config.vocab_size)  # fresh per row: the suffix tree remembers
    rows = {"plain generate": lambda p: plain(target, p, n)}
    for d in ("draft-E", "draft-G"):
        rows[f"transformers assisted ({d})"] = lambda p, d=d: plain(target, p, n, assistant_model=T[d])
    rows["transformers prompt lookup"] = lambda p: plain(target, p, n, prompt_lookup_num_tokens=cfg.L_b,
                                                         max_matching_ngram_size=3)
    for i, a in enumerate(arms()):
        rows[f"ours, fixed {a.name}"] = partial(_ours, target, arms(), n, policy=f"fixed {i}")
    for pol in ("UCBSpec", "EXP3Spec"):
        rows[f"ours, {pol}"] = partial(_ours, target, arms(), n, policy=pol, seed=seed, cr_scale=cfg.cr_scale_b)
    _timed(rows["plain generate"], counter, prompts[:1], n)  # warm-up
    out = {name: _timed(fn, counter, prompts, n) for name, fn in rows.items()}
    counter.handle.remove()
    ref = out["plain generate"]["outputs"]
    for r in out.values():
        r["identical"] = float(np.mean([o == x for o, x in zip(r.pop("outputs"), ref)]))
    return out


def report(res: dict) -> str:
    """The bench as a table of ratios to plain `generate` (calls: fewer is better; tok/s: higher is better)."""
    base = res["plain generate"]
    lines = [f"{'decoder':38s} {'target calls':>12s} {'MAT':>6s} {'tok/s':>8s} {'calls÷plain':>11s} "
             f"{'speed×plain':>11s} {'= greedy':>8s}"]
    for name, r in res.items():
        lines.append(f"{name:38s} {r['calls']:12d} {r['mat']:6.2f} {r['tok/s']:8.0f} "
                     f"{r['calls'] / base['calls']:11.3f} {r['tok/s'] / base['tok/s']:11.2f} {r['identical']:8.2f}")
    return "\n".join(lines)


@bench_registry.register("banditspec")
def main(P: Params, argv: list[str]) -> int:
    """`python -m lab bench banditspec [--prompts N] [--new-tokens N]`: plain, `transformers` assisted generation
    and prompt lookup, our fixed arms, UCBSpec and EXP3Spec on the toy target and drafters, as ratios (--device and
    --seed: the runner's)."""
    ap = argparse.ArgumentParser(prog="python -m lab bench banditspec", description=main.__doc__)
    ap.add_argument("--prompts", type=int, default=8, help="mixed prompts (half edit, half generate)")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt")
    args = ap.parse_args(argv)
    if args.prompts < 2:
        raise bench_registry.BenchError(f"--prompts must be at least 2 (one per domain), got {args.prompts}.")
    if args.new_tokens < 1:
        raise bench_registry.BenchError(f"--new-tokens must be positive, got {args.new_tokens}.")
    print(report(bench_run(Config.for_scale("smoke"), P.seed, P.device, args.prompts, args.new_tokens)))
    return 0
