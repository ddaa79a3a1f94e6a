r"""EMI — Oh, Fang, Im, Du & Li, "Understanding Multimodal LLMs Under Distribution Shifts: An
Information-Theoretic Approach", ICML 2025 (arXiv 2502.00577; code: deeplearning-wisc/mllmshift-emi).

**Effective mutual information** of a model on a data distribution P_XY (README / `main.py`):

    EMI(P_XY; P_θ) = I(P_X ⊗ P_θ) − I(P_XY)          (queries vs model responses, minus vs references)

near 0 when the model's responses carry as much query information as the references, negative when
they carry less. **EMID** = EMI(ID) − EMI(OOD) (positive: degradation). Both mutual informations are
CLUB estimates (Cheng et al. 2020) with one fixed estimator, so its bias largely cancels.

The **bound** relates EMID to distribution shifts measured as Jensen–Shannon divergences between
embedding sets, each through von Neumann entropies of uncentred second-moment matrices
(`JSD_cov`: S((C_P + C_Q)/2) − (S(C_P) + S(C_Q))/2): the visual and textual input shifts and how far
the model's outputs are from the references in ID and OOD. The repo reports the *scale-adjusted*
form √JSD_v + √JSD_t + JSD_PY^¼ + JSD_QY^¼ (for correlation only; it is not numerically a bound)
and an entropy-scaled one Ĥ(√JSD_v + √JSD_t) + 4(JSD_PY^¼ + JSD_QY^¼) (Ĥ's definition UNCONFIRMED).

The estimators take embeddings (rows, L2-normalised by the caller as in the repo), so they run on
any model's features, toy or real. The notebook's toy (`Config`, `train_mllm`, `scenarios`) is a tiny
MLLM on the synthetic visual-QA world (`lab.data.vqa`) over the paper's visual × textual shift grid,
with a token-F1 `judge` standing in for the GPT-4-judged relative preference (RP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from lab.core.stats import pearson, spearman
from lab.data.vqa import FrozenEncoders, VisualQA
from lab.models import TrainConfig, TrainResult, fit, optimize
from lab.models.mllm import tiny_mllm

# the notebook's controls: the substitutions a skeptic would make (`control=` in the notebook)
CONTROLS = {"shuffled": "permute the model's response embeddings across the queries of each scenario (the "
                        "query-response pairing broken, the responses' content kept)"}


@dataclass(frozen=True)
class Config:
    """The toy at a scale: the tiny MLLM's training on clean data, the objects asked about in every
    scenario (drawn from seed `object_seed` + seed), the greedy answer length and CLUB's training."""

    mllm_steps: int = 300
    mllm_batch: int = 64
    mllm_lr: float = 2e-3
    object_seed: int = 100
    n_objects: int = 200
    answer_tokens: int = 4  # up to three answer words and <eos>
    club_hidden: int = 64
    club_steps: int = 1500
    club_lr: float = 2e-3
    club_batch: int = 256
    shuffled: bool = False  # the control

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """"full": 1,000 objects per scenario and 4,000 CLUB steps."""
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
        sizes = {} if scale == "smoke" else dict(n_objects=1000, club_steps=4000)
        return cls(**sizes, shuffled=control == "shuffled")


