"""What each offload policy does at one MoE layer for one token (the policies are described in `lab.moe.offload`).

Every step goes through the engine's link with its dependencies explicit: a copy for a routed expert after the
routing (`link.mark()` at issue), a FloE gather after the prediction that chose its rows, every copy after the last
compute that read its destination, every compute after the copies it reads (`link.wait`). Experts are computed in
the model's dtype from the forms the engine holds; on CUDA (`engine.kernels`) FloE's INT2 GEMV and masked sparse
kernels (`lab.kernels.floe`), and for whole INT2 experts `lab.kernels.int2`, run in place of the torch reference path
used on CPU. `plan` gives each cached policy's arguments under one device budget.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F_
from torch import Tensor, nn

from lab.moe import offload_store as st
from lab.moe.blocks import moe_blocks, route, weights
from lab.moe.offload import form_of


class Served(nn.Module):
    """Drop-in for a layer's `mlp.experts` that serves it through the engine (exposes the — released — fused
    parameters, so shapes stay readable)."""

    def __init__(self, engine, l: int, orig: nn.Module):
        super().__init__()
        self.engine, self.l = engine, l
        self.gate_up_proj, self.down_proj = orig.gate_up_proj, orig.down_proj

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return layer(self.engine, self.l, hidden_states, top_k_index, top_k_weights)


def _dense(x: Tensor, Wg: Tensor, Wu: Tensor, Wd_t: Tensor) -> Tensor:
    return (F_.silu(x @ Wg.T) * (x @ Wu.T)) @ Wd_t


def _run(eng, l: int, x: Tensor, place: str, what: str, e: int | None = None) -> Tensor:
    """A whole expert held at `place` (an `fp`, `int2` or `mo` form; `e` picks it from a streamed layer). With the
    kernels, INT2 experts are computed from their codes (`lab.kernels.int2`), never dequantized whole."""
    form = eng.dev[place] if e is None else {"w": eng.dev[place]["w"][e]}
    if eng.kernels and "w" not in form:
        from lab.kernels.int2 import int2_expert

        fn = lambda: int2_expert(x[0], *st.int2_parts(form, eng.F, eng.H, eng.gs))[None]
    else:
        fn = lambda: _dense(x, *st.decode(form, eng.F, eng.H, eng.dtype, eng.gs))
    out = eng.link.compute(l, st.nbytes(form), fn, what)
    eng.free[place] = eng.link.mark()
    return out


def layer(eng, l: int, x: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """Layer l's experts for one token x (1, H), routed by the model's own router."""
    experts, w = top_k_index[0].tolist(), top_k_weights[0].to(x.dtype)
    nxt = l + 1 if l + 1 < eng.L and (l + 1) in eng.offloaded else None
    pred = _predict(eng, l, nxt, x) if nxt is not None and eng.policy in ("floe", "mixtral") else None
    if l not in eng.offloaded:
        y = _resident(eng, l, x, experts, w)
        if pred is not None:
            _prefetch(eng, nxt, *pred)
        return y
    eng.stats.calls += len(experts)
    if eng.policy == "floe":
        return _floe(eng, l, x, experts, w, nxt, pred)
    if eng.policy == "mixtral":
        return _mixtral(eng, l, x, experts, w, nxt, pred)
    y = torch.zeros_like(x)
    if eng.policy == "stream":
        eng.link.wait(eng.copy(eng.host[l, None], "stage", l, "MoE block", (eng.link.mark(),)))
        for s, e in enumerate(experts):
            y += _run(eng, l, x, "stage", f"expert {e}", e) * w[s]
        return y
    cache = eng.cache[l] if eng.policy.startswith("lru") and eng.cache_k else None
    for s, e in enumerate(experts):
        if cache is None:  # on demand: a staging slot per routed expert
            place = f"stage {s}"
            eng.stats.misses += eng.policy.startswith("lru")
            eng.copy(eng.host[l, e], place, l, f"expert {e}", (eng.link.mark(),))
        elif e in cache:
            cache.move_to_end(e)
            place = cache[e]
        else:  # LRU miss: copied into the least recently used slot, synchronously
            eng.stats.misses += 1
            place = cache.popitem(last=False)[1] if len(cache) >= eng.cache_k else f"cache {l}.{len(cache)}"
            cache[e] = place
            eng.copy(eng.host[l, e], place, l, f"expert {e}", (eng.link.mark(),))
        eng.link.wait(eng.ready.get(place))
        y += _run(eng, l, x, place, f"expert {e}") * w[s]
    return y


def _resident(eng, l: int, x: Tensor, experts: list[int], w: Tensor) -> Tensor:
    if l == 0 and 0 in eng.resident:  # the model's own layer 0 (FP16 bytes charged, as in Mixtral)
        W = [weights(eng.blocks[0], e) for e in experts]
        fn = lambda: sum(_dense(x, Wg, Wu, Wd.T) * w[s] for s, (Wg, Wu, Wd) in enumerate(W))
        return eng.link.compute(l, 2 * 3 * eng.F * eng.H * len(experts), fn, "dense")
    forms = [eng.dev[f"layer {l}.{e}"] for e in experts]
    fn = lambda: sum(_dense(x, *st.decode(f, eng.F, eng.H, eng.dtype)) * w[s] for s, f in enumerate(forms))
    return eng.link.compute(l, st.nbytes(forms), fn, "dense")


# --------------------------------------------------------------------------------------- prediction, prefetch

def _up_scores(eng, l: int, e: int, x: Tensor) -> Tensor:
    """|x W_upᵀ| (F,) with layer l's resident INT2 W_up of expert e."""
    u = eng.dev[f"up {l}.{e}"]
    if eng.kernels:
        from lab.kernels import floe as kf

        return kf.int2_gemv(x[0], u["q"], u["s"], u["z"], eng.gs, eng.H).abs()
    return (x @ st.dequant(u["q"], u["s"], u["z"], eng.gs, eng.H, eng.dtype).T)[0].abs()


