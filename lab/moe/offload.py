"""An expert-offload engine for decoding MoE models: the engine owns expert storage, a device tier and a host tier.

Policies (per decoded token and offloaded MoE layer; the forms are `lab.moe.offload_store`'s):

- `fp16`:  every routed expert copied whole (`fp` form) on demand into a staging slot (accelerate-style, no cache);
- `int2`:  the same with HQQ INT2 experts (`int2` form, group 64, FP16 scale/zero);
- `lru-fp16`, `lru-int2`: `cache_k` device slots per layer holding whole `fp` / `int2` experts, least recently used
           evicted; a miss is copied into the victim's slot and waited for before the expert runs;
- `mixtral`: Mixtral-offloading (Eliseev & Mazur 2023, dvmazur/mixtral-offloading `src/expert_cache.py`): `mo`
           experts (group-16 HQQ 2-bit, quantized scale/zero, one contiguous block each), an LRU group of `cache_k`
           slots per layer that starts with the layer's last `cache_k` experts (their `offload_per_layer`), a shared
           pool of `n_buffers` device buffers (theirs: 4): a miss is copied into a free buffer, which takes the
           evicted slot's place, and the evicted expert is written back device-to-host into a free pinned host
           buffer (their `_swap`: every expert lives in one tier only, so the host holds the offloaded experts plus
           `n_buffers` buffers); experts already on the device are computed first while the misses load
           (`load_experts(unordered=True)`), and the next layer's experts are guessed by applying its router to this
           layer's MoE input and loaded ahead (the technical report's speculative loading; not in the repository).
           Their repository issues its copies on the compute stream, so on a GPU their loads would not overlap
           compute; here they overlap (on the copy lane, write-backs in the same FIFO): the favourable reading.
           `write_back=False` keeps every host copy valid and copies nothing back (an ablation, not their code);
- `stream`: DeepSpeed ZeRO-3-style streaming: each offloaded layer's whole MoE block (all E `fp` experts, one
           copy here) is fetched when the layer runs, no cache (the FloE authors' DeepSpeed-MII baseline sets the
           MoE block as a ZeRO-3 leaf module; ZeRO's parameter prefetch is not modelled);
- `floe`:  all experts' INT2 W_up (`up` form) stay on the device; at layer i, once its attention output x_i exists,
           the next layer's experts are predicted with router_{i+1}(x_i) and their neurons with top-|x_i W_up^{i+1,e}|
           (`keep`·F rows); those rows of W_gate and W_downᵀ (`rows` form) are gathered on the host and copied into one
           of two device buffers (FloE Sec. 3.4), in `chunks` pieces so that gathering one piece overlaps copying
           the previous (FloE's pipelined packing, Sec. 3.4.2). A mispredicted expert is reloaded with its mask
           from the true x.
           The kept activations are recomputed with the true input, and layer i+1's prefetch is issued before layer
           i's reloads (as the co-authors' engine zju-stu-lizheng/On-the-Fly_MoE does), after layer i's correctly
           prefetched experts are queued.

`predictor="random"` replaces FloE's predictors by random experts and random `keep`·F neurons (seeded).

Residency: during `run` the model's own fused expert parameters of every managed layer (all layers but layer 0 when
it is resident) are released: their data is emptied (the device storage freed, the values kept in host memory) and
the modules show `meta` parameters of the same shapes; both are restored when `run` returns. A storage another tensor
still holds (a view kept by an analysis) is not freed by this: its bytes are `Stats.held_bytes`. Offloaded experts
live only in the host tier (pinned on CUDA, `link.to_host`); the device tier `dev` holds exactly what the policy
keeps there: INT2 W_up and FloE's two buffers, cache slots and buffers, staging slots, and resident layers (`fp`
form). Layer 0, when resident, runs on the model's own weights for every policy and is not counted.
`Stats.resident_bytes` is the sum of the bytes of the tensors in `dev`. Everything is computed in the model's dtype
(FP32, FP16 or BF16): held forms are decoded to it (INT2 dequantized in FP32, as the kernels accumulate); with the
kernels (CUDA) INT2 and Mixtral-offloading experts are computed from their codes (`lab.kernels.int2`) instead.
The attention of each layer is timed by hooks around the model's own attention; time and copies are the link's
(`lab.moe.links`). The policies' layer logic is `lab.moe.offload_policies`. On CPU (the simulator) the forms built
from a model are memoised per experts module and weights version, as a notebook builds an engine per policy,
bandwidth and budget.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lab.models import hooks
from lab.models.sample import cached_step
from lab.moe import offload_store as st
from lab.moe.blocks import moe_blocks, weights
from lab.moe.links import SimLink

POLICIES = ("fp16", "int2", "lru-fp16", "lru-int2", "mixtral", "stream", "floe")
PREDICTORS = ("router", "random")  # FloE's next-layer predictors, or random ones (a control)
FORMS = {"fp16": "fp", "lru-fp16": "fp", "int2": "int2", "lru-int2": "int2", "mixtral": "mo", "stream": "fp",
         "floe": "rows"}


_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # experts module -> (weights signature, forms)


def _memo(ex: nn.Module, key: tuple, make):
    """On CPU (the simulator), an expert's form built once per experts module and weights version, shared by the
    engines a notebook builds for every policy, bandwidth and budget (read-only: they only copy from it)."""
    p, d = ex.gate_up_proj, ex.down_proj
    sig = (p.data_ptr(), p._version, d.data_ptr(), d._version)
    store = _FORMS.get(ex)
    if store is None or store[0] != sig:
        store = _FORMS[ex] = (sig, {})
    if key not in store[1]:
        store[1][key] = make()
    return store[1][key]


def holders(storage: torch.UntypedStorage) -> int:
    """How many references (tensors, views, storage handles) keep `storage` alive, this handle included."""
    return torch._C._storage_Use_Count(storage._cdata)


@dataclass
class Stats:
    bytes: list[int] = field(default_factory=list)  # per token, host->device
    bytes_back: list[int] = field(default_factory=list)  # per token, device->host (Mixtral-offloading's write-back)
    seconds: list[float] = field(default_factory=list)  # per token (modelled on SimLink, measured on CUDA)
    calls: int = 0  # expert calls on offloaded layers
    misses: int = 0  # lru, mixtral: experts not on the device when routed; floe: experts not prefetched
    resident_bytes: int = 0  # bytes of every tensor the engine holds on the device (layer 0, when resident, aside)
    model_bytes: int = 0  # bytes of the model's own parameters left on the device while its experts are released
    held_bytes: int = 0  # bytes of the released expert storages other tensors still hold (not freed: on CUDA in
    # max_memory, though neither the model nor the engine holds them)
    max_memory: int = 0  # CUDA: torch.cuda.max_memory_allocated during the decode (weights, KV cache, activations)
    start_memory: int = 0  # CUDA: torch.cuda.memory_allocated as the decode starts (max_memory − it: transient)


def form_of(policy: str, W: tuple[Tensor, Tensor, Tensor], wd: torch.dtype, group_size: int) -> st.Form:
    """One expert (W_gate, W_up, W_down) in the form `policy` moves it in."""
    kind = FORMS[policy]
    if kind == "fp":
        return st.fp_form(*W, wd)
    if kind == "int2":
        return st.int2_form(*W, group_size)
    if kind == "mo":
        return st.mo_form(*W)
    return st.rows_form(W[0], W[2], wd)


class OffloadEngine:
    """Decode `model` token by token with its offloaded MoE layers served by `policy` over `link`."""

    def __init__(self, model: nn.Module, policy: str, link: SimLink, *, keep: float = 0.2, cache_k: int = 2,
                 resident: tuple[int, ...] = (0,), group_size: int = 64, device: str = "cpu",
                 predictor: str = "router", seed: int = 0, n_buffers: int = 4, chunks: int = 4,
                 kernels: bool | None = None, write_back: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} is unknown; use one of {', '.join(POLICIES)}.")
        if predictor not in PREDICTORS:
            raise ValueError(f"predictor={predictor!r} is unknown; use one of {', '.join(PREDICTORS)}.")
        self.random = torch.Generator().manual_seed(seed) if predictor == "random" else None
        self.model, self.policy, self.link, self.device, self.gs = model, policy, link, device, group_size
        self.blocks = moe_blocks(model)
        self.L, (self.E, self.H, self.F) = len(self.blocks), self.blocks[0].experts.down_proj.shape
        self.top_k, self.dtype = self.blocks[0].gate.top_k, self.blocks[0].experts.down_proj.dtype
        self.wd = st.weight_dtype(self.dtype)
        if policy == "mixtral" and (cache_k < 1 or n_buffers < 2 * self.top_k):
            raise ValueError(f"mixtral needs cache_k ≥ 1 and n_buffers ≥ 2·top_k = {2 * self.top_k}; got "
                             f"cache_k={cache_k}, n_buffers={n_buffers}.")
        self.n_keep, self.cache_k, self.resident = max(1, round(keep * self.F)), min(cache_k, self.E), set(resident)
        self.kernels = str(device).startswith("cuda") if kernels is None else kernels  # Triton on CUDA
        self.managed = [l for l in range(self.L) if not (l == 0 and 0 in self.resident)]
        self.offloaded = [l for l in range(self.L) if l not in self.resident]
        self.host: dict = {}  # the host tier: (l, e) -> form (stream: (l, None) -> the layer's block)
        self.dev: dict[str, st.Form] = {}  # the device tier: place -> form
        self.stats, self.n_buffers, self.chunks = Stats(), n_buffers, chunks
        self.write_back = policy == "mixtral" and write_back  # False: host copies stay valid, nothing is copied back
        self.free: dict[str, object] = {}  # place -> mark after the last compute that read it
        self.ready: dict[str, object] = {}  # place -> when its last copy lands
        self.last_token = None
        attn = hooks.layers(model)[0].self_attn
        self.attn_bytes = 2 * sum(p.numel() for p in attn.parameters())  # fp16 attention weights read per token
        self._build()
        self.stats.resident_bytes = st.nbytes(self.dev)

    # --- the two tiers --------------------------------------------------------------------------
    def _to_dev(self, form: st.Form) -> st.Form:
        return st.to(form, lambda t: t.to(self.device))

    def _form(self, l: int, key: tuple, fn, *args):
        if torch.device(self.device).type != "cpu":
            return fn(*args)
        return _memo(self.blocks[l].experts, key, lambda: fn(*args))

    def _build(self) -> None:
        h, pol, wd, gs = self.link.to_host, self.policy, self.wd, self.gs
        for l in self.managed:
            W = [weights(self.blocks[l], e) for e in range(self.E)]
            if l in self.resident:
                for e in range(self.E):
                    self.dev[f"layer {l}.{e}"] = self._to_dev(self._form(l, ("fp", wd, e), st.fp_form, *W[e], wd))
                continue
            if pol == "stream":
                fp = [self._form(l, ("fp", wd, e), st.fp_form, *W[e], wd)["w"] for e in range(self.E)]
                self.host[l, None] = {"w": h(torch.stack(fp))}
                continue
            for e in range(self.E):
                form = self._form(l, (FORMS[pol], wd, gs, e), form_of, pol, W[e], wd, gs)
                # mixtral writes evicted experts back into host storages: its own, never the memo other engines share
                own = self.write_back and torch.device(self.device).type == "cpu"
                self.host[l, e] = st.to(form, (lambda t: h(t.clone())) if own else h)
                if pol == "floe":
                    self.dev[f"up {l}.{e}"] = self._to_dev(self._form(l, ("up", gs, e), st.up_form, W[e][1], gs))
        if not self.offloaded:
            return
        l0 = self.offloaded[0]
        sample = self.host[l0, None] if pol == "stream" else self.host[l0, 0]
        self.sample_bytes = st.nbytes(sample)
        if pol == "floe":
            for b in range(2):
                self.dev[f"rows {b}"] = st.rows_buffer(self.top_k, self.n_keep, self.H, self.wd, self.device)
            self.slots: dict[int, dict[int, int]] = {}  # layer -> expert -> slot of its buffer
            rows = sample["rows"]  # the host gathers' staging, pinned now rather than inside a timed token
            self.link.reserve(-(-self.n_keep // self.chunks), tuple(rows.shape[1:]), rows.dtype)
        elif pol == "stream":
            self.dev["stage"] = st.empty_like(sample, self.device)
        elif pol == "mixtral" or (pol.startswith("lru") and self.cache_k):
            self.cache = {l: OrderedDict() for l in self.offloaded}  # e -> place, least recently used first
            for l in self.offloaded:
                for i in range(self.cache_k):
                    e = self.E - self.cache_k + i
                    place = self.dev[f"cache {l}.{i}"] = self._place(f"cache {l}.{i}", sample)
                    if pol == "mixtral":  # their cache starts with the experts not offloaded, held on the device only
                        for k, t in place.items():
                            t.copy_(self.host[l, e][k])
                        if self.write_back:
                            del self.host[l, e]
                        self.cache[l][e] = f"cache {l}.{i}"
            self.pool = deque(f"buffer {i}" for i in range(self.n_buffers if pol == "mixtral" else 0))
            for name in self.pool:
                self._place(name, sample)
            # their pinned host buffers: an evicted expert is written back into one, a loaded one's storage joins them
            self.host_pool = deque(st.to(st.empty_like(sample, "cpu"), h) for _ in self.pool if self.write_back)
        else:  # on demand (and an LRU without a cache): one staging slot per routed expert
            for i in range(self.top_k):
                self._place(f"stage {i}", sample)

    def _place(self, name: str, sample: st.Form) -> st.Form:
        self.dev[name] = st.empty_like(sample, self.device)
        return self.dev[name]

    def expert_bytes(self) -> int:
        """Bytes of one offloaded expert in the form its policy moves (stream: one whole layer)."""
        return self.sample_bytes

    def copy(self, src: st.Form, place: str, l: int, what: str, after: tuple = ()) -> object:
        """Copy a form into a device place once `after` and the place's last reader are done; count its bytes."""
        ready = None
        for k, t in src.items():
            ready = self.link.copy(t, self.dev[place][k], l, what, (*after, self.free.get(place)))
            self.stats.bytes[-1] += st.nbytes(t)
        self.ready[place] = ready
        return ready

    def copy_back(self, place: str, dst: st.Form, l: int, what: str) -> object:
        """Copy a device place into a host form (on the same FIFO link, after the place's contents landed); count
        its bytes as device->host."""
        done = None
        for k, t in self.dev[place].items():
            done = self.link.copy(t, dst[k], l, what, (self.ready.get(place),))
            self.stats.bytes_back[-1] += st.nbytes(t)
        return done

    # --- residency ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def released(self):
        """The model's fused expert parameters of the managed layers released: each Parameter's data is emptied
        (its device storage freed; the values kept in host memory) and the module shows a `meta` parameter of the
        same shape in its place; both come back on exit."""
        saved, self.stats.held_bytes = [], 0
        try:
            for l in self.managed:
                for name in ("gate_up_proj", "down_proj"):
                    saved.append(self._release(self.blocks[l].experts, name))
            yield
        finally:
            for ex, name, p, data, device in reversed(saved):
                p.data = data.to(device)
                setattr(ex, name, p)

    def _release(self, ex: nn.Module, name: str) -> tuple:
        """Release one fused parameter (see `released`); returns what restores it. A function of its own so that no
        handle on the released storage outlives it: a loop variable left in `released`'s suspended frame kept the
        last layer's `down_proj` (0.94 GB at Mixtral's shape) on the GPU through every decode of the 2026-12-04
        H200 run, the constant gap between `max_memory_allocated` and the plan."""
        p = getattr(ex, name)
        storage = p.untyped_storage()
        if p.is_cuda:  # held in pinned memory, copied there directly (the restore copies back from it)
            data = torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.data)
        else:
            data = p.data.to("cpu")  # on CPU `data` is p's own storage
        meta = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False)
        device = p.device
        p.data = torch.empty(0, dtype=p.dtype, device=device)
        setattr(ex, name, meta)
        ours = 1 + (data.untyped_storage().data_ptr() == storage.data_ptr())
        if holders(storage) > ours:  # another tensor (a view an analysis kept) holds it: nothing freed
            self.stats.held_bytes += storage.nbytes()
        return ex, name, p, data, device

    @contextlib.contextmanager
    def _timed_attention(self):
        """Each layer's attention as one compute span, around the model's own attention module."""
        handles, start = [], {}
        for l, layer in enumerate(hooks.layers(self.model)):
            handles.append(layer.self_attn.register_forward_pre_hook(
                lambda m, a, l=l: start.__setitem__(l, self.link.mark())))
            handles.append(layer.self_attn.register_forward_hook(
                lambda m, a, out, l=l: self.link.since(start[l], l, self.attn_bytes, "attention")))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    @torch.no_grad()
    def run(self, input_ids: Tensor) -> tuple[Tensor, Stats]:
        """Decode input_ids (1, T) one token at a time; return the logits (T, V) and the statistics."""
        from lab.moe.offload_policies import Served

        cuda = torch.device(self.device).type == "cuda"
        with self.released(), hooks.swap(self.model, {hooks.name_of(self.model, b.experts): Served(self, l, b.experts)
                                                     for l, b in enumerate(self.blocks)}), self._timed_attention():
            self.stats.model_bytes = sum(st.nbytes(p) for p in self.model.parameters() if p.device.type != "meta")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.stats.start_memory = torch.cuda.memory_allocated()
            past, logits = None, []
            for t in range(input_ids.shape[1]):
                self.stats.bytes.append(0)
                self.stats.bytes_back.append(0)
                a = self.link.mark()
                out, past = cached_step(self.model, input_ids[:, t:t + 1], past)
                logits.append(out.logits[0, -1])
                self.stats.seconds.append(self.link.elapsed(a, self.link.mark()))
                self.last_token = a
            if cuda:  # side-stream copies (a speculative load nobody used) may still be writing
                torch.cuda.synchronize()
                self.stats.max_memory = torch.cuda.max_memory_allocated()
        return torch.stack(logits), self.stats