class CLUB(nn.Module):
    """q(y|x) = N(μ(x), diag e^{logvar(x)}), μ and logvar 2-layer MLPs (Tanh, as the repo's `CLUB`;
    Linear95/CLUB uses ReLU), logvar squashed by Tanh to (−1, 1)."""

    def __init__(self, x_dim: int, y_dim: int, hidden: int = 64):
        super().__init__()
        self.p_mu = nn.Sequential(nn.Linear(x_dim, hidden // 2), nn.Tanh(), nn.Linear(hidden // 2, y_dim))
        self.p_logvar = nn.Sequential(nn.Linear(x_dim, hidden // 2), nn.Tanh(), nn.Linear(hidden // 2, y_dim),
                                      nn.Tanh())

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """The CLUB estimate on paired samples x (n, dx), y (n, dy): the mean over i of
        Σ_d −(μ_i − y_i)² / 2σ_i² minus the same averaged over all y_j (positive minus all pairs)."""
        mu, logvar = self.p_mu(x), self.p_logvar(x)  # (n, dy)
        positive = -((mu - y) ** 2) / 2 / logvar.exp()
        negative = -((y[None, :, :] - mu[:, None, :]) ** 2).mean(1) / 2 / logvar.exp()  # (n, dy): mean over j
        return (positive.sum(-1) - negative.sum(-1)).mean()

    def loglikelihood(self, x: Tensor, y: Tensor) -> Tensor:
        """The training objective (up to constants): mean_i Σ_d −(μ_i − y_i)²/σ_i² − log σ_i²."""
        mu, logvar = self.p_mu(x), self.p_logvar(x)
        return (-((mu - y) ** 2) / logvar.exp() - logvar).sum(-1).mean()


def fit_club(x: Tensor, y: Tensor, *, hidden: int = 64, steps: int = 300, lr: float = 1e-3, batch_size: int = 128,
             seed: int = 0, quiet: bool | None = None) -> CLUB:
    """Train q(y|x) by maximum likelihood on pairs (x, y) (Adam), then freeze it."""
    torch.manual_seed(seed)
    club = CLUB(x.shape[1], y.shape[1], hidden).to(x.device)
    g = torch.Generator().manual_seed(seed)

    def step_loss(_: int) -> Tensor:
        i = torch.randint(len(x), (min(batch_size, len(x)),), generator=g)
        return -club.loglikelihood(x[i], y[i])

    optimize(club.parameters(), step_loss, steps=steps, lr=lr, desc="CLUB", quiet=quiet)
    return club.eval().requires_grad_(False)


def emi(club: CLUB, z: Tensor, y_model: Tensor, y_ref: Tensor) -> float:
    """EMI = Î(query; model response) − Î(query; reference response), one fixed estimator."""
    with torch.no_grad():
        return (club(z, y_model) - club(z, y_ref)).item()


def emid(emi_id: float, emi_ood: float) -> float:
    """EMID = EMI(ID) − EMI(OOD): positive when the model's responses lose relevance under the shift."""
    return emi_id - emi_ood


# ------------------------------------------------------------------------------ JSD of embedding sets

def von_neumann_entropy(C: Tensor) -> float:
    """S(C) = −Σ λ log λ over the eigenvalues of C normalised to sum 1, non-positive ones dropped."""
    lam = torch.linalg.eigvalsh(C.double())
    lam = lam[lam > 0]
    lam = lam / lam.sum()
    return float(-(lam * lam.log()).sum())


def jsd_cov(Zp: Tensor, Zq: Tensor, *, normalise: bool = False) -> float:
    """Representation JSD between two embedding sets (n_p, d), (n_q, d) via C = ZᵀZ (uncentred).

    `normalise=False` is the repo's `JSD_cov`, whose mixture (C_P + C_Q)/2 weights each set by its
    size; `normalise=True` divides each C by its trace first (equal weights; a documented deviation
    for sets of unequal size)."""
    Cp, Cq = Zp.double().T @ Zp.double(), Zq.double().T @ Zq.double()
    if normalise:
        Cp, Cq = Cp / Cp.trace(), Cq / Cq.trace()
    return von_neumann_entropy((Cp + Cq) / 2) - (von_neumann_entropy(Cp) + von_neumann_entropy(Cq)) / 2


def upper_bound(jsd_v: float, jsd_t: float, jsd_py: float, jsd_qy: float, *,
                entropy_scale: float | None = None) -> float:
    """The EMID bound as the repo computes it: scale-adjusted (default) or entropy-scaled with Ĥ."""
    jsd_v, jsd_t, jsd_py, jsd_qy = (max(v, 0.0) for v in (jsd_v, jsd_t, jsd_py, jsd_qy))  # round-off below 0
    inputs = math.sqrt(jsd_v) + math.sqrt(jsd_t)
    outputs = jsd_py ** 0.25 + jsd_qy ** 0.25
    return inputs + outputs if entropy_scale is None else entropy_scale * inputs + 4 * outputs


def bound_terms(jsd_v: float, jsd_t: float, jsd_py: float, jsd_qy: float) -> dict[str, float]:
    """The scale-adjusted bound's four summands (for the decomposition bar)."""
    return {"visual √JSD": math.sqrt(max(jsd_v, 0)), "text √JSD": math.sqrt(max(jsd_t, 0)),
            "ID outputs JSD^¼": max(jsd_py, 0) ** 0.25, "OOD outputs JSD^¼": max(jsd_qy, 0) ** 0.25}


# ----------------------------------------------------------------------------- the notebook's toy

def judge(response: list[str], reference: list[str]) -> float:
    """The preference proxy standing in for the GPT-4 judge: token F1 between a response and its
    reference (multiset overlap; the reference scores 1, an empty or disjoint response 0)."""
    common = sum(min(response.count(x), reference.count(x)) for x in set(response))
    if not common:
        return 0.0
    p, r = common / len(response), common / len(reference)
    return 2 * p * r / (p + r)


def train_mllm(world: VisualQA, cfg: Config, seed: int, *, device: str = "cpu") -> TrainResult:
    """The tiny MLLM (`lab.models.mllm`) trained on clean images with canonical questions (or cached)."""
    return fit(partial(tiny_mllm, vocab_size=len(world.tokenizer)), world,
               TrainConfig(steps=cfg.mllm_steps, batch_size=cfg.mllm_batch, lr=cfg.mllm_lr, seed=seed), device=device)


def scenarios(world: VisualQA, mllm: nn.Module, enc: FrozenEncoders, objects: dict, visual: list, textual: list, *,
              answer_tokens: int, shuffle: torch.Generator | None = None, device: str = "cpu") -> dict:
    """Every (visual, textual) shift of the same `objects`: the model's greedy answers, their exact-match
    accuracy and RP (mean `judge`), and the embeddings EMI needs — the query z = (z_v + z_t)/2 as in the
    repo, the model's responses `ym` and the references `yr`. With `shuffle` (the control) the response
    embeddings are permuted across the queries of each scenario. The first scenario is ID."""
    scen = {}
    for vis in visual:
        for txt in textual:
            e = world.encode(objects, visual=vis, textual=txt, generator=torch.Generator().manual_seed(7))
            resp = world.words(mllm.generate(e["patches"].to(device), e["prompt"].to(device), answer_tokens).cpu())
            zv, zt, ym = enc.image(e["patches"]), enc.text(e["question"]), enc.text(resp)
            ym = ym[torch.randperm(len(ym), generator=shuffle)] if shuffle is not None else ym
            scen[vis, txt] = {"z": (zv + zt) / 2, "zv": zv, "zt": zt, "ym": ym, "yr": enc.text(e["reference"]),
                              "acc": sum(r == ref for r, ref in zip(resp, e["reference"])) / len(resp),
                              "rp": sum(judge(r, ref) for r, ref in zip(resp, e["reference"])) / len(resp),
                              "examples": list(zip(e["question"], e["reference"], resp))}
    return scen


def club_pairs(scen: dict) -> tuple[Tensor, Tensor]:
    """CLUB's training pairs pooled over all scenarios: (query, reference) and (query, model response),
    so one fixed estimator scores every scenario and its bias largely cancels in EMI."""
    return (torch.cat([torch.cat([s["z"], s["z"]]) for s in scen.values()]),
            torch.cat([torch.cat([s["yr"], s["ym"]]) for s in scen.values()]))


def measure(scen: dict, club: CLUB) -> dict:
    """Adds each scenario's EMI and its four JSDs against ID (the first scenario): visual and textual
    inputs, ID outputs vs references, this scenario's outputs vs references. Returns the explorer's
    grid (`lab.widgets.emi_bounds`)."""
    ID = next(iter(scen.values()))
    grid = {}
    for key, s in scen.items():
        s["emi"] = emi(club, s["z"], s["ym"], s["yr"])
        s["jsd"] = (jsd_cov(ID["zv"], s["zv"]), jsd_cov(ID["zt"], s["zt"]), jsd_cov(ID["ym"], ID["yr"]),
                    jsd_cov(s["ym"], s["yr"]))
        grid[key] = {"emi": s["emi"], "rp": s["rp"], "jsd": s["jsd"], "examples": s["examples"]}
    return grid


def correlations(scen: dict) -> dict:
    """The claims' statistics over measured scenarios: EMID and the scale-adjusted bound of every shift
    (every scenario after ID), Spearman(EMI, RP) over all scenarios, Pearson and Spearman(bound, EMID)."""
    first, *shifts = scen
    gap = torch.tensor([emid(scen[first]["emi"], scen[k]["emi"]) for k in shifts])
    bound = torch.tensor([upper_bound(*scen[k]["jsd"]) for k in shifts])
    emis, rps = torch.tensor([s["emi"] for s in scen.values()]), torch.tensor([s["rp"] for s in scen.values()])
    return {"emid": gap, "bound": bound, "emi": emis, "rp": rps, "spearman_emi_rp": spearman(emis, rps),
            "pearson_emid_bound": pearson(bound, gap), "spearman_emid_bound": spearman(bound, gap)}


def shuffled_emi(club: CLUB, s: dict, generator: torch.Generator) -> float:
    """EMI of a scenario with its responses permuted across the queries (the pairing broken)."""
    return emi(club, s["z"], s["ym"][torch.randperm(len(s["ym"]), generator=generator)], s["yr"])