def _predict(eng, l: int, nxt: int, x: Tensor):
    """Layer nxt's experts from router_nxt(x) — FloE also their neurons, top-keep·F |x W_up| — issued once layer l's
    attention output x exists; returns (predictions, mark of their end)."""
    floe = eng.policy == "floe"

    def fn():
        logits = route(eng.blocks[nxt], x)[0]
        if floe and eng.random is not None:  # control: random experts
            logits = torch.rand(logits.shape, generator=eng.random).to(logits.device)
        out = []
        for e in logits.topk(eng.top_k, -1).indices[0].tolist():
            if not floe:
                out.append((e, None))
                continue
            score = (_up_scores(eng, nxt, e, x) if eng.random is None  # control: random neurons
                     else torch.rand(eng.F, generator=eng.random).to(x.device))
            out.append((e, score.topk(eng.n_keep).indices.sort().values))
        return out

    router = eng.blocks[nxt].gate.weight
    nbytes = st.nbytes(router) + (eng.top_k * st.nbytes(eng.dev[f"up {nxt}.0"]) if floe else 0)
    pred = eng.link.compute(l, nbytes, fn, f"predict layer {nxt}")
    return pred, eng.link.mark()


def _prefetch(eng, nxt: int, pred: list, after) -> None:
    if eng.policy == "mixtral":  # speculative loading into the next layer's cache
        for e, _ in pred:
            if e not in eng.cache[nxt]:
                _swap_in(eng, nxt, e, (after,))
        return
    eng.slots[nxt] = {e: (s, _load_rows(eng, nxt, e, idx, s, after)) for s, (e, idx) in enumerate(pred)}


