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

Everything here takes embeddings (rows, L2-normalised by the caller as in the repo), so it runs on
any model's features, toy or real.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lab.core import progress
from lab.core.stats import pearson, spearman  # noqa: F401 (re-exported: EMID vs bound correlations)


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
    opt = torch.optim.Adam(club.parameters(), lr=lr)
    for _ in progress(range(steps), quiet=quiet, desc="CLUB"):
        i = torch.randint(len(x), (min(batch_size, len(x)),), generator=g)
        loss = -club.loglikelihood(x[i], y[i])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
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
