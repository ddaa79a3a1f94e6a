"""An expert-offload engine for decoding MoE models: host-resident experts, a device cache, byte accounting.

Policies (FloE Sec. 3.4 and the baselines it compares with, per decoded token and MoE layer):

- `fp16`:  every routed expert is copied whole in FP16 on demand (DeepSpeed/accelerate-style, no cache);
- `int2`:  every routed expert is copied whole as HQQ INT2 codes + FP16 scale/zero (Mixtral-offloading's
           2-bit experts, no cache);
- `lru-fp16`, `lru-int2`: whole FP16 / INT2 experts with a per-layer LRU cache of `cache_k` experts
           (Mixtral-offloading's ExpertCache, which holds 2-bit experts); misses are copied synchronously;
- `floe`:  all experts' INT2 W_up stay on the device; at layer i the next layer's experts are predicted
           with router_{i+1}(x_i), their neurons with top-|x_i W_up^{i+1,e}| (`keep`·F rows), and the rows of
           W_gate and W_downᵀ (co-located, (n, 2, H) FP16 — the compact layout of Sec. 3.4.2) are copied
           ahead on the side stream; a misrouted expert is reloaded synchronously with its mask from the true
           x. The kept activations are recomputed with the true input (as the engine of the co-authors'
           zju-stu-lizheng/On-the-Fly_MoE does). As there, layer i+1's prefetch is issued before layer i's
           misrouted experts are reloaded, so on one FIFO copy engine a reload waits behind the prefetch
           (visible in the timeline).

`predictor="random"` replaces both predictors by random ones (FloE's `random_predictor` control): the
prefetched experts are a random top-k and every kept-neuron set a random `keep`·F rows (seeded).

Layers in `resident` keep their experts dense on the device (FloE's GPU-resident layers). Each token is
decoded one at a time with the model's KV cache (prefill is decoded token by token too). The copies and
the clock are the link's (`lab.moe.links`: `SimLink` models time on CPU, `CudaLink` measures it).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F_
from torch import Tensor, nn

from lab.compress.quant import QTensor, quantize
from lab.models import hooks
from lab.moe.blocks import expert, moe_blocks, route, weights
from lab.moe.links import SimLink

POLICIES = ("fp16", "int2", "lru-fp16", "lru-int2", "floe")
PREDICTORS = ("router", "random")  # FloE's next-layer predictors, or random ones (a control)


@dataclass
class Stats:
    bytes: list[int] = field(default_factory=list)  # per token, host->device
    seconds: list[float] = field(default_factory=list)  # per token (modelled on SimLink, measured on CUDA)
    calls: int = 0  # expert calls on offloaded layers
    misses: int = 0  # lru: cache misses; floe: experts not prefetched (synchronous reloads)
    resident_bytes: int = 0  # expert bytes the policy holds on the device (layer 0, resident for all, not counted)


class OffloadEngine:
    """Decode `model` token by token with its offloaded MoE layers served by `policy` over `link`."""

    def __init__(self, model: nn.Module, policy: str, link: SimLink, *, keep: float = 0.2, cache_k: int = 2,
                 resident: tuple[int, ...] = (0,), group_size: int = 64, device: str = "cpu",
                 predictor: str = "router", seed: int = 0):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is unknown; use one of {', '.join(POLICIES)}.")
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor={predictor!r} is unknown; use one of {', '.join(PREDICTORS)}.")
        self.random = torch.Generator().manual_seed(seed) if predictor == "random" else None
        self.model, self.policy, self.link, self.device = model, policy, link, device
        self.blocks = moe_blocks(model)
        self.L, (self.E, self.H, self.F) = len(self.blocks), self.blocks[0].experts.down_proj.shape
        self.n_keep, self.cache_k, self.resident = max(1, round(keep * self.F)), cache_k, set(resident)
        self.offloaded = [l for l in range(self.L) if l not in self.resident]
        self.host: dict[tuple[int, int], dict[str, Tensor]] = {}  # what lives in host memory
        self.up: dict[tuple[int, int], Tensor] = {}  # floe: device-resident INT2 W_up (dequantized for compute)
        self.stats = Stats()
        attn = model.model.layers[0].self_attn
        self.attn_bytes = 2 * sum(p.numel() for p in attn.parameters())  # fp16 attention weights read per token
        for l in self.offloaded:
            for e in range(self.E):
                self._store(l, e, *weights(self.blocks[l], e), group_size)
        self.cache = {l: OrderedDict() for l in self.offloaded}  # lru: e -> device weights
        self.stats.resident_bytes = (len(self.resident - {0}) * self.E * 3 * self.H * self.F * 2  # FP16 layers
                                     + self.stats.resident_bytes)
        if policy.startswith("lru") and self.offloaded:
            self.stats.resident_bytes += cache_k * len(self.offloaded) * self.expert_bytes()
        elif policy == "floe":
            self.stats.resident_bytes += 2 * self.blocks[0].gate.top_k * self.n_keep * 2 * self.H * 2  # 2 buffers
        self.prefetched: dict[int, dict[int, tuple[Tensor, Tensor, object]]] = {}  # floe: l -> e -> (idx, rows, ready)

    # --- host store ----------------------------------------------------------------------------
    def _store(self, l: int, e: int, Wg: Tensor, Wu: Tensor, Wd: Tensor, gs: int) -> None:
        h = self.link.to_host
        if self.policy in ("fp16", "lru-fp16"):
            self.host[l, e] = {"w": h(torch.stack([Wg, Wu, Wd.T]).detach().half())}  # (3, F, H)
        elif self.policy in ("int2", "lru-int2"):
            qs = [quantize(W.detach(), 2, gs) for W in (Wg, Wu, Wd.T)]
            self.host[l, e] = {f"{n}{i}": h(t) for i, q in enumerate(qs)
                               for n, t in (("q", q.packed), ("s", q.scale.half()), ("z", q.zero.half()))}
            self.host[l, e]["meta"] = (gs,)
        else:  # floe: compact rows [gate row j, down column j] in host memory, INT2 W_up on the device
            self.host[l, e] = {"rows": h(torch.stack([Wg, Wd.T], 1).detach().half())}  # (F, 2, H)
            qu = quantize(Wu.detach(), 2, gs)
            self.up[l, e] = qu.dequantize().to(self.device)
            self.stats.resident_bytes += qu.nbytes()

    def expert_bytes(self) -> int:
        """Bytes one whole offloaded expert occupies in transfer form (fp16, int2 and lru policies)."""
        store = self.host[self.offloaded[0], 0]
        return sum(t.numel() * t.element_size() for k, t in store.items() if k != "meta")

    # --- fetching -------------------------------------------------------------------------------
    def _fetch_whole(self, l: int, e: int) -> tuple[Tensor, Tensor, Tensor]:
        store, got, ready = self.host[l, e], {}, None
        for k, t in store.items():
            if k != "meta":
                got[k], ready = self.link.copy(t, l, f"expert {e}")
                self.stats.bytes[-1] += t.numel() * t.element_size()
        self.link.wait(ready)
        if "w" in got:
            return tuple(got["w"].float())
        gs, F, H = store["meta"][0], self.F, self.H
        out = []
        for i in range(3):
            q = QTensor(got[f"q{i}"], got[f"s{i}"].float(), got[f"z{i}"].float(), 2, gs, (F, H))
            out.append(q.dequantize())
        return tuple(out)

    def _whole(self, l: int, e: int) -> tuple[Tensor, Tensor, Tensor]:
        if not self.policy.startswith("lru"):
            return self._fetch_whole(l, e)
        cache = self.cache[l]
        if e in cache:
            cache.move_to_end(e)
        else:
            self.stats.misses += 1
            if self.cache_k == 0:
                return self._fetch_whole(l, e)
            if len(cache) >= self.cache_k:
                cache.popitem(last=False)
            cache[e] = self._fetch_whole(l, e)
        return cache[e]

    def _prefetch(self, l: int, x: Tensor) -> None:
        """FloE: predict layer l's experts and neurons from the current x (1, H); copy their rows ahead."""
        logits, _, _ = route(self.blocks[l], x)
        if self.random is not None:  # control: random experts
            logits = torch.rand(logits.shape, generator=self.random).to(logits.device)
        self.prefetched[l] = {}
        for e in logits.topk(self.blocks[l].gate.top_k, -1).indices[0].tolist():
            self.prefetched[l][e] = self._rows(l, e, x)

    def _rows(self, l: int, e: int, x: Tensor):
        if self.random is None:
            score = (x @ self.up[l, e].T).abs()[0]
        else:  # control: random neurons
            score = torch.rand(self.F, generator=self.random).to(x.device)
        idx = score.topk(self.n_keep).indices.sort().values  # (n_keep,) intra-expert
        rows = self.link.gather(self.host[l, e]["rows"], idx)  # (n_keep, 2, H), one contiguous chunk
        dev, ready = self.link.copy(rows, l, f"rows {e}")
        self.stats.bytes[-1] += rows.numel() * rows.element_size()
        return idx, dev, ready

    # --- the expert layer -----------------------------------------------------------------------
    def _layer(self, l: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """Layer l's experts for one token x (1, H), routed by the model's own router."""
        if self.policy == "floe" and l + 1 < self.L and (l + 1) not in self.resident:
            self._prefetch(l + 1, x)  # issued before this layer computes: the copy overlaps it
        self.link.compute(l, self.attn_bytes, lambda: None, "attention")
        if l in self.resident:
            W = [weights(self.blocks[l], e) for e in top_k_index[0].tolist()]
            nbytes = 2 * sum(w.numel() for ws in W for w in ws)
            return self.link.compute(l, nbytes, lambda: sum(expert(x, *w) * top_k_weights[0, s]
                                                            for s, w in enumerate(W)), "dense")
        experts = top_k_index[0].tolist()
        y = torch.zeros_like(x)
        for slot, e in enumerate(experts):
            self.stats.calls += 1
            if self.policy == "floe":
                got = self.prefetched.get(l, {}).get(e)
                if got is None:  # mispredicted expert (or first offloaded layer): synchronous reload
                    self.stats.misses += 1
                    got = self._rows(l, e, x)
                idx, rows, ready = got
                self.link.wait(ready)
                nbytes = rows.numel() * rows.element_size() + self.F * self.H // 4  # kept rows + INT2 W_up
                out = self.link.compute(l, nbytes, lambda r=rows, u=self.up[l, e][idx]: _sparse_expert(x, r, u),
                                        f"expert {e}")
            else:
                Wg, Wu, Wd_t = self._whole(l, e)
                nbytes = self.expert_bytes()
                out = self.link.compute(l, nbytes, lambda g=Wg, u=Wu, d=Wd_t: expert(x, g, u, d.T), f"expert {e}")
            y += out * top_k_weights[0, slot]
        self.prefetched.pop(l, None)
        return y

    @torch.no_grad()
    def run(self, input_ids: Tensor) -> tuple[Tensor, Stats]:
        """Decode input_ids (1, T) one token at a time; return the logits (T, V) and the statistics."""
        served = {hooks.name_of(self.model, b.experts): _Served(self, l, b.experts) for l, b in enumerate(self.blocks)}
        with hooks.swap(self.model, served):
            past, logits = None, []
            for t in range(input_ids.shape[1]):
                self.stats.bytes.append(0)
                t0 = self.link.now()
                out = self.model(input_ids=input_ids[:, t:t + 1], cache=past, use_cache=True)
                past = out.cache
                logits.append(out.logits[0, -1])
                self.stats.seconds.append(self.link.now() - t0)
        return torch.stack(logits), self.stats


def plan(model: nn.Module, budget: int, keep: float = 0.2, group_size: int = 64) -> dict[str, dict | None]:
    """Engine arguments for each cached policy under one device budget for experts (bytes beyond layer 0):
    the LRU caches hold k = budget // (offloaded layers · expert bytes) whole experts per layer (at most E);
    FloE needs every offloaded expert's INT2 W_up plus its double buffer, and spends what is left on whole
    FP16 layers kept resident from layer 1 up (FloE's GPU-resident layers). None: the policy does not fit."""
    blocks = moe_blocks(model)
    L, (E, H, F), top_k = len(blocks), blocks[0].experts.down_proj.shape, blocks[0].gate.top_k
    int2_matrix = F * math.ceil(H / 4) + 2 * 2 * F * math.ceil(H / group_size)  # codes + fp16 scale and zero
    fp16_layer = E * 3 * H * F * 2
    n_keep = max(1, round(keep * F))
    out = {}
    for policy, whole in (("lru-fp16", 3 * H * F * 2), ("lru-int2", 3 * int2_matrix)):
        out[policy] = {"cache_k": int(min(E, budget // ((L - 1) * whole)))}
    out["floe"] = None
    for r in range(L):  # layers 0..r resident
        off = L - 1 - r
        cost = r * fp16_layer + off * E * int2_matrix + (2 * top_k * n_keep * 2 * H * 2 if off else 0)
        if cost <= budget:
            out["floe"] = {"keep": keep, "resident": tuple(range(r + 1))}
    return out


def _sparse_expert(x: Tensor, rows: Tensor, Wu_kept: Tensor) -> Tensor:
    """FloE expert on the kept neurons: rows (n, 2, H) = [gate row, down column], Wu_kept (n, H)."""
    a_up = x @ Wu_kept.T  # (1, n) recomputed with the true input
    return (F_.silu(x @ rows[:, 0].float().T) * a_up) @ rows[:, 1].float()


class _Served(nn.Module):
    def __init__(self, engine: OffloadEngine, l: int, orig: nn.Module):
        super().__init__()
        self.engine, self.l = engine, l
        self.gate_up_proj, self.down_proj = orig.gate_up_proj, orig.down_proj

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return self.engine._layer(self.l, hidden_states, top_k_index, top_k_weights)