def _load_rows(eng, l: int, e: int, idx: Tensor, s: int, after):
    """Gather expert e's kept rows on the host (after `after`, the compute that chose them) and copy them into slot
    s of layer l's buffer, in `eng.chunks` pieces: gathering a piece overlaps copying the previous one (FloE's
    pipelined packing into pinned memory, Sec. 3.4.2). Returns when the last piece lands."""
    place = f"rows {l % 2}"
    buf = eng.dev[place]
    buf["idx"][s].copy_(idx)  # device-side: the indices were computed on the device
    n, ready, on_host = len(idx), None, eng.link.host_index(idx, after)
    for i in range(eng.chunks):
        a, b = n * i // eng.chunks, n * (i + 1) // eng.chunks
        if a == b:
            continue
        staged, gathered = eng.link.gather(eng.host[l, e]["rows"], on_host[a:b], l, f"gather {e}", after)
        ready = eng.link.copy(staged, buf["rows"][s, a:b], l, f"rows {e}", (gathered, eng.free.get(place)))
        eng.stats.bytes[-1] += st.nbytes(staged)
    return ready


# --------------------------------------------------------------------------------------- FloE

def _sparse(eng, l: int, e: int, x: Tensor, s: int) -> Tensor:
    """FloE expert on the kept neurons of slot s: a_up recomputed with the true x on the kept W_up rows."""
    buf, u = eng.dev[f"rows {l % 2}"], eng.dev[f"up {l}.{e}"]
    rows, idx = buf["rows"][s], buf["idx"][s]
    if eng.kernels:
        from lab.kernels import floe as kf

        return kf.sparse_expert(x[0], rows, u["q"], u["s"], u["z"], idx, eng.gs)[None].to(x.dtype)
    Wu = st.dequant(u["q"][idx], u["s"][idx], u["z"][idx], eng.gs, eng.H, eng.dtype)
    return (F_.silu(x @ rows[:, 0].to(eng.dtype).T) * (x @ Wu.T)) @ rows[:, 1].to(eng.dtype)


