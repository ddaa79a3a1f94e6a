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
the model's outputs are from the references in ID and OOD. The paper's theorem (its EMID upper bound,
Sec. 4) is the entropy-scaled form Ĥ(√JSD_v + √JSD_t) + 4(JSD_PY^¼ + JSD_QY^¼), as the repo's
`EMIDupperbound(..., entropy_scaler=Ĥ)` computes it ("true upper bound estimate"; Ĥ's definition
UNCONFIRMED). The repo's default, and every correlation it reports, is the *scale-adjusted* formula
√JSD_v + √JSD_t + JSD_PY^¼ + JSD_QY^¼ (Ĥ and the 4 dropped: for correlation only, not a bound).
`term_correlations` splits its correlation with EMID into the terms: the OOD-output term compares the
model's answers with the references, so only the input-shift part is evidence about the shift.

The estimators take embeddings (rows, L2-normalised by the caller as in the repo), so they run on
any model's features, toy or real. The notebook's toy (`Config`, `train_mllm`, `scenarios`) is a tiny
MLLM on the synthetic visual-QA world (`lab.data.vqa`) over the paper's visual × textual shift grid,
with a token-F1 `judge` standing in for the GPT-4-judged relative preference (RP), and
`answer_similarity` as the trivial baseline EMI is compared with.
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
                        "query-response pairing broken, the responses' content kept)",
            "unrelated_errors": "the model answers the clean queries, and a random fraction (U(0, 0.8), drawn per "
                                "scenario, blind to its shift) of its answers falls back on one default answer: "
                                "the responses degrade, but not because of the input shift"}


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
    shuffled: bool = False  # control `shuffled`
    unrelated_errors: bool = False  # control `unrelated_errors`

    @classmethod
    def for_scale(cls, scale: str, control: str = "") -> Config:
        """"full": 1,000 objects per scenario and 4,000 CLUB steps."""
        if control and control not in CONTROLS:
            raise ValueError(f"unknown control {control!r}; known: {', '.join(CONTROLS)}")
        sizes = {} if scale == "smoke" else dict(n_objects=1000, club_steps=4000)
        return cls(**sizes, shuffled=control == "shuffled", unrelated_errors=control == "unrelated_errors")


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
    """The EMID bound as the repo computes it: scale-adjusted (default; for correlation only) or, with
    `entropy_scale` = Ĥ, the paper's theorem's entropy-scaled form."""
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
              answer_tokens: int, shuffle: torch.Generator | None = None, errors: torch.Generator | None = None,
              device: str = "cpu") -> dict:
    """Every (visual, textual) shift of the same `objects`: the model's greedy answers, their exact-match
    accuracy and RP (mean `judge`), and the embeddings EMI needs — the query z = (z_v + z_t)/2 as in the
    repo, the model's responses `ym` and the references `yr`; `examples` holds (question, reference,
    answer, image) with the shifted image (3, 8, 8). With `shuffle` (control `shuffled`) the response
    embeddings are permuted across the queries of each scenario. With `errors` (control
    `unrelated_errors`) the model answers the *clean* queries and, in every shifted scenario, a fraction
    u ~ U(0, 0.8) of its answers (drawn per scenario, blind to the shift) falls back on one default answer:
    degradation unrelated to the input shift. The first scenario is ID."""
    scen, clean = {}, world.encode(objects, generator=torch.Generator().manual_seed(7))
    for vis in visual:
        for txt in textual:
            e = world.encode(objects, visual=vis, textual=txt, generator=torch.Generator().manual_seed(7))
            seen = clean if errors is not None else e
            resp = world.words(mllm.generate(seen["patches"].to(device), seen["prompt"].to(device),
                                             answer_tokens).cpu())
            if errors is not None and scen:  # every shifted scenario: shift-blind errors
                resp = unrelated_errors(resp, float(torch.rand((), generator=errors)) * 0.8, errors)
            zv, zt, ym = enc.image(e["patches"]), enc.text(e["question"]), enc.text(resp)
            ym = ym[torch.randperm(len(ym), generator=shuffle)] if shuffle is not None else ym
            scen[vis, txt] = {"z": (zv + zt) / 2, "zv": zv, "zt": zt, "ym": ym, "yr": enc.text(e["reference"]),
                              "acc": sum(r == ref for r, ref in zip(resp, e["reference"])) / len(resp),
                              "rp": sum(judge(r, ref) for r, ref in zip(resp, e["reference"])) / len(resp),
                              "examples": list(zip(e["question"], e["reference"], resp,
                                                   world.shift_image(objects["image"], *vis)))}
    return scen


