r"""cDPO — Lin, Liang, Xu et al., "Critical Tokens Matter: Token-Level Contrastive Estimation Enhances
LLM's Reasoning Capability", ICML 2025 (arXiv 2411.19943; code: chenzhiling9954/Critical-Tokens-Matter).

(a) **Critical tokens by rollouts** (§2): the rollout ground truth and the replacement test (Fig. 2) live in
`lab.align.critical_tokens`, with the check of (b) against it.

(b) **Contrastive estimation** (§3.1). A positive model P_p (SFT on correct trajectories) and a
negative one P_n (SFT on the most frequent wrong answers, top-p 50%; each side selected per question
independently, as the official `select_data_for_sft_and_dpo`) score each rejected token:

    log s_t = (1 + β) log P_p(y_t | x, y_<t) − β log P_n(y_t | x, y_<t) − log Z,    β = 1,

i.e. softmax((1 + β)·logits_p − β·logits_n) at the realized token (as `calculate_ce_score`); a low
s_t marks a critical token.

(c) **cDPO** (§3.2, Eq. 6): DPO whose rejected side is weighted token by token,

    L = −log σ(γ Σ_t h_w,t − γ Σ_t (1 − s_t) h_l,t),    h_t = log π_θ(y_t|·) − log π_ref(y_t|·),

which is DPO when every s_t = 0. The official trainer instead pairs the t-th chosen and rejected
tokens and averages −log σ(γ(h_w,t − (1 − s_t) h_l,t)) over positions: `variant="official_positionwise"`.
Documented differences from the official code: (1) its position-wise mean runs over prompt positions too (h = 0
there), so its loss and gradient are ours times L / (P + L) (6/13 here), which Adam's update ignores (up to ε and
clipping); (2) its trainer gives the EOS that TRL appends weight 1 (`ce_prob + [0]`), while here EOS is a sampled
response token weighted by its own CE score; (3) its rollout rule falls back to the last critical prefix found
before a reset, where `critical_tokens.critical_token` returns none (−1).

Baselines (Table 3): DPO, RPO (DPO + the chosen response's per-token NLL) and TokenDPO (TDPO2 of Zeng et al. 2024,
`lab.align.losses.tdpo`, α = 0.5, β = γ), each swept like cDPO. The paper starts TokenDPO from its SFT model; here
every arm starts from the base, so that the arms differ in their loss alone (SFT itself, P_p, is reported beside).

Toy conventions: full fine-tuning of copies instead of LoRA; fixed-length responses (no padding in the
position-wise mean); grading by the final digit (`TrickyArithmetic`); every arm swept over a shared lr grid
including lr = 0 (the base), its lr picked on validation questions, at its own γ (`Config.gammas`).
The toy's pipeline (`Config.for_scale`, `preference_pairs`, `contrastive_models`, `lr_sweep`, and
`lab.align.critical_tokens.rollout_study` / `ce_agreement` for (a)) runs (a)–(c) end to end for the notebook.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lab.align.train import optimize, response_logps, train_pairs
from lab.core.params import check_control
from lab.core.stages import stage
from lab.data.arith import TrickyArithmetic, take
from lab.models import TinyLM, TrainResult
from lab.models.sample import sample_responses

Grade = Callable[[Tensor, Tensor], Tensor]  # (question rows (m,), responses (m, k, L)) -> correct (m, k) bool

CONTROLS = {  # the substitutions a skeptic would make; the notebook declares which claims each must break
    "dpo": "cDPO replaced by DPO: every token weight s_t set to 0 in training (Eq. 6 is then DPO)",
    "uniform_s": "each s_t cDPO trains with set to its trajectory's mean s (same total weight, no token singled out)",
    "shuffled_s": "each trajectory's s_t permuted over its positions (the same weights, on random tokens)",
    "swapped_ce": "contrastive estimation with P_p and P_n swapped: softmax((1+β)·logits_n − β·logits_p)",
    "random_token": "the rollout critical token replaced by a uniformly random response position",
}

# Best validation accuracy over the lr grid (lr > 0) per γ, seeds 0 and 1 (`scripts/cdpo_gamma_tuning.py 0 1`; seed 2
# was not finished): `Config.gammas` takes each arm's γ of highest mean, DPO 1.0 and cDPO 0.5.
GAMMA_TUNING = {"dpo": {"0.1": [0.523, 0.623], "0.5": [0.933, 0.67], "1.0": [0.987, 0.947]},
                "cdpo": {"0.1": [0.8, 1.0], "0.5": [1.0, 0.913], "1.0": [0.897, 1.0]}}


@dataclass(frozen=True)
class Config:
    """The tricky-arithmetic toy (`lab.data.arith.TrickyArithmetic`: tricky operations flipped w.p. 0.6, steps
    1–2, responses opened by one of 48 free wording tokens, so that a chosen and a rejected trajectory part before
    the critical token and a rare wording is as improbable under P_p as a wrong operation): a 1-layer Llama base
    trained on its noisy traces, N samples per training question, P_p / P_n by SFT,
    K rollouts per prefix on up to `n_rollout` rejected trajectories, the arms over an lr sweep (lr = 0 is
    the base; each arm's lr picked on `n_val` validation questions, accuracy reported on `n_test` others)."""

    flip: float = 0.6
    max_step: int = 2
    n_wordings: int = 48  # responses open with a free wording token (`TrickyArithmetic.n_wordings`; 0: none)
    base: TinyLM = TinyLM(d_model=64, n_layers=1, n_heads=4, max_len=16, steps=400, batch_size=64, lr=3e-3)
    n_test: int = 500  # held-out questions for greedy accuracy (reported)
    n_val: int = 300  # other held-out questions, to pick each arm's lr
    n_train: int = 300  # questions sampled for the pairs
    n_samples: int = 16  # N trajectories per training question
    top_p: float = 0.5  # P_n's data covers this share of the wrong samples
    sft_steps: int = 200  # P_p and P_n
    sft_lr: float = 1e-3
    sft_batch: int = 32
    K: int = 16  # rollouts per prefix
    n_rollout: int = 100  # rejected trajectories studied by rollouts (at most)
    arms: tuple[str, ...] = ("dpo", "rpo", "tokendpo", "cdpo", "cdpo_positionwise")
    lrs: tuple[float, ...] = (0.0, 3e-5, 1e-4, 3e-4, 1e-3)  # lr = 0: the base itself (1e-5 left it unchanged)
    # γ per arm: DPO's and cDPO's picked on validation over γ ∈ {0.1, 0.5, 1.0} × `lrs` (GAMMA_TUNING); others 0.1
    gammas: tuple[tuple[str, float], ...] = (("dpo", 1.0), ("rpo", 0.1), ("tokendpo", 0.1), ("cdpo", 0.5),
                                             ("cdpo_positionwise", 0.1))
    steps: int = 150  # preference training, every arm and lr
    batch_size: int = 32
    every: int = 20  # log the chosen / rejected log-likelihoods every this many steps
    n_show: int = 8  # trajectories in the explorer

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """Sizes for the scale; a control (see `CONTROLS`) changes no size."""
        check_control(control, CONTROLS)
        return cls() if scale == "smoke" else cls(n_test=2000, n_val=1000, n_train=1000, n_samples=64, sft_steps=600,
                                                  K=64, n_rollout=300, lrs=(0.0, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3),
                                                  steps=600)

    def task(self) -> TrickyArithmetic:
        return TrickyArithmetic(flip=self.flip, max_step=self.max_step, n_wordings=self.n_wordings)

    def gamma(self, gamma: float = 0.0) -> dict[str, float]:
        """{arm: γ}: each arm's own (`gammas`), or `gamma` for every arm when it is not 0."""
        return {arm: gamma or dict(self.gammas)[arm] for arm in self.arms}


def ce_models(pos, neg, control: str = "") -> tuple:
    """(P_p, P_n) as contrastive estimation uses them: swapped under the `swapped_ce` control."""
    return (neg, pos) if check_control(control, CONTROLS) == "swapped_ce" else (pos, neg)


def training_scores(s: Tensor, control: str = "", *, seed: int = 0) -> Tensor:
    """The CE scores cDPO trains with: s itself; zeros under `dpo` (cDPO is then DPO); each row's mean under
    `uniform_s`; each row permuted (a fixed random permutation per row, from `seed`) under `shuffled_s`."""
    control = check_control(control, CONTROLS)
    if control == "dpo":
        return torch.zeros_like(s)
    if control == "uniform_s":
        return s.mean(-1, keepdim=True).expand_as(s).clone()
    if control == "shuffled_s":
        g = torch.Generator().manual_seed(seed)
        return s.gather(-1, torch.stack([torch.randperm(s.shape[-1], generator=g) for _ in range(len(s))]).to(s.device))
    return s


# --------------------------------------------------------------------------------- (b) selection, CE

def select(answers: Tensor, correct: Tensor, *, top_p: float = 0.5) -> list[dict]:
    """Per question from N samples (answers (Q, N), −1 = unparsable; correct (Q, N)), chosen independently as
    the official `select_data_for_sft_and_dpo`: `pos`, one sample of the most frequent correct answer (None if
    no sample is correct; P_p's data); `neg`, one sample of each most frequent wrong answer until they cover
    `top_p` of the wrong samples, after the first only answers seen more than once (empty if none is wrong;
    P_n's data). A question gives a DPO pair (pos, neg[0]) only when it has both."""
    out = []
    for a, ok in zip(answers.tolist(), correct.tolist()):
        right = Counter(x for x, y in zip(a, ok) if y)
        wrong = Counter(x for x, y in zip(a, ok) if not y and x >= 0)
        pos = a.index(right.most_common(1)[0][0]) if right else None
        neg, covered, total = [], 0, sum(wrong.values())
        for ans, count in wrong.most_common():
            if covered >= top_p * total or (neg and count <= 1):
                break
            neg.append(next(i for i, (x, y) in enumerate(zip(a, ok)) if x == ans and not y))
            covered += count
        out.append({"pos": pos, "neg": neg})
    return out


@torch.no_grad()
def ce_scores(pos, neg, prompts: Tensor, responses: Tensor, *, beta: float = 1.0) -> Tensor:
    """s (n, L): the realized tokens' probabilities under softmax((1+β)·logits_p − β·logits_n)."""
    ids, P = torch.cat([prompts, responses], 1), prompts.shape[1]
    lp = pos(input_ids=ids).logits[:, P - 1:-1].float()  # position t predicts token t+1
    ln = neg(input_ids=ids).logits[:, P - 1:-1].float()
    return F.softmax((1 + beta) * lp - beta * ln, -1).gather(-1, responses[..., None])[..., 0].cpu()


# ------------------------------------------------------------------------------------- (c) the loss

def cdpo_loss(pi_w: Tensor, ref_w: Tensor, pi_l: Tensor, ref_l: Tensor, s: Tensor, *, gamma: float = 0.1,
              variant: str = "paper") -> Tensor:
    """Per-example cDPO loss (B,) from per-token log-probs (B, L) of chosen (w) and rejected (l)
    responses under the policy and the reference, and CE scores s (B, L) of the rejected tokens."""
    w = 1 - s.detach()  # no gradient into the frozen P_p / P_n
    if variant == "paper":
        return -F.logsigmoid(gamma * ((pi_w - ref_w).sum(-1) - (w * (pi_l - ref_l)).sum(-1)))
    if variant == "official_positionwise":
        return -F.logsigmoid(gamma * ((pi_w - ref_w) - w * (pi_l - ref_l))).mean(-1)
    raise ValueError(f"variant={variant!r} is not 'paper' or 'official_positionwise'.")


def arm_loss(arm: str, pi_w, ref_w, pi_l, ref_l, s, *, gamma: float, kl: Tensor | None = None) -> Tensor:
    """Mean loss of one batch for an arm: dpo, rpo (NLL weight 1 per token), cdpo, cdpo_positionwise, tokendpo
    (TDPO2, α = 0.5, β = γ; `kl` (B, 2): the sequential KLs of the chosen and the rejected responses)."""
    from lab.align import LOSSES

    if arm.startswith("cdpo"):
        variant = "official_positionwise" if arm.endswith("positionwise") else "paper"
        return cdpo_loss(pi_w, ref_w, pi_l, ref_l, s, gamma=gamma, variant=variant).mean()
    pi = torch.stack([pi_w.sum(-1), pi_l.sum(-1)], 1)  # (B, 2) sequence log-probs
    ref = torch.stack([ref_w.sum(-1), ref_l.sum(-1)], 1)
    if arm == "tokendpo":
        return LOSSES["tdpo"](pi, ref, beta=gamma, kl=kl).mean()
    extra = {"chosen_len": torch.full((len(pi),), float(pi_w.shape[1]), device=pi.device)} if arm == "rpo" else {}
    return LOSSES[arm](pi, ref, beta=gamma, **extra).mean()


def fine_tune(model, prompts: Tensor, responses: Tensor, *, steps: int, lr: float, batch_size: int,
              seed: int = 0, quiet: bool | None = None) -> list[float]:
    """SFT in place on (prompt, response) pairs, loss on the response tokens (P_p, P_n): Adam through
    `lab.align.train.optimize`, a batch of `batch_size` pairs drawn with replacement per step."""
    g = torch.Generator().manual_seed(seed)
    model.train()

    def step_loss(_: int) -> Tensor:
        i = torch.randint(len(prompts), (batch_size,), generator=g)
        return -response_logps(model, prompts[i], responses[i]).mean()

    losses = optimize(model.parameters(), step_loss, steps=steps, lr=lr, desc="sft", quiet=quiet)
    model.eval()
    return losses


def train_arm(base, pairs: dict[str, Tensor], arm: str, *, gamma: float, **kw) -> tuple[torch.nn.Module, dict]:
    """One arm (dpo, rpo, cdpo, cdpo_positionwise, tokendpo) from `base` on pairs {prompt, chosen, rejected, s}
    (`lab.align.train.train_pairs`: the policy and its chosen / rejected log-likelihood log)."""
    def loss(b: dict[str, Tensor]) -> Tensor:
        kl = torch.stack([b["kl_w"], b["kl_l"]], 1) if arm == "tokendpo" else None
        return arm_loss(arm, b["pi_w"], b["ref_w"], b["pi_l"], b["ref_l"], b.get("s"), gamma=gamma, kl=kl)

    return train_pairs(base, pairs, loss, desc=arm, kl=arm == "tokendpo", **kw)


# ------------------------------------------------------------------- the toy's pipeline (§2, §3, Table 3)

def base_model(task: TrickyArithmetic, cfg: Config, *, seed: int, device: str) -> TrainResult:
    """The base: a tiny Llama trained on the task's noisy traces (cached by config)."""
    return cfg.base.fit(task, len(task.tokenizer), seed=seed, device=device)


@dataclass
class Pairs:
    """§3's data from N trajectories sampled per question (`select`): the questions that give a pair, their
    prompts, chosen and rejected trajectories (n, L), P_p's and P_n's data (every question with a correct /
    a wrong sample, as the official pipeline), and every sample's grade (Q, N)."""

    questions: dict[str, Tensor]
    prompts: Tensor
    chosen: Tensor
    rejected: Tensor
    pos_prompts: Tensor
    pos_responses: Tensor
    neg_prompts: Tensor
    neg_responses: Tensor
    correct: Tensor


@stage
def preference_pairs(model, task: TrickyArithmetic, q: dict[str, Tensor], N: int, *, top_p: float = 0.5,
                     generator: torch.Generator, device: str = "cpu") -> Pairs:
    """Sample N trajectories per question at T = 1, grade them and `select`: the pair (most frequent correct,
    most frequent wrong) where a question has both; P_p's and P_n's data from every question independently."""
    samples = sample_responses(model, q["prompt"].to(device), N, task.response_len, generator=generator,
                               temperature=1.0)
    correct = task.grade(q, samples)
    sel = select(task.final_answer(samples), correct, top_p=top_p)
    kept = [i for i, s in enumerate(sel) if s["pos"] is not None and s["neg"]]
    pos = [(i, s["pos"]) for i, s in enumerate(sel) if s["pos"] is not None]
    neg = [(i, j) for i, s in enumerate(sel) for j in s["neg"]]
    rows = torch.tensor(kept, dtype=torch.long)
    return Pairs(take(q, rows), q["prompt"][rows], samples[rows, [sel[i]["pos"] for i in kept]],
                 samples[rows, [sel[i]["neg"][0] for i in kept]],
                 torch.stack([q["prompt"][i] for i, _ in pos]), torch.stack([samples[i, j] for i, j in pos]),
                 torch.stack([q["prompt"][i] for i, _ in neg]), torch.stack([samples[i, j] for i, j in neg]), correct)


@stage
def contrastive_models(base, data: Pairs, cfg: Config, *, seed: int, device: str = "cpu") -> tuple:
    """(P_p, P_n) of §3.1: copies of the base fine-tuned on P_p's correct and P_n's wrong trajectories."""
    pos, neg = copy.deepcopy(base), copy.deepcopy(base)
    sft = dict(steps=cfg.sft_steps, lr=cfg.sft_lr, batch_size=cfg.sft_batch, seed=seed)
    fine_tune(pos, data.pos_prompts.to(device), data.pos_responses.to(device), **sft)
    fine_tune(neg, data.neg_prompts.to(device), data.neg_responses.to(device), **sft)
    return pos, neg


def lr_sweep(base, pairs: dict[str, Tensor], cfg: Config, *, gamma: float | dict[str, float], seed: int,
             task: TrickyArithmetic, val: dict[str, Tensor], test: dict[str, Tensor],
             device: str = "cpu") -> dict[tuple[str, float], dict]:
    """Every arm of `cfg.arms` at every lr of `cfg.lrs`, from the base on the same pairs and steps (Table 3,
    Fig. 4), at γ `gamma` (or `gamma[arm]`): {(arm, lr): {"val", "acc": greedy accuracy on `val` (to pick the lr)
    and on `test`, "log": `train_arm`'s log, "rejected_drop"}}. lr = 0 is the base itself (not trained; its log is
    flat). Each arm is a cached stage keyed without the scores s unless it trains with them, so a control that
    changes only s retrains only cDPO."""
    results = {}
    for arm in cfg.arms:
        used = pairs if arm.startswith("cdpo") else {k: v for k, v in pairs.items() if k != "s"}
        g = gamma[arm] if isinstance(gamma, dict) else gamma
        for lr, r in arm_sweep(base, used, arm, cfg, gamma=g, seed=seed, task=task, val=val, test=test,
                               device=device).items():
            results[arm, lr] = r
    return results


@stage
def arm_sweep(base, pairs: dict[str, Tensor], arm: str, cfg: Config, *, gamma: float, seed: int,
              task: TrickyArithmetic, val: dict[str, Tensor], test: dict[str, Tensor],
              device: str = "cpu") -> dict[float, dict]:
    """One arm of `lr_sweep` at every lr of `cfg.lrs`: {lr: {"val", "acc", "log", "rejected_drop": (n, L) how far
    training lowered each rejected token, log π_ref − log π_θ}} (greedy accuracy draws nothing)."""
    results, greedy = {}, torch.Generator()
    with torch.no_grad():
        ref_l = response_logps(base, pairs["prompt"], pairs["rejected"]).cpu()
    for lr in cfg.lrs:
        if lr == 0:
            policy = base
            with torch.no_grad():
                w, l_ = (response_logps(base, pairs["prompt"], pairs[k]).sum(-1).mean().item()
                         for k in ("chosen", "rejected"))
            log = {"step": [0, cfg.steps], "chosen": [w, w], "rejected": [l_, l_], "loss": []}
        else:
            policy, log = train_arm(base, pairs, arm, steps=cfg.steps, lr=lr, gamma=gamma,
                                    batch_size=cfg.batch_size, seed=seed, every=cfg.every)
        with torch.no_grad():
            drop = ref_l - response_logps(policy, pairs["prompt"], pairs["rejected"]).cpu()
        results[lr] = {"val": task.greedy_accuracy(policy, val, generator=greedy, device=device),
                       "acc": task.greedy_accuracy(policy, test, generator=greedy, device=device), "log": log,
                       "rejected_drop": drop}
    return results


def best_lrs(results: dict[tuple[str, float], dict]) -> dict[str, float]:
    """Each arm's lr of highest greedy accuracy on the validation questions (the first of the sweep on a tie)."""
    arms = dict.fromkeys(arm for arm, _ in results)
    return {arm: max((lr for a, lr in results if a == arm), key=lambda lr: results[arm, lr]["val"]["all"])
            for arm in arms}


def by_run(results: dict[tuple[str, float], dict], what: str = "acc") -> dict[str, object]:
    """{"arm@lr": results[arm, lr][what]}."""
    return {f"{arm}@{lr:g}": r[what] for (arm, lr), r in results.items()}


def chosen_drop(results: dict[tuple[str, float], dict]) -> dict[str, float]:
    """{"arm@lr": how far training moved the mean chosen log-likelihood down (first − last logged value)}."""
    return {run: log["chosen"][0] - log["chosen"][-1] for run, log in by_run(results, "log").items()}