def _floe(eng, l: int, x: Tensor, experts: list[int], w: Tensor, nxt, pred) -> Tensor:
    slots, y = eng.slots.pop(l, {}), torch.zeros_like(x)
    place = f"rows {l % 2}"
    row_bytes = st.nbytes(eng.dev[place]["rows"][0]) + eng.n_keep * (st.nbytes(eng.dev[f"up {l}.0"]) // eng.F)
    for slot, e in enumerate(experts):  # correctly prefetched experts first
        if e in slots:
            s, ready = slots[e]
            eng.link.wait(ready)
            y += eng.link.compute(l, row_bytes, lambda s=s, e=e: _sparse(eng, l, e, x, s), f"expert {e}") * w[slot]
    if pred is not None:
        _prefetch(eng, nxt, *pred)
    used = {slots[e][0] for e in experts if e in slots}
    free = iter(s for s in range(eng.top_k) if s not in used)
    for slot, e in enumerate(experts):  # mispredicted: reloaded with the mask from the true x
        if e in slots:
            continue
        eng.stats.misses += 1
        s = next(free)

        def score(e=e):
            sc = (_up_scores(eng, l, e, x) if eng.random is None
                  else torch.rand(eng.F, generator=eng.random).to(x.device))
            return sc.topk(eng.n_keep).indices.sort().values

        idx = eng.link.compute(l, st.nbytes(eng.dev[f"up {l}.{e}"]), score, f"mask {e}")
        eng.link.wait(_load_rows(eng, l, e, idx, s, eng.link.mark()))
        y += eng.link.compute(l, row_bytes, lambda s=s, e=e: _sparse(eng, l, e, x, s), f"expert {e}") * w[slot]
    eng.free[place] = eng.link.mark()
    return y


# --------------------------------------------------------------------------------------- Mixtral-offloading

def _swap_in(eng, l: int, e: int, after: tuple):
    """Their `ExpertCache._swap`: copy expert e from its host storage into a free device buffer, which joins layer
    l's cache; the least recently used slot is written back into a free host buffer (the evicted expert's host
    storage from now on) and joins the device buffers; e's host storage joins the host buffers. Every expert lives
    in one tier only. All copies go through the one FIFO link, in their order (load, then write-back).
    `eng.write_back` False: the host copies stay valid and nothing is copied back."""
    cache = eng.cache[l]
    place = eng.pool.popleft()
    eng.copy(eng.host[l, e], place, l, f"expert {e}", after)
    if len(cache) >= eng.cache_k:
        v, victim = cache.popitem(last=False)
        if eng.write_back:
            eng.host[l, v] = eng.host_pool.popleft()
            eng.copy_back(victim, eng.host[l, v], l, f"write back {v}")
        eng.pool.append(victim)
    if eng.write_back:
        eng.host_pool.append(eng.host.pop((l, e)))
    cache[e] = place
    return place


def _mixtral(eng, l: int, x: Tensor, experts: list[int], w: Tensor, nxt, pred) -> Tensor:
    cache, y = eng.cache[l], torch.zeros_like(x)
    hits = {e: cache[e] for e in experts if e in cache}
    for e in hits:
        cache.move_to_end(e)
    misses = [e for e in experts if e not in cache]
    eng.stats.misses += len(misses)
    now = eng.link.mark()
    loading = {e: _swap_in(eng, l, e, (now,)) for e in misses}  # all issued before any compute
    for e, place in [*hits.items(), *loading.items()]:  # resident experts first, then the loads in order
        eng.link.wait(eng.ready.get(place))
        y += _run(eng, l, x, place, f"expert {e}") * w[experts.index(e)]
    if pred is not None:
        _prefetch(eng, nxt, *pred)
    return y


# --------------------------------------------------------------------------------------- budgets
def plan(model: nn.Module, budget: int, keep: float = 0.2, group_size: int = 64,
         n_buffers: int = 4) -> dict[str, dict | None]:
    """Engine arguments for each cached policy under one device budget for experts (bytes beyond layer 0), from the
    bytes of the forms the engine would hold (built for one expert): LRU caches of k whole experts per offloaded
    layer (at most E; k = 0 holds top_k staging slots), Mixtral-offloading's k slots per layer plus its buffers,
    FloE's INT2 W_up of every offloaded expert and its two buffers, with what is left spent on whole layers kept
    resident from layer 1 up (FloE's GPU-resident layers). None: the policy does not fit."""
    blocks = moe_blocks(model)
    L, (E, H, F), top_k = len(blocks), blocks[0].experts.down_proj.shape, blocks[0].gate.top_k
    wd = st.weight_dtype(blocks[0].experts.down_proj.dtype)
    W = tuple(w.detach() for w in weights(blocks[-1], 0))
    size = {p: st.nbytes(form_of(p, W, wd, group_size)) for p in ("lru-fp16", "lru-int2", "mixtral")}
    out = {}
    for policy in ("lru-fp16", "lru-int2"):
        k = int(min(E, budget // ((L - 1) * size[policy])))
        out[policy] = {"cache_k": k} if k or top_k * size[policy] <= budget else None
    k = int(min(E, (budget - n_buffers * size["mixtral"]) // ((L - 1) * size["mixtral"])))
    out["mixtral"] = {"cache_k": k, "n_buffers": n_buffers} if k >= 1 else None
    up, fp_layer = st.nbytes(st.up_form(W[1], group_size)), E * st.nbytes(st.fp_form(*W, wd))
    bufs = 2 * st.nbytes(st.rows_buffer(top_k, max(1, round(keep * F)), H, wd, "meta"))
    out["floe"] = None
    for r in range(L):  # layers 0..r resident
        off = L - 1 - r
        if r * fp_layer + off * E * up + (bufs if off else 0) <= budget:
            out["floe"] = {"keep": keep, "resident": tuple(range(r + 1))}
    return out