def unrelated_errors(responses: list, fraction: float, generator: torch.Generator) -> list:
    """The control `unrelated_errors`: a random `fraction` of the responses all replaced by one response
    drawn at random from the list (a model falling back on a default answer), whatever the shift."""
    n = len(responses)
    hit = torch.randperm(n, generator=generator)[: round(fraction * n)].tolist()
    default = responses[int(torch.randint(n, (), generator=generator))]
    return [default if i in hit else r for i, r in enumerate(responses)]


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
    (every scenario after ID), Spearman(EMI, RP) over all scenarios, Pearson and Spearman(bound, EMID),
    the bound split into its terms (`term_correlations`) and the trivial baseline: Spearman(RP, mean
    cosine between each model answer's embedding and its reference's, `answer_similarity`)."""
    first, *shifts = scen
    gap = torch.tensor([emid(scen[first]["emi"], scen[k]["emi"]) for k in shifts])
    bound = torch.tensor([upper_bound(*scen[k]["jsd"]) for k in shifts])
    emis, rps = torch.tensor([s["emi"] for s in scen.values()]), torch.tensor([s["rp"] for s in scen.values()])
    sim = torch.tensor([answer_similarity(s["ym"], s["yr"]) for s in scen.values()])
    terms = torch.tensor([list(bound_terms(*scen[k]["jsd"]).values()) for k in shifts])  # (shifts, 4)
    return {"emid": gap, "bound": bound, "emi": emis, "rp": rps, "similarity": sim,
            "spearman_emi_rp": spearman(emis, rps), "spearman_similarity_rp": spearman(sim, rps),
            "pearson_emid_bound": pearson(bound, gap), "spearman_emid_bound": spearman(bound, gap),
            "terms": term_correlations(terms, gap)}


def term_correlations(terms: Tensor, gap: Tensor) -> dict:
    """Pearson r (and p) of EMID with each summand of the scale-adjusted bound alone, with the input-shift
    part √JSD_v + √JSD_t, with the output part JSD_PY^¼ + JSD_QY^¼, and the partial r of EMID and the
    input part given the OOD-output term (what the inputs say beyond it). The OOD-output term compares the
    set of the model's answers with the set of references, so it tracks degradation nearly by construction
    (whatever its cause); the input part is the bound's non-tautological content. A term constant over the
    shifts (the ID-output term) has no correlation: (nan, nan)."""
    names = ["visual √JSD", "text √JSD", "ID outputs JSD^¼", "OOD outputs JSD^¼"]
    cols = dict(zip(names, terms.double().T)) | {"inputs": terms[:, :2].double().sum(1),
                                                  "outputs": terms[:, 2:].double().sum(1)}
    out = {k: _pearson_or_nan(v, gap) for k, v in cols.items()}
    qy = cols["OOD outputs JSD^¼"]
    out["inputs | OOD outputs (partial)"] = _pearson_or_nan(_residual(cols["inputs"], qy), _residual(gap, qy))
    return out


def answer_similarity(y_model: Tensor, y_ref: Tensor) -> float:
    """The trivial baseline for EMI: the mean cosine between each model answer's embedding and its own
    reference's (one number per scenario, no estimator)."""
    return torch.nn.functional.cosine_similarity(y_model.double(), y_ref.double(), dim=-1).mean().item()


def _residual(y: Tensor, x: Tensor) -> Tensor:
    """y minus its least-squares line in x (the part of y that x does not explain linearly)."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    return y - (x @ y) / (x @ x) * x if x @ x > 0 else y


def _pearson_or_nan(a: Tensor, b: Tensor) -> tuple[float, float]:
    return pearson(a, b) if a.double().std() > 1e-12 and b.double().std() > 1e-12 else (math.nan, math.nan)


def shuffled_emi(club: CLUB, s: dict, generator: torch.Generator) -> float:
    """EMI of a scenario with its responses permuted across the queries (the pairing broken)."""
    return emi(club, s["z"], s["ym"][torch.randperm(len(s["ym"]), generator=generator)], s["yr"])
