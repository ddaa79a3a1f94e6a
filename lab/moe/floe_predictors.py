"""FloE's dual predictors (Zhou et al., ICML 2025, Sec. 3.3), measured: from layer i's MoE input x_i, the next layer's
experts through the next layer's router (inter-expert) and its neurons as the top-|x_i W_up^{i+1,e}| with the resident
INT2 W_up (intra-expert); and the trained inter-expert predictor of the co-authors' development code."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F_
from torch import Tensor, nn

from lab.moe.blocks import moe_blocks, route, weights
from lab.moe.floe import check_control


def _cos(a: Tensor, b: Tensor) -> float:
    return F_.cosine_similarity(a, b, dim=-1).mean().item()


@torch.no_grad()
def predictor_stats(model: nn.Module, xs: list[Tensor], keep: float, int2: dict | None = None,
                    router: Callable[[int, Tensor], Tensor] | None = None, control: str = "",
                    seed: int = 0) -> list[dict[str, float]]:
    """For each layer i+1 predicted from layer i's MoE input x_i:

    - `cos`: mean cosine(x_i, x_{i+1});
    - `inter`: unordered top-k overlap of router_{i+1}(x_i) (or `router(i+1, x_i)`) with the true top-k;
    - `intra`: recall of top-⌈keep·F⌉ |x_i W_up^{i+1,e}| against top-⌈keep·F⌉ |x_{i+1} W_up^{i+1,e}| on the
      true experts (W_up from `int2[(i+1, e)].Wu` when given, as resident in the engine).

    Under the `random_predictor` control both predictions are random scores (seeded)."""
    blocks = moe_blocks(model)
    g = torch.Generator(xs[0].device).manual_seed(seed) if check_control(control) == "random_predictor" else None
    rand = lambda *shape: torch.rand(*shape, generator=g, device=xs[0].device)
    E, F = blocks[0].experts.down_proj.shape[0], blocks[0].experts.down_proj.shape[-1]
    n_keep = max(1, round(keep * F))
    out = []
    for i in range(len(xs) - 1):
        x0, x1, nxt = xs[i], xs[i + 1], blocks[i + 1]
        _, _, true = route(nxt, x1)  # (n, k)
        logits = rand(len(x0), E) if g else router(i + 1, x0) if router else route(nxt, x0)[0]
        pred = logits.topk(true.shape[1], -1).indices
        inter = (pred.unsqueeze(-1) == true.unsqueeze(-2)).any(-1).float().mean().item()
        rec = []
        for e in range(E):
            sel = (true == e).any(-1)
            if not sel.any():
                continue
            Wu = int2[(i + 1, e)].Wu if int2 else weights(nxt, e)[1]
            p = (rand(int(sel.sum()), F) if g else (x0[sel] @ Wu.T).abs()).topk(n_keep, -1).indices
            q = (x1[sel] @ Wu.T).abs().topk(n_keep, -1).indices
            hit = torch.zeros(int(sel.sum()), F, device=x0.device).scatter_(1, p, 1).gather(1, q)
            rec.append(hit.mean(-1))
        out.append({"layer": i + 1, "cos": _cos(x0, x1), "inter": inter, "intra": torch.cat(rec).mean().item()})
    return out


def train_inter_predictor(x: Tensor, logits_next: Tensor, router_next: Tensor, top_k: int = 2, hidden: int = 0,
                          epochs: int = 20, lr: float = 5e-4, batch: int = 2048, seed: int = 0) -> nn.Module:
    """The inter-expert predictor of zju-stu-lizheng/On-the-Fly_MoE (the co-authors' development code):
    Linear(H→E) initialised from the next router (`hidden=0`) or Linear–SiLU–Linear, trained with
    SmoothL1 against the multi-hot top-k of the next layer's true logits (Adam, 80/20 split is left to
    the caller)."""
    torch.manual_seed(seed)
    H, E = x.shape[-1], logits_next.shape[-1]
    if hidden:
        net = nn.Sequential(nn.Linear(H, hidden), nn.SiLU(), nn.Linear(hidden, E))
    else:
        net = nn.Linear(H, E, bias=False)
        net.weight.data.copy_(router_next.cpu())
    net = net.to(x.device)
    target = torch.zeros_like(logits_next).scatter_(1, logits_next.topk(top_k, -1).indices, 1.0)
    opt = torch.optim.Adam(net.parameters(), lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=g).split(batch):
            loss = F_.smooth_l1_loss(net(x[idx]), target[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.eval()
